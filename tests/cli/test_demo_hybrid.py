"""``demo`` and ``generate`` take a hybrid checkpoint (``--model DIR``: a Jamba saved by transformers) and verify
themselves as they do for Mamba: every client against its solo run on a memory of its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from recurrent_cache.cli import main

torch = pytest.importorskip("torch", reason="the checkpoint is written by transformers (needs torch)")
transformers = pytest.importorskip("transformers", reason="the checkpoint is written by transformers")


@pytest.fixture(scope="module")
def jamba(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = transformers.JambaConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                      num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
                                      mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4)
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("jamba")
    transformers.JambaForCausalLM(config).save_pretrained(directory)
    return Path(directory)


@pytest.mark.parametrize("mode", [[], ["--fork"], ["--speculative", "3"], ["--prefix-cache"],
                                  ["--storage", "torch"]], ids=["plain", "fork", "speculative", "prefix", "torch"])
def test_demo_serves_and_verifies_a_hybrid_checkpoint(jamba: Path, mode: list[str], capsys) -> None:
    clients = [] if mode == ["--fork"] else ["--clients", "4"]
    assert main(["demo", "--model", str(jamba), *clients, "--parallel", "3", "--n-predict", "8", *mode]) == 0
    out = capsys.readouterr().out
    assert "Jamba, 4 layers (attention [1, 3]" in out
    assert "verification     PASSED" in out


def test_the_prefix_demo_restores_hybrid_prefixes_from_a_store(jamba: Path, tmp_path: Path, capsys) -> None:
    args = ["demo", "--model", str(jamba), "--prefix-cache", "--store", str(tmp_path / "store"), "--n-predict", "8"]
    assert main(args) == 0
    assert main(args) == 0          # a second process's view: every conversation's prefixes are in the store
    out = capsys.readouterr().out.split("verification     PASSED")[1]
    assert "0 restores from it" not in out and "0 damaged, 0 errors" in out


def test_generate_runs_a_hybrid_checkpoint_and_checks_torch_against_numpy(jamba: Path, capsys) -> None:
    assert main(["generate", "def f", "--model", str(jamba), "-n", "6", "--storage", "torch"]) == 0
    err = capsys.readouterr().err
    assert "K and V rows of 2 attention layers" in err and "--- verified" in err
