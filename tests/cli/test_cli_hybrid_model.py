"""A hybrid model file (Jamba) given to the command line: ``load_gguf`` reads it, but the commands run a
``RecurrentCache``: one line on stderr naming the file and what the commands run, never a traceback."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from recurrent_cache import cli
from recurrent_cache.models import random_jamba_model, write_gguf

pytest.importorskip("gguf", reason="writing the GGUF file needs the gguf package")


@pytest.mark.parametrize("command", [["generate", "hello"], ["demo"]])
def test_a_jamba_gguf_is_refused_by_the_commands_in_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                             command: list[str]) -> None:
    path = tmp_path / "jamba.gguf"
    write_gguf(random_jamba_model(seed=0, n_embd=16, n_layer=2, n_head=2, n_head_kv=1, moe_layers=()), path)
    try:
        status = cli.main([*command, "--model", str(path)])
    except SystemExit as exit_:
        status = exit_.code
    result = subprocess.CompletedProcess(command, status, *capsys.readouterr())
    assert result.returncode != 0 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0], result.stderr
    assert "JambaModel; the command line runs Mamba-1 and Mamba-2 models" in lines[0]
