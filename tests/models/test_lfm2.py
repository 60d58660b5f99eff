"""LFM2 (``models/lfm2.py``) against transformers' ``Lfm2ForCausalLM``, through the hybrid memory.

Random tiny checkpoints written by ``save_pretrained`` (conv and attention layers; one tied and
without biases, one untied with ``conv_bias`` and 4 conv taps), loaded by ``load_hf`` in float64 and
float32, served on numpy storage and on torch storage (the index path): every logit the package
computes — all prompts in one batch in small ubatches, decode steps for every sequence, a fork that
follows its parent, a sequence moved through its state bytes into a second memory and back, drafted
tokens rolled back, a prefix restored from a ``HybridPrefixCache`` — equals transformers' full forward
of that sequence within 1e-4 of the largest logit.
"""

from __future__ import annotations

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache.hybrid_prefix import HybridPrefixCache
from recurrent_cache.models import Lfm2Model, ModelError, load_hf

from variants import torch_storage

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers import Lfm2Config, Lfm2ForCausalLM  # noqa: E402

TOLERANCE = 1e-4   # of the largest logit (issue 27); measured: see docs/models.md
CHECKPOINTS = {
    "tied": dict(conv_L_cache=3, conv_bias=False, tie_word_embeddings=True,
                 layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "untied-bias": dict(conv_L_cache=4, conv_bias=True, tie_word_embeddings=False,
                        layer_types=["full_attention", "conv", "conv"]),
}
PROMPTS = {0: [3, 5, 7, 11, 13, 17, 19], 1: [23, 29, 31], 2: [37]}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    """(directory, transformers model in float64) of a random tiny LFM2."""
    options = CHECKPOINTS[request.param]
    config = Lfm2Config(vocab_size=64, hidden_size=32, intermediate_size=96,
                        num_hidden_layers=len(options["layer_types"]), num_attention_heads=4, num_key_value_heads=2,
                        block_multiple_of=16, norm_eps=1e-5,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **options)
    torch.manual_seed(7)
    model = Lfm2ForCausalLM(config).double().eval()
    with torch.no_grad():   # weights of a trained model's scale: norms near 1, projections ~ 1/sqrt(fan-in)
        for param in model.parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if param.dim() == 1
                        else torch.randn_like(param) / param.shape[-1] ** 0.5)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    return directory, model


def reference(hf_model, tokens: list[int]) -> np.ndarray:
    """transformers' logits after each of ``tokens`` (one full-sequence forward)."""
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].numpy()


class Session:
    """A model over one memory, keeping each sequence's tokens and the logits the package gave after each."""

    def __init__(self, model: Lfm2Model, storage: str, n_seq_max: int = 4, n_rollback: int = 0) -> None:
        self.model = model
        options = {"storage": torch_storage()} if storage == "torch" else {}
        self.cache = model.new_cache(n_seq_max, kv_size=64, kv_pad=1, n_rollback=n_rollback, **options)
        self.tokens: dict[int, list[int]] = {}
        self.logits: dict[int, list[np.ndarray]] = {}

    def run(self, entries: dict[int, list[int]], n_ubatch: int = 512) -> None:
        token, seq_id, pos = [], [], []
        for seq, new in entries.items():
            start = len(self.tokens.get(seq, []))
            token += new
            seq_id += [seq] * len(new)
            pos += range(start, start + len(new))
        st = self.cache.init_batch(rc.Batch(token=token, seq_id=seq_id, pos=pos, logits=[1] * len(token)), n_ubatch)
        out = self.model.forward(st)
        out = out.numpy() if isinstance(out, torch.Tensor) else out
        rows = dict(zip(np.asarray(st.out_ids).tolist(), out))
        for i, (seq, t) in enumerate(zip(seq_id, token)):
            self.tokens.setdefault(seq, []).append(t)
            self.logits.setdefault(seq, []).append(rows[i])

    def forget_after(self, seq: int, n: int) -> None:
        """The sequence now holds its first ``n`` tokens (a rollback)."""
        self.tokens[seq], self.logits[seq] = self.tokens[seq][:n], self.logits[seq][:n]

    def copy(self, src: int, dst: int) -> None:
        self.tokens[dst], self.logits[dst] = list(self.tokens[src]), list(self.logits[src])

    def assert_equals(self, hf_model, seqs=None) -> float:
        """Every logit of ``seqs`` (default: all) equals transformers' within TOLERANCE; the largest error."""
        worst = 0.0
        for seq in self.tokens if seqs is None else seqs:
            expected = reference(hf_model, self.tokens[seq])
            got = np.array(self.logits[seq])
            error = float(np.abs(got - expected).max() / np.abs(expected).max())
            assert error <= TOLERANCE, (seq, error)
            worst = max(worst, error)
        return worst


DTYPES = pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
STORAGES = pytest.mark.parametrize("storage", ["numpy", "torch"])


@STORAGES
@DTYPES
def test_prompts_in_small_ubatches_then_decoding(checkpoint, dtype, storage):
    directory, hf_model = checkpoint
    model = load_hf(directory, dtype=dtype)
    assert isinstance(model, Lfm2Model) and model.hparams.n_embd_s == 0
    session = Session(model, storage)
    session.run(PROMPTS, n_ubatch=2)
    for step in range(3):
        session.run({seq: [40 + step + seq] for seq in PROMPTS})
    session.assert_equals(hf_model)


@STORAGES
@DTYPES
def test_a_fork_follows_its_parent(checkpoint, dtype, storage):
    directory, hf_model = checkpoint
    session = Session(load_hf(directory, dtype=dtype), storage)
    session.run({0: PROMPTS[0]}, n_ubatch=3)
    session.cache.seq_cp(0, 3)
    session.copy(0, 3)
    session.run({0: [50], 3: [51]})
    session.run({0: [52], 3: [53, 54]}, n_ubatch=1)
    session.assert_equals(hf_model)


@STORAGES
def test_a_sequence_moves_through_its_state_bytes_and_back(checkpoint, storage):
    directory, hf_model = checkpoint
    model = load_hf(directory)
    first, second = Session(model, storage), Session(model, storage)
    first.run(PROMPTS, n_ubatch=4)
    second.run({0: [9, 9]})                              # someone else already there
    second.cache.state_read(first.cache.state_write(1), 2)
    second.tokens[2], second.logits[2] = list(first.tokens[1]), list(first.logits[1])
    second.run({2: [60, 61], 0: [62]})
    first.cache.seq_rm(1)
    first.cache.state_read(second.cache.state_write(2, framing="llama"), 1)
    first.tokens[1], first.logits[1] = list(second.tokens[2]), list(second.logits[2])
    first.run({1: [63]})
    first.assert_equals(hf_model, [1])
    second.assert_equals(hf_model, [2])


@STORAGES
@DTYPES
def test_drafted_tokens_roll_back(checkpoint, dtype, storage):
    directory, hf_model = checkpoint
    session = Session(load_hf(directory, dtype=dtype), storage, n_rollback=3)
    session.run({0: PROMPTS[0], 1: PROMPTS[1]}, n_ubatch=3)
    session.run({0: [44, 45, 46], 1: [47, 48]})          # drafts, verified in one ubatch
    assert session.cache.seq_rm(0, len(PROMPTS[0]) + 1, -1)   # the first drafted token accepted
    assert session.cache.seq_rm(1, len(PROMPTS[1]), -1)       # none accepted
    session.forget_after(0, len(PROMPTS[0]) + 1)
    session.forget_after(1, len(PROMPTS[1]))
    session.run({0: [49], 1: [50, 51]})
    session.assert_equals(hf_model)


@STORAGES
def test_a_prefix_restored_from_a_prefix_cache(checkpoint, storage):
    directory, hf_model = checkpoint
    session = Session(load_hf(directory), storage)
    prefixes = HybridPrefixCache(session.cache, 1 << 20, block_size=4)
    shared = [3, 1, 4, 1, 5, 9]
    session.run({0: shared}, n_ubatch=4)
    assert prefixes.save(0, shared)
    assert prefixes.restore(1, shared + [2, 6]) == len(shared)
    session.tokens[1], session.logits[1] = list(shared), list(session.logits[0])
    session.run({1: [2, 6]})
    session.assert_equals(hf_model)


def test_a_checkpoint_llama_cpp_could_not_read_is_refused(checkpoint, tmp_path):
    """Bad fields name the file and the field; nothing half-loaded."""
    import json
    import shutil

    directory, _ = checkpoint
    bad = tmp_path / "bad"
    shutil.copytree(directory, bad)
    config = json.loads((bad / "config.json").read_text())
    for field, value, words in (("layer_types", ["conv"], "layer_types"),
                                ("conv_L_cache", 1, "conv_L_cache must be >= 2"),
                                ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4}, "default rope")):
        (bad / "config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(ModelError, match=words):
            load_hf(bad)
