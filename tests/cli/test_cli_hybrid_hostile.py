"""Issue 28's attack on the command line with a hybrid model (a Jamba GGUF the package writes): every
command that serves one, with its stdout closed (``>&-``: one line on stderr, status 1) or its reader
gone (``| head -0``: silent, status 141 as SIGPIPE ends a Unix tool) — never a traceback.  (``inspect`` and
``convert`` take no model: ``test_cli_output.py`` covers them.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from recurrent_cache.models import random_jamba_model, write_gguf

pytest.importorskip("gguf", reason="writing the GGUF file needs the gguf package")

# a process per run (about 4 s each on 2 shared cores): found nothing to fix, kept as a guard for CI
pytestmark = pytest.mark.slow

READER_LEFT = 141
OUTPUT_FAILED = 1
SERVE = ["--clients", "2", "--parallel", "2", "--quiet"]
COMMANDS = {
    "demo": ["demo", *SERVE, "--n-predict", "2"],
    "demo --fork": ["demo", "--fork", "--parallel", "2", "--n-predict", "2", "--quiet"],
    "demo --prefix-cache": ["demo", *SERVE, "--n-predict", "2", "--prefix-cache"],
    "demo --speculative": ["demo", *SERVE, "--n-predict", "4", "--speculative", "2"],
    "generate": ["generate", "hello", "-n", "8"],
    "generate --tokens": ["generate", "--tokens", "1,2,3", "-n", "8"],
}


@pytest.fixture(scope="module")
def jamba_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("jamba") / "jamba.gguf"
    write_gguf(random_jamba_model(seed=0, n_embd=16, n_layer=2, n_head=2, n_head_kv=1, moe_layers=()), path)
    return path


def command_line(name: str, model: Path) -> list[str]:
    return [sys.executable, "-m", "recurrent_cache", *COMMANDS[name], "--model", str(model)]


@pytest.mark.parametrize("name", COMMANDS)
def test_a_closed_stdout_is_one_line(name, jamba_gguf):
    shell = shutil.which("sh")
    if shell is None:
        pytest.skip("no sh to start a command with its stdout closed")
    result = subprocess.run([shell, "-c", 'exec "$@" >&-', "sh", *command_line(name, jamba_gguf)],
                            stderr=subprocess.PIPE, text=True, timeout=300)
    assert (result.returncode, result.stderr) == (OUTPUT_FAILED, f"{COMMANDS[name][0]}: cannot write to stdout: "
                                                                 "it is closed\n")


@pytest.mark.parametrize("name", COMMANDS)
def test_a_reader_gone_before_the_first_line_ends_it_silently(name, jamba_gguf):
    process = subprocess.Popen(command_line(name, jamba_gguf), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    process.stdout.close()
    stderr = process.stderr.read()
    assert (process.wait(timeout=300), stderr) == (READER_LEFT, ""), stderr
