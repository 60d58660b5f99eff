"""Hugging Face checkpoints through the cache, checked against transformers' own forward.

Small random ``MambaConfig`` / ``Mamba2Config`` models are built with
transformers (torch on the CPU, its reference "slow" path), perturbed so that
every weight matters, saved with ``save_pretrained`` (f32, f16, bf16;
sharded or not) and loaded with ``load_hf``.  Several sequences are then
served through one cache — prompts of different lengths in one batch split
into ubatches of 3, token-by-token decoding, a ``seq_cp`` fork, a sequence
moved to another cache through ``state_write`` / ``state_read``, a rollback —
and every output row is compared with transformers' forward over that
sequence's whole history (weights read from the same files, upcast to f32).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the transformers comparison needs torch (CPU)")
transformers = pytest.importorskip("transformers", reason="the comparison is against transformers' Mamba models")
safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="the error cases rewrite safetensors files")

import recurrent_cache as rc  # noqa: E402
from recurrent_cache.cli import main as command_line  # noqa: E402
from recurrent_cache.models import (Mamba2Model, MambaModel, ModelError, ReferenceRun,  # noqa: E402
                                    convert_hf_to_gguf, load_gguf, load_hf, load_model)
from recurrent_cache.models.gguf_file import GGUFFile  # noqa: E402
from recurrent_cache.models.safetensors_file import SafetensorsFile  # noqa: E402

N_VOCAB = 100
TOLERANCE = 1e-4   # every logit, relative to the largest logit of its row
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}

# name -> (architecture, config fields, dtype on disk, max_shard_size or None)
CHECKPOINTS = {
    "mamba1-untied-dconv4-f32-sharded": ("mamba", dict(conv_kernel=4, tie_word_embeddings=False), "f32", "30KB"),
    "mamba1-tied-dconv2-bf16": ("mamba", dict(conv_kernel=2, tie_word_embeddings=True), "bf16", None),
    "mamba2-groups2-untied-dconv4-f16-sharded": (
        "mamba2", dict(conv_kernel=4, n_groups=2, num_heads=8, head_dim=8, tie_word_embeddings=False), "f16",
        "30KB"),
    "mamba2-groups1-tied-dconv2-f32-limit": (
        "mamba2", dict(conv_kernel=2, n_groups=1, num_heads=4, head_dim=16, tie_word_embeddings=True,
                       time_step_limit=(0.02, 0.06)), "f32", None),
    "mamba2-groups4-untied-dconv3-f32": (
        "mamba2", dict(conv_kernel=3, n_groups=4, num_heads=8, head_dim=8, tie_word_embeddings=False), "f32", None),
}


def build_checkpoint(directory: Path, arch: str, fields: dict, dtype: str, shard: str | None, seed: int = 0):
    """save_pretrained a random model into ``directory``; returns transformers' f32 model read back from it."""
    torch.manual_seed(seed)
    fields = dict(vocab_size=N_VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2) | fields
    if arch == "mamba":
        model = transformers.MambaForCausalLM(transformers.MambaConfig(**fields))
    else:
        model = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**fields))
    with torch.no_grad():   # the default init leaves norms at 1, D at 1, conv biases at 0: make all of them matter
        for name, parameter in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight", ".D", "conv1d.bias")):
                parameter.add_(0.3 * torch.randn_like(parameter))
    model.to(DTYPES[dtype]).save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    shards = sorted(directory.glob("*.safetensors"))
    assert (len(shards) > 1) == bool(shard)
    assert {entry.dtype for entry in SafetensorsFile(shards[0]).tensors.values()} == {dtype.upper()}
    reference = type(model).from_pretrained(directory, dtype=torch.float32).eval()
    return reference


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    """(directory, transformers' model of it, name) for each configuration."""
    arch, fields, dtype, shard = CHECKPOINTS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    reference = build_checkpoint(directory, arch, fields, dtype, shard)
    return directory, reference, request.param


def transformers_logits(reference, tokens: list[int]) -> np.ndarray:
    """transformers' logits after each of ``tokens``: one full forward, no cache."""
    with torch.no_grad():
        return reference(torch.tensor([tokens]), use_cache=False).logits[0].double().numpy()


class Served:
    """Sequences served through caches; every output row is kept to check against transformers at the end."""

    def __init__(self, model) -> None:
        self.model = model
        self.history: dict[tuple[int, int], list[int]] = {}   # (cache number, seq id) -> its tokens
        self.rows: list[tuple[list[int], int, np.ndarray]] = []  # (history, position, logits)

    def run(self, cache, number: int, feeds: dict[int, list[int]], n_ubatch: int = 3) -> None:
        """One batch: ``feeds[seq]`` appended to each sequence, every token an output."""
        token, pos, seq_id = [], [], []
        for seq, tokens in feeds.items():
            start = len(self.history.setdefault((number, seq), []))
            token += tokens
            pos += range(start, start + len(tokens))
            seq_id += [seq] * len(tokens)
        st = cache.init_batch(rc.Batch(token=token, pos=pos, seq_id=seq_id, logits=[1] * len(token)), n_ubatch)
        logits = self.model.forward(st)
        for seq, tokens in feeds.items():
            self.history[(number, seq)] += tokens
        for row, index in zip(logits, st.out_ids):
            # the history list is shared and only grows: its prefix up to pos is what the row saw
            self.rows.append((self.history[(number, seq_id[index])], pos[index], row))

    def check(self, reference) -> int:
        """Compare every row with transformers; returns how many were compared."""
        expected: dict[int, np.ndarray] = {}
        for history, position, row in self.rows:
            if id(history) not in expected:
                expected[id(history)] = transformers_logits(reference, history)
            want = expected[id(history)][position]
            error = np.max(np.abs(row - want)) / np.max(np.abs(want))
            assert error < TOLERANCE, f"position {position} of {history}: relative error {error:.2e}"
        return len(self.rows)


def serve_scenario(model, engine: str) -> Served:
    """Prompts of 7, 4 and 1 tokens in ubatches of 3, decoding, a fork, and a sequence moved to another cache."""
    rng = np.random.default_rng(1)

    def tokens(n: int) -> list[int]:
        return rng.integers(0, N_VOCAB, n).tolist()

    served = Served(model)
    cache = model.new_cache(n_seq_max=5, engine=engine)
    served.run(cache, 0, {0: tokens(7), 1: tokens(4), 2: tokens(1)})
    for _ in range(3):
        served.run(cache, 0, {seq: tokens(1) for seq in range(3)})
    cache.seq_cp(0, 3)
    served.history[(0, 3)] = list(served.history[(0, 0)])
    for _ in range(2):
        served.run(cache, 0, {seq: tokens(1) for seq in range(4)})
    served.run(cache, 0, {2: tokens(5), 3: tokens(2)}, n_ubatch=4)

    moved = model.new_cache(n_seq_max=2, engine=engine)   # another server takes sequence 1 over
    moved.state_read(cache.state_write(1), 1)
    served.history[(1, 1)] = list(served.history[(0, 1)])
    for _ in range(2):
        served.run(moved, 1, {1: tokens(1)})
    served.run(moved, 1, {1: tokens(3), 0: tokens(2)})
    return served


@pytest.mark.parametrize("engine", ["compiled", "reference"])
def test_served_logits_match_transformers(checkpoint, engine):
    directory, reference, name = checkpoint
    model = load_hf(directory)
    assert isinstance(model, MambaModel if name.startswith("mamba1") else Mamba2Model)
    assert model.tied == reference.config.tie_word_embeddings
    assert serve_scenario(model, engine).check(reference) == 43   # every token fed was an output


def test_rollback_writes_the_step_states(checkpoint):
    """With n_rollback, a ubatch's earlier states are filed: rolling back and continuing matches transformers."""
    directory, reference, _ = checkpoint
    model = load_hf(directory)
    served = Served(model)
    cache = model.new_cache(n_seq_max=2, n_rollback=3)
    served.run(cache, 0, {0: list(range(10, 16)), 1: list(range(40, 46))}, n_ubatch=12)   # one ubatch of 6 each
    assert cache.seq_rm(0, 4, -1)           # back to the state after position 3
    served.history[(0, 0)] = served.history[(0, 0)][:4]
    served.rows.clear()
    served.run(cache, 0, {0: [77, 78], 1: [79]})
    assert served.check(reference) == 3


def test_converter_writes_a_gguf_that_loads_to_the_same_logits(checkpoint, tmp_path):
    directory, reference, name = checkpoint
    hf_model = load_hf(directory)
    out = tmp_path / "model.gguf"
    if name.endswith("-limit"):      # llama.cpp's mamba2 has no time_step_limit: refused, nothing written
        with pytest.raises(ModelError, match="time_step_limit"):
            convert_hf_to_gguf(directory, out)
        return
    convert_hf_to_gguf(directory, out)
    gguf_model = load_model(out)
    assert type(gguf_model) is type(hf_model)
    # GGUF keeps the epsilon as an f32
    assert gguf_model.hparams == replace(hf_model.hparams, rms_eps=float(np.float32(hf_model.hparams.rms_eps)))
    assert gguf_model.tied == hf_model.tied
    served = serve_scenario(gguf_model, "compiled")
    assert served.check(reference) == 43   # every token fed was an output
    assert isinstance(load_gguf(out), type(hf_model))


def test_convert_f16_refuses_a_weight_beyond_f16_in_one_line_and_keeps_the_old_output(small_mamba2,
                                                                                       tmp_path_factory, capsys):
    """--outtype f16 of a finite weight f16 cannot hold: one line naming the tensor and the value,
    a non-zero exit, no numpy warning, and the previous output file as it was."""
    def enlarge(tensors):
        tensors["backbone.layers.1.mixer.out_proj.weight"][0, 1] = 1e5
    edit_weights(small_mamba2, enlarge)
    out = tmp_path_factory.mktemp("converted") / "out.gguf"
    out.write_bytes(b"the previous conversion")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        status = command_line(["convert", str(small_mamba2), str(out), "--outtype", "f16"])
    captured = capsys.readouterr()
    assert status != 0 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("convert: "), captured.err
    assert "blk.1.ssm_out.weight" in lines[0] and "100000.0" in lines[0] and "f16" in lines[0], lines[0]
    assert out.read_bytes() == b"the previous conversion"
    assert command_line(["convert", str(small_mamba2), str(out)]) == 0    # f32 holds it
    assert load_gguf(out).layers[1].ssm_out[0, 1] == 1e5


# -- what load_hf refuses -------------------------------------------------------------------


@pytest.fixture
def small_mamba2(tmp_path) -> Path:
    build_checkpoint(tmp_path, "mamba2", dict(conv_kernel=4, n_groups=2, num_heads=8, head_dim=8), "f32", None)
    return tmp_path


def edit_weights(directory: Path, edit: Callable[[dict[str, np.ndarray]], None]) -> Path:
    path = directory / "model.safetensors"
    tensors = safetensors_numpy.load_file(path)
    edit(tensors)
    safetensors_numpy.save_file(tensors, path)
    return path


def edit_config(directory: Path, **fields) -> Path:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))
    return path


def test_another_architecture_is_refused(small_mamba2):
    path = edit_config(small_mamba2, architectures=["LlamaForCausalLM"])
    with pytest.raises(ModelError, match=rf"{path}.*architectures.*LlamaForCausalLM"):
        load_hf(small_mamba2)


def test_a_missing_tensor_is_named(small_mamba2):
    edit_weights(small_mamba2, lambda t: t.pop("backbone.layers.1.mixer.dt_bias"))
    with pytest.raises(ModelError, match=rf"{small_mamba2}.*backbone\.layers\.1\.mixer\.dt_bias is missing"):
        load_hf(small_mamba2)


def test_a_nan_is_named_with_its_file(small_mamba2):
    def poison(tensors):
        tensors["backbone.layers.0.mixer.in_proj.weight"][3, 4] = np.nan
    path = edit_weights(small_mamba2, poison)
    with pytest.raises(ModelError, match=rf"{path}: tensor backbone\.layers\.0\.mixer\.in_proj\.weight .*NaN"):
        load_hf(small_mamba2)


def test_a_shape_that_disagrees_with_the_config_is_named(small_mamba2):
    edit_config(small_mamba2, state_size=16)
    with pytest.raises(ModelError, match=r"model\.safetensors: tensor backbone\..* has shape .*the config makes it"):
        load_hf(small_mamba2)


def test_inconsistent_heads_and_biases_are_refused(small_mamba2):
    path = edit_config(small_mamba2, num_heads=6)
    with pytest.raises(ModelError, match=rf"{path}: field num_heads"):
        load_hf(small_mamba2)
    edit_config(small_mamba2, num_heads=8, use_bias=True)
    with pytest.raises(ModelError, match="use_bias"):
        load_hf(small_mamba2)


def test_a_directory_without_weights_or_config_is_refused(tmp_path):
    with pytest.raises(ModelError, match="config.json: missing"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"]}))
    with pytest.raises(ModelError, match="neither model.safetensors nor"):
        load_hf(tmp_path)


# -- the vocabulary of tokenizer.json -------------------------------------------------------


def test_tokenizer_json_gives_the_vocabulary(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    text = "def add(x, y):\n    return x + y\n" * 20 + "héllo wörld 🙂 "
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([text], trainer)
    n_vocab = tokenizer.get_vocab_size()
    build_checkpoint(tmp_path, "mamba", dict(vocab_size=n_vocab + 3, eos_token_id=0), "f32", None)
    tokenizer.save(str(tmp_path / "tokenizer.json"))

    model = load_hf(tmp_path)
    sample = "def f(x):\n    return héllo 🙂"
    assert model.vocab.encode(sample) == tokenizer.encode(sample).ids
    assert model.vocab.decode(tokenizer.encode(sample).ids) == sample.encode()
    assert model.vocab.decode([0]) == b""                      # the special token decodes to nothing
    assert model.vocab.eos == 0 and len(model.vocab) == n_vocab + 3

    out = tmp_path / "with_vocab.gguf"
    assert command_line(["convert", str(tmp_path), str(out)]) == 0       # python -m recurrent_cache convert
    from_gguf = load_gguf(out)
    assert from_gguf.vocab.pieces == model.vocab.pieces and from_gguf.vocab.eos == 0
    tokens = GGUFFile(out).fields["tokenizer.ggml.tokens"]   # llama.cpp needs one token per token_embd row
    assert len(tokens) == n_vocab + 3 and tokens[-1] == f"[PAD{n_vocab + 2}]"
    np.testing.assert_allclose(ReferenceRun(from_gguf).feed([5, 9, 40]), ReferenceRun(model).feed([5, 9, 40]),
                               rtol=0, atol=1e-5)

    capsys.readouterr()
    assert command_line(["generate", "--model", str(tmp_path), "-n", "5", "--temperature", "0", "def f(x"]) == 0
    assert "def f(x" in capsys.readouterr().out

    # the demo serves clients from the checkpoint directory and checks each against its solo run
    assert command_line(["demo", "--model", str(tmp_path), "--clients", "3", "--parallel", "2",
                         "--n-predict", "4", "--quiet"]) == 0
    assert "verification     PASSED: 3 of 3 clients" in capsys.readouterr().out


def test_the_demo_serves_a_mamba2_checkpoint_directory(tmp_path, capsys):
    """``demo --model DIR`` on a Mamba-2 checkpoint (token ids only: no tokenizer.json)."""
    build_checkpoint(tmp_path, "mamba2", dict(vocab_size=256, n_groups=2, num_heads=8, head_dim=8), "f32", None)
    assert command_line(["demo", "--model", str(tmp_path), "--clients", "3", "--parallel", "2",
                         "--n-predict", "4", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "Mamba-2" in out and "verification     PASSED: 3 of 3 clients" in out


@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
def test_the_damage_suites_numpy_checkpoints_are_what_transformers_reads(tmp_path, arch):
    """tests/models/test_damaged_checkpoints.py damages checkpoints it writes without transformers: transformers
    loads them with no missing, unexpected or misshapen weight, and load_hf serves its logits."""
    from test_damaged_checkpoints import write_checkpoint
    directory = write_checkpoint(tmp_path / arch, arch)
    kind = transformers.MambaForCausalLM if arch == "mamba1" else transformers.Mamba2ForCausalLM
    reference, info = kind.from_pretrained(directory, dtype=torch.float32, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    assert serve_scenario(load_hf(directory), "compiled").check(reference.eval()) == 43
