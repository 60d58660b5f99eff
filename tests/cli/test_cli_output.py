"""Every command, and every ``--help``, when its stdout fails: never a traceback.

Three ways a stdout fails (``cli/output.py``): the reader closes the pipe
(``| head -1``), which ends the command silently with status 141 as SIGPIPE
ends a Unix tool; stdout is closed (``>&-``) or full (``> /dev/full``), which
is one line ``PROG: cannot write to stdout: REASON`` on stderr and status 1.
Each runs in a real process: only there is file descriptor 1 closed or a pipe
broken.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoints import write_checkpoint
from recurrent_cache import Batch, RecurrentCache

READER_LEFT = 141   # what a shell reports for a process ended by SIGPIPE
OUTPUT_FAILED = 1

DEMO = ["demo", "--clients", "2", "--parallel", "2", "--n-predict", "2", "--quiet"]

# name -> the command line; BLOB, BIG_BLOB, HF_DIR and OUT stand for files the test makes
COMMANDS = {
    "demo": DEMO,
    "demo --fork": ["demo", "--fork", "--parallel", "2", "--n-predict", "2", "--quiet"],
    "demo --prefix-cache": DEMO + ["--prefix-cache"],
    "demo --speculative": ["demo", "--speculative", "2", "--clients", "2", "--parallel", "2", "--n-predict", "4",
                           "--quiet"],
    "demo --write-model": ["demo", "--random-weights", "--write-model", "OUT"],
    "generate": ["generate", "def f", "-n", "20"],
    "generate --tokens": ["generate", "--tokens", "100,101,102", "-n", "20"],
    "inspect": ["inspect", "BLOB"],
    "convert": ["convert", "HF_DIR", "OUT"],
    "--help": ["--help"],
    "demo --help": ["demo", "--help"],
    "generate --help": ["generate", "--help"],
    "inspect --help": ["inspect", "--help"],
    "convert --help": ["convert", "--help"],
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny valid Mamba checkpoint (written with numpy, as transformers lays it out), for ``convert``."""
    return write_checkpoint(tmp_path_factory.mktemp("hf") / "checkpoint", "mamba1")


def blob(directory: Path, n_seq: int) -> Path:
    """A whole-cache state blob of ``n_seq`` cells, one sequence each."""
    cache = RecurrentCache(1, 4, 4, n_seq_max=n_seq)
    for _ in cache.init_batch(Batch(token=[1] * n_seq, pos=[0] * n_seq, seq_id=list(range(n_seq)))):
        pass
    path = directory / f"state-{n_seq}.bin"
    path.write_bytes(cache.state_write())
    return path


def command_line(name: str, request: pytest.FixtureRequest, directory: Path) -> list[str]:
    """``python -m recurrent_cache ...`` of ``COMMANDS[name]``, with its files made."""
    files = {"BLOB": lambda: blob(directory, 2), "OUT": lambda: directory / "out.gguf",
             "HF_DIR": lambda: request.getfixturevalue("hf_dir")}
    args = [str(files[arg]()) if arg in files else arg for arg in COMMANDS[name]]
    return [sys.executable, "-m", "recurrent_cache", *args]


def prog(name: str) -> str:
    """How the command names itself on stderr."""
    first = COMMANDS[name][0]
    return "python -m recurrent_cache" if first.startswith("-") else first


def assert_no_traceback(stderr: str) -> None:
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr


@pytest.mark.parametrize("name", COMMANDS)
def test_a_closed_stdout_is_one_line(name, request, tmp_path):
    """``python -m recurrent_cache ... >&-``: the command starts without file descriptor 1."""
    shell = shutil.which("sh")
    if shell is None:
        pytest.skip("no sh to start a command with its stdout closed")
    result = subprocess.run([shell, "-c", 'exec "$@" >&-', "sh", *command_line(name, request, tmp_path)],
                            stderr=subprocess.PIPE, text=True, timeout=300)
    assert_no_traceback(result.stderr)
    assert (result.returncode, result.stderr) == (OUTPUT_FAILED, f"{prog(name)}: cannot write to stdout: "
                                                                 "it is closed\n")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
@pytest.mark.parametrize("name", COMMANDS)
def test_a_full_stdout_is_one_line(name, request, tmp_path):
    """``python -m recurrent_cache ... > /dev/full``: every write fails with ENOSPC."""
    with open("/dev/full", "w") as full:
        result = subprocess.run(command_line(name, request, tmp_path), stdout=full, stderr=subprocess.PIPE,
                                text=True, timeout=300)
    assert_no_traceback(result.stderr)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == OUTPUT_FAILED, result.stderr
    assert lines[-1] == f"{prog(name)}: cannot write to stdout: No space left on device", result.stderr
    # generate's figures go to stderr only after the text is out; nothing else precedes the line
    assert len(lines) == 1, result.stderr


@pytest.mark.parametrize("name", COMMANDS)
def test_a_reader_gone_before_the_first_line_ends_it_silently(name, request, tmp_path):
    """``python -m recurrent_cache ... | head -0``: the pipe is closed before the command writes."""
    process = subprocess.Popen(command_line(name, request, tmp_path), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    process.stdout.close()
    stderr = process.stderr.read()
    status = process.wait(timeout=300)
    assert (status, stderr) == (READER_LEFT, ""), stderr


def first_lines_then_close(command: list[str], n: int) -> tuple[list[str], int, str]:
    """``command | head -n``: the first ``n`` lines of its stdout, then its exit status and stderr."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = [process.stdout.readline() for _ in range(n)]
    process.stdout.close()
    stderr = process.stderr.read()
    return lines, process.wait(timeout=300), stderr


@pytest.mark.parametrize("name", COMMANDS)
def test_head_1_of_every_command_is_quiet(name, request, tmp_path):
    """The reader leaves after one line: a command that had written everything by then ends as it
    would (0); one that writes more ends silently with 141."""
    lines, status, stderr = first_lines_then_close(command_line(name, request, tmp_path), 1)
    assert_no_traceback(stderr)
    assert lines[0].strip(), "the first line arrived"
    assert status in (0, READER_LEFT), stderr
    if status == READER_LEFT:
        assert stderr == ""


def test_inspect_piped_to_head_3_exits_as_a_unix_tool(tmp_path):
    """The issue's ``inspect F | head -3``: thousands of cells, far more than a pipe holds."""
    path = blob(tmp_path, 5000)
    lines, status, stderr = first_lines_then_close(
        [sys.executable, "-m", "recurrent_cache", "inspect", str(path), "--max-cells", "0"], 3)
    assert lines == [f"{path}: state blob\n", f"blob: {path.stat().st_size} bytes at byte 0, whole-cache\n",
                     "cells: 5000\n"]
    assert (status, stderr) == (READER_LEFT, "")


def test_generate_piped_to_head_1_stops_at_once(tmp_path):
    """generate streams token by token: the write after the reader left ends it, silently."""
    lines, status, stderr = first_lines_then_close(
        [sys.executable, "-m", "recurrent_cache", "generate", "x", "-n", "1000000"], 1)
    assert lines[0].startswith("x")
    assert (status, stderr) == (READER_LEFT, "")


def test_a_shell_pipeline_with_pipefail_reports_sigpipe(tmp_path):
    """What a user's shell sees: head's lines, and (with pipefail) the status of a SIGPIPE."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash for set -o pipefail")
    path = blob(tmp_path, 5000)
    command = f"set -o pipefail; '{sys.executable}' -m recurrent_cache inspect '{path}' --max-cells 0 | head -3"
    result = subprocess.run([bash, "-c", command], capture_output=True, text=True, timeout=300)
    assert result.stdout.splitlines()[2] == "cells: 5000"
    assert (result.returncode, result.stderr) == (READER_LEFT, "")
