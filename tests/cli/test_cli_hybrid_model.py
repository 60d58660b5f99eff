"""A hybrid model's GGUF file (a Jamba the package writes) given to the command line: ``demo`` and ``generate``
serve it on a ``HybridCache`` and verify themselves against each client's solo run (no transformers needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from recurrent_cache import cli
from recurrent_cache.models import random_jamba_model, write_gguf

pytest.importorskip("gguf", reason="writing the GGUF file needs the gguf package")


@pytest.fixture(scope="module")
def jamba_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("jamba") / "jamba.gguf"
    write_gguf(random_jamba_model(seed=0, n_embd=16, n_layer=2, n_head=2, n_head_kv=1, moe_layers=()), path)
    return path


def test_demo_serves_a_jamba_gguf_and_verifies_it(capsys: pytest.CaptureFixture[str], jamba_gguf: Path) -> None:
    assert cli.main(["demo", "--model", str(jamba_gguf), "--clients", "3", "--parallel", "2",
                     "--n-predict", "4"]) == 0
    out = capsys.readouterr().out
    assert "Jamba, 2 layers" in out and "verification     PASSED: 3 of 3 clients" in out


def test_generate_runs_a_jamba_gguf(capsys: pytest.CaptureFixture[str], jamba_gguf: Path) -> None:
    assert cli.main(["generate", "hello", "--model", str(jamba_gguf), "-n", "4"]) == 0
    err = capsys.readouterr().err
    assert "Jamba, 2 layers" in err and "K and V rows of 1 attention layers" in err
