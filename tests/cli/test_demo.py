"""``python -m recurrent_cache demo`` runs, verifies itself, and its verification can fail."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from recurrent_cache.cli import demo
from recurrent_cache.cli.clients import HANDWRITTEN_PROMPTS
from recurrent_cache.models import escape, held_out_prompts

SMALL = ["--clients", "5", "--parallel", "3", "--n-predict", "5", "--ubatch", "4", "--quiet"]
FORK = SMALL[2:] + ["--fork"]   # --fork serves --parallel forks and refuses --clients


def report_number(out: str, label: str) -> int:
    return int(re.search(rf"^{label}\s+(\d+)", out, re.MULTILINE).group(1))


def test_small_run_passes_and_reports(capsys):
    assert demo.main(SMALL) == 0
    out = capsys.readouterr().out
    for label in ("clients", "tokens", "steps", "throughput", "peak cells used", "time", "verification"):
        assert re.search(rf"^{label} ", out, re.MULTILINE), f"report lacks {label!r}:\n{out}"
    assert "verification     PASSED: 5 of 5 clients" in out
    assert "tokens/s" in out and "cache" in out and "model" in out
    assert report_number(out, "peak cells used") == 3
    steps, ubatches = map(int, re.search(r"(\d+) init_batch, (\d+) ubatches", out).groups())
    assert ubatches > steps, "n_ubatch 4 should split some steps"
    # 5 clients on 3 slots: two of them ran in cells freed by seq_rm
    assert "clients          5 (3 at a time)" in out and "25 generated" in out


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_half_precision_states_pass(capsys, dtype):
    assert demo.main(SMALL + ["--dtype", dtype]) == 0
    assert "PASSED" in capsys.readouterr().out


def test_fork_run_passes(capsys):
    # hot sampling and 16 bytes: an indented block's first bytes are the same for any seed
    assert demo.main(FORK + ["--n-predict", "16", "--temperature", "1.5"]) == 0
    out = capsys.readouterr().out
    assert "1 prompt forked into 3 sequences" in out and "PASSED: 3 of 3" in out
    continuations = re.findall(r"-> (\".*\")  \[sampled", out)
    assert len(set(continuations)) == 3, "each fork samples with its own seed"


TINY = ["--clients", "2", "--parallel", "2", "--n-predict", "6", "--ubatch", "8", "--quiet"]
MODES = {"queue": SMALL + ["--corrupt-step", "2"], "fork": FORK + ["--corrupt-step", "2"],
         "prefix-cache": TINY + ["--prefix-cache", "--corrupt-step", "1"],
         "speculative": TINY + ["--speculative", "3", "--corrupt-step", "1"]}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_corrupted_state_fails_verification(capsys, mode):
    """Every mode's verification is live: a state overwritten while serving must fail it."""
    assert demo.main(MODES[mode]) == 1
    captured = capsys.readouterr()
    assert "corrupted the layer-0 SSM state of client" in captured.out
    assert "verification     FAILED" in captured.out
    assert "VERIFICATION FAILED" in captured.err


def test_written_model_runs_from_file(tmp_path, capsys):
    pytest.importorskip("gguf", reason="--write-model / --model need the gguf package")
    path = tmp_path / "demo.gguf"
    assert demo.main(["--write-model", str(path), "--random-weights", "--seed", "3"]) == 0
    assert path.stat().st_size > 0
    assert demo.main(SMALL + ["--model", str(path)]) == 0
    assert "PASSED" in capsys.readouterr().out


def test_missing_model_file_is_a_clear_error(tmp_path, capsys):
    pytest.importorskip("gguf")
    assert demo.main(["--model", str(tmp_path / "absent.gguf"), "--quiet"]) == 2
    assert "absent.gguf" in capsys.readouterr().err


def test_default_run_serves_the_shipped_model_as_text(capsys):
    assert demo.main(SMALL) == 0
    out = capsys.readouterr().out
    assert "the shipped byte-level model" in out
    prompts = set(HANDWRITTEN_PROMPTS) | set(held_out_prompts())
    lines = re.findall(r'^  client \d+ +prompt +(\d+) tokens "(.*)" -> "(.*)"  \[sampled \(temperature 0.7, top-k 40, '
                       r'seed \(0, \d\)\)\]$', out, re.MULTILINE)
    assert len(lines) == 5
    for length, shown_prompt, _ in lines:
        ends = shown_prompt.removeprefix("...")
        assert any(len(p.encode()) == int(length) and escape(p.encode()[-28:]).replace('"', '\\"') == ends
                   for p in prompts)


def test_greedy_run_passes(capsys):
    assert demo.main(SMALL + ["--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.count("[greedy]") == 5 and "PASSED: 5 of 5" in out


def test_random_weights_and_sampling_options_pass(capsys):
    assert demo.main(SMALL + ["--random-weights", "--temperature", "0.7", "--top-k", "8"]) == 0
    out = capsys.readouterr().out
    assert "random weights, seed 0" in out and "PASSED: 5 of 5" in out
    assert out.count("sampled (temperature 0.7, top-k 8") == 5


def test_command_line_entry_point():
    result = subprocess.run([sys.executable, "-m", "recurrent_cache", "demo", *SMALL],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "PASSED" in result.stdout
