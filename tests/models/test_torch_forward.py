"""The torch forward (models/torch_forward.py) against the numpy forward: the same script of batches on two
caches, one served through numpy rows and one through torch rows, must give the same logits, the same states
and the same step states (the rollback history), for Mamba-1 and Mamba-2, every state dtype, float32 and
float64 models, on the CPU and on CUDA where there is a GPU."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache.models import MambaModel, ModelError, random_mamba2_model, random_model
from recurrent_cache.models._storage import StateStorage
from recurrent_cache.models.mamba2 import Mamba2Model

torch = pytest.importorskip("torch")
torch_forward = pytest.importorskip("recurrent_cache.models.torch_forward")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the torch forward runs on the CPU only here"))]


def tensor_as_numpy(tensor, dtype: np.dtype) -> np.ndarray:
    """A host copy of a state tensor as the cache's numpy dtype."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).cpu().numpy().view(dtype)
    return tensor.cpu().numpy()


# -- the models --------------------------------------------------------------------------------


def mamba1(dtype, dt_b_c_rms=False) -> MambaModel:
    model = random_model(seed=5, n_vocab=64, n_embd=32, n_layer=2, d_state=8, dtype=dtype)
    if not dt_b_c_rms:
        return model
    hparams = dataclasses.replace(model.hparams, dt_b_c_rms=True)   # Falcon-Mamba's variant
    return MambaModel(hparams, model.token_embd, model.layers, model.output_norm, model.output, dtype=dtype)


def mamba2(dtype, time_step_limit=None) -> Mamba2Model:
    model = random_mamba2_model(seed=6, n_vocab=64, n_embd=32, n_layer=2, d_state=8, head_dim=8, n_group=2,
                                dtype=dtype)
    if time_step_limit is None:
        return model
    hparams = dataclasses.replace(model.hparams, time_step_limit=time_step_limit)
    return Mamba2Model(hparams, model.token_embd, model.layers, model.output_norm, model.output, dtype=dtype)


MODELS = {
    "mamba1": mamba1,
    "mamba1-dt_b_c_rms": lambda dtype: mamba1(dtype, dt_b_c_rms=True),
    "mamba2": mamba2,
    "mamba2-time_step_limit": lambda dtype: mamba2(dtype, time_step_limit=(0.02, 0.05)),
}

# Measured worst relative differences (max |torch - numpy| / max |numpy| per tensor) over the script below,
# CPU, torch 2.13: float64 models 7e-16 (logits, states, step states, every state dtype); float32 models
# 7e-7 with f32 states.  With f16 / bf16 states and a float32 model, a value that numpy and torch (whose
# float32 matrix products sum in another order) round to the storage dtype on either side of a tie differs
# by one unit in the last place, at most 2^-10 (f16) / 2^-7 (bf16) of the value, and the sequence carries
# it on: measured 8e-4 (f16) and 1.2e-4 (bf16).  The bounds allow two such units.
TOLERANCE = {
    np.float64: {"f32": 1e-12, "f16": 1e-12, "bf16": 1e-12},
    np.float32: {"f32": 1e-5, "f16": 2.0 ** -9, "bf16": 2.0 ** -6},
}


# -- the script: the same batches on two caches, compared after every ubatch ----------------------------


class Pair:
    """One model served from two caches of the same shape: the numpy forward on one, the torch forward on
    the other (a torch-storage cache on ``device``)."""

    def __init__(self, model, dtype: str, device: str, n_rollback: int = 2, engine: str | None = None) -> None:
        self.model, self.device = model, device
        self.tolerance = TOLERANCE[model.dtype.type][dtype]
        self.on_numpy = model.new_cache(n_seq_max=4, dtype=dtype, n_rollback=n_rollback, engine=engine)
        self.on_torch = model.new_cache(n_seq_max=4, dtype=dtype, n_rollback=n_rollback, storage="torch",
                                        device=device, engine=engine)
        self.storage = StateStorage.named(dtype)
        self.worst = 0.0   # the largest relative difference seen
        self.step_states = 0   # step-state tensors compared that hold something (m > 0)

    def close(self, what: str, got, expected: np.ndarray) -> None:
        """``got`` (torch, or the torch cache's numpy rows) agrees with the numpy side's ``expected``."""
        if isinstance(got, torch.Tensor):
            got = got.to(torch.float64).cpu().numpy()
        elif got.dtype != expected.dtype or got.dtype.itemsize == 2:
            got = self.storage.decode(got, np.float64)
        if expected.dtype.itemsize == 2:
            expected = self.storage.decode(expected, np.float64)
        assert got.shape == expected.shape, what
        scale = max(float(np.abs(expected).max(initial=0.0)), 1e-30)
        difference = float(np.abs(got - expected).max(initial=0.0)) / scale
        self.worst = max(self.worst, difference)
        assert difference <= self.tolerance, f"{what}: relative difference {difference:.3g} > {self.tolerance:g}"

    def run(self, batch: rc.Batch, n_ubatch: int) -> None:
        """``batch`` on both caches, ubatch by ubatch; logits, rows and step states compared after each."""
        st_numpy = self.on_numpy.init_batch(batch, n_ubatch)
        st_torch = self.on_torch.init_batch(batch, n_ubatch)
        n_layer = self.model.hparams.n_layer
        for u, _ in enumerate(zip(st_numpy, st_torch)):
            expected = self.model.forward_ubatch(st_numpy)
            got = self.model.forward_ubatch(st_torch)
            assert isinstance(got, torch.Tensor) and got.device.type == self.device
            assert got.dtype == {np.float32: torch.float32, np.float64: torch.float64}[self.model.dtype.type]
            self.close(f"logits of ubatch {u}", got, expected)
            for il in range(n_layer):
                for kind in ("r", "s", "r_steps", "s_steps"):
                    self.close(f"ubatch {u} {kind}({il})", getattr(st_torch, kind)(il),
                               getattr(st_numpy, kind)(il))
                self.step_states += st_numpy.r_steps(il).shape[1] > 0
        self.check_caches()

    def check_caches(self) -> None:
        """Both caches hold the same cells and the same rows."""
        cells = [self.on_numpy.cell(i) for i in range(self.on_numpy.size)]
        assert [self.on_torch.cell(i) for i in range(self.on_torch.size)] == cells
        for il in range(self.model.hparams.n_layer):
            self.close(f"cache.r[{il}]", self.on_torch.r[il], self.on_numpy.r[il])
            self.close(f"cache.s[{il}]", self.on_torch.s[il], self.on_numpy.s[il])

    def both(self, operation: str, *args) -> None:
        """A sequence operation on both caches (both must answer alike)."""
        assert getattr(self.on_torch, operation)(*args) == getattr(self.on_numpy, operation)(*args)


def tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, 64, size=n).tolist()


def script(pair: Pair) -> None:
    """Prefill, decode, multi-token groups with step states, a rollback, a fork, more decoding."""
    rng = np.random.default_rng(0)
    lengths = {0: 7, 1: 3, 2: 5}
    prompt = [(seq, pos, token) for seq, n in lengths.items() for pos, token in enumerate(tokens(rng, n))]
    # uneven prompts with n_ubatch 4: several ubatches of several groups, step states of 1 and 2 tokens
    pair.run(rc.Batch(token=[t for _, _, t in prompt], pos=[p for _, p, _ in prompt],
                      seq_id=[s for s, _, _ in prompt], logits=[1] * len(prompt)), n_ubatch=4)
    for _ in range(2):   # decode steps of three sequences: no step states
        pair.run(rc.Batch(token=tokens(rng, 3), pos=[lengths[s] for s in range(3)], seq_id=[0, 1, 2],
                          logits=[1] * 3), n_ubatch=8)
        lengths = {s: n + 1 for s, n in lengths.items()}
    # a draft of three tokens per sequence, verified in one batch: m = 2 step states per group
    seqs = [s for s in range(3) for _ in range(3)]
    pair.run(rc.Batch(token=tokens(rng, 9), pos=[lengths[s] + k for s in range(3) for k in range(3)], seq_id=seqs,
                      logits=[1] * 9), n_ubatch=16)
    lengths = {s: n + 3 for s, n in lengths.items()}
    # take back two of sequence 0's tokens and one of sequence 2's: the step states the torch forward wrote
    pair.both("seq_rm", 0, lengths[0] - 2, -1)
    pair.both("seq_rm", 2, lengths[2] - 1, -1)
    lengths[0] -= 2
    lengths[2] -= 1
    pair.check_caches()
    pair.both("seq_cp", 1, 3, -1, -1)   # a fork: copy on write when it moves on
    lengths[3] = lengths[1]
    for _ in range(2):
        pair.run(rc.Batch(token=tokens(rng, 4), pos=[lengths[s] for s in range(4)], seq_id=[0, 1, 2, 3],
                          logits=[1] * 4), n_ubatch=8)
        lengths = {s: n + 1 for s, n in lengths.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("model_dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("architecture", list(MODELS))
def test_torch_forward_equals_numpy_forward(architecture, model_dtype, state_dtype, device):
    pair = Pair(MODELS[architecture](model_dtype), state_dtype, device)
    script(pair)
    assert pair.step_states >= 2 * pair.model.hparams.n_layer   # the prefill's and the draft's


@pytest.mark.parametrize("architecture", ["mamba1", "mamba2"])
def test_torch_forward_runs_on_the_reference_engine(architecture):
    """The reference engine hands out step rows of the storage's type, so the torch forward writes its step
    states (a draft verified, then rolled back) on it as on the compiled engine."""
    pair = Pair(MODELS[architecture](np.float64), "f32", "cpu", engine="reference")
    script(pair)
    assert pair.step_states >= 2 * pair.model.hparams.n_layer


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("architecture", ["mamba1", "mamba2"])
def test_forward_returns_a_tensor_on_the_rows_device(architecture, device):
    model = MODELS[architecture](np.float64)
    batch = rc.Batch(token=[3, 1, 4, 1, 5, 9, 2, 6], seq_id=[0] * 5 + [1] * 3, pos=list(range(5)) + list(range(3)),
                     logits=[1] * 8)
    expected = model.forward(model.new_cache(n_seq_max=2).init_batch(batch, 2))
    got = model.forward(model.new_cache(n_seq_max=2, storage="torch", device=device).init_batch(batch, 2))
    assert isinstance(got, torch.Tensor) and got.device.type == device and got.dtype == torch.float64
    np.testing.assert_allclose(got.cpu().numpy(), expected, rtol=1e-12, atol=1e-12 * np.abs(expected).max())


@pytest.mark.parametrize("device", DEVICES)
def test_embedding_input(device):
    model = mamba2(np.float64)
    embd = np.random.default_rng(3).standard_normal((4, model.hparams.n_embd))
    batch = rc.Batch(embd=embd, seq_id=[0, 0, 1, 1], pos=[0, 1, 0, 1], logits=[1] * 4)
    expected = model.forward(model.new_cache(n_seq_max=2).init_batch(batch))
    got = model.forward(model.new_cache(n_seq_max=2, storage="torch", device=device).init_batch(batch))
    np.testing.assert_allclose(got.cpu().numpy(), expected, rtol=1e-12, atol=1e-12 * np.abs(expected).max())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", ["f32", "f16", "bf16"])
def test_storage_rounds_like_the_numpy_storage(state_dtype, device):
    """Bit for bit, through float32 first: the last values are float64 just above a tie of the storage dtype,
    which a direct float64 conversion rounds up and ggml's float32-first conversion rounds to even (down)."""
    rng = np.random.default_rng(1)
    values = np.concatenate([rng.standard_normal(4000) * 10.0 ** rng.integers(-6, 6, 4000),
                             [0.0, -0.0, np.inf, -np.inf, 1e6, -1e-9, 1 + 2.0 ** -11 + 2.0 ** -40,
                              1 + 2.0 ** -8 + 2.0 ** -40]])
    numpy_storage = StateStorage.named(state_dtype)
    storage = torch_forward.TorchStateStorage({"f32": torch.float32, "f16": torch.float16,
                                          "bf16": torch.bfloat16}[state_dtype])
    encoded = storage.encode(torch.from_numpy(values).to(device))
    with np.errstate(over="ignore"):   # 1e6 is inf in f16, on both sides
        expected = numpy_storage.encode(values)
        expected_rounded = numpy_storage.round(values)
    np.testing.assert_array_equal(numpy_storage.decode(tensor_as_numpy(encoded, expected.dtype), np.float64),
                                  numpy_storage.decode(expected, np.float64))
    rounded = storage.round(torch.from_numpy(values).to(device)).cpu().numpy()
    np.testing.assert_array_equal(rounded, expected_rounded)


def test_weights_are_converted_once_per_device():
    model = mamba1(np.float32)
    cpu = torch.device("cpu")
    weights = torch_forward.device_weights(model, cpu)
    assert torch_forward.device_weights(model, cpu) is weights
    assert weights.layers[0]["ssm_in"].dtype == torch.float32
    # on the CPU the tensors share the model's memory
    assert weights.token_embd.data_ptr() == model.token_embd.__array_interface__["data"][0]


def test_bad_token_changes_no_state():
    """A token outside the vocabulary is refused before any row is written: the cache holds what the numpy
    forward leaves (the rows its apply placed, untouched by the model)."""
    model = mamba1(np.float64)
    caches = [model.new_cache(n_seq_max=2, n_rollback=2, storage=storage) for storage in ("numpy", "torch")]
    for cache in caches:
        model.forward(cache.init_batch(rc.Batch(token=[1, 2, 3], seq_id=[0] * 3)))
    bad = rc.Batch(token=[4, 5, 64, 7], seq_id=[0, 0, 1, 1], pos=[3, 4, 0, 1])
    with pytest.raises(ModelError, match="token id 64"):
        model.forward(caches[0].init_batch(bad))
    with pytest.raises(ModelError, match="token id 64"):
        model.forward(caches[1].init_batch(bad))
    for expected, got in zip(caches[0].r + caches[0].s, caches[1].r + caches[1].s):
        np.testing.assert_array_equal(got.numpy(), expected)


def test_state_rows_of_another_dtype_are_refused():
    model = mamba1(np.float64)
    st = model.new_cache(storage="torch").init_batch(rc.Batch(token=[1]))

    class Float64Rows:
        """A memory state whose rows a caller converted to float64 (no cache stores those)."""

        status, ubatch, out_ids = st.status, st.ubatch, st.out_ids

        def __iter__(self):
            return iter(st)

        def r(self, il):
            return st.r(il).to(torch.float64)

        def s(self, il):
            return st.s(il).to(torch.float64)

    with pytest.raises(ModelError, match="torch.float64"):
        model.forward(Float64Rows())


def test_package_imports_and_runs_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"   # import torch now fails
            "import numpy as np, recurrent_cache as rc\n"
            "from recurrent_cache.models import random_model\n"
            "model = random_model(seed=1, n_embd=16, n_layer=1)\n"
            "logits = model.forward(model.new_cache().init_batch(rc.Batch(token=[1, 2])))\n"
            "assert isinstance(logits, np.ndarray) and logits.shape == (1, 256)\n"
            "assert 'recurrent_cache.models.torch_forward' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
