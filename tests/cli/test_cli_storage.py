"""``--storage torch [--device D]`` on the command line: every demo mode and generate serve from a
torch-storage cache with the torch forward, and verify against the numpy forward; the combinations
that cannot be served are refused in one line.

The demo runs in this process (``cli.main``: the same exit status and output, without a new
interpreter importing torch for each mode); generate runs in a real process, the command line
as a user starts it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from test_cli_errors import assert_one_line_error, run_in_process

torch = pytest.importorskip("torch")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the torch storage runs on the CPU only here"))]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recurrent_cache", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", [[], ["--fork"], ["--speculative", "3"], ["--prefix-cache"]],
                         ids=["plain", "fork", "speculative", "prefix-cache"])
def test_every_demo_mode_serves_from_torch_storage_and_verifies(capsys, mode, device):
    result = run_in_process(capsys, "demo", *mode, "--storage", "torch", "--device", device, "--quiet",
                            "--n-predict", "12")
    assert result.returncode == 0, result.stderr
    assert f"states on torch {device}" in result.stdout
    assert "verification     PASSED" in result.stdout


def test_a_corrupted_torch_state_fails_the_verification(capsys):
    result = run_in_process(capsys, "demo", "--storage", "torch", "--quiet", "--corrupt-step", "3")
    assert result.returncode == 1 and "VERIFICATION FAILED" in result.stderr


@pytest.mark.parametrize("device", DEVICES)
def test_generate_on_torch_storage_is_verified_against_the_numpy_forward(device):
    result = run("generate", "def main():", "-n", "24", "--storage", "torch", "--device", device)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def main():")
    assert "--- verified: the numpy forward alone gives the same 24 tokens" in result.stderr


@pytest.mark.parametrize("args, needle", [
    (["demo", "--device", "cpu"], "--device cpu needs --storage torch"),
    (["generate", "x", "--device", "cuda"], "--device cuda needs --storage torch"),
    (["demo", "--write-model", "m.gguf", "--storage", "torch"], "--storage would be ignored by --write-model"),
    (["demo", "--storage", "jax"], "invalid choice: 'jax'"),
    (["demo", "--storage", "torch", "--device", "nowhere"], "device 'nowhere'"),
])
def test_storage_combinations_that_cannot_be_served_are_refused(capsys, tmp_path, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(run_in_process(capsys, *args), needle)
