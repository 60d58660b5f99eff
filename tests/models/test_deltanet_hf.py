"""Gated DeltaNet (models/_deltanet.py) against transformers' ``Qwen3NextGatedDeltaNet``, random weights.

Three sequences run side by side through the layer: a prompt as two ubatches (the conv and delta-rule states
carried between them through the flat r / s rows), then single-token decode steps.  Every output must equal the
module's full-sequence forward (its chunked delta rule, no cache) on the same inputs.

Tolerances, of the largest output (12 to 15 here), measured (numpy and torch alike, first configuration /
second) then rounded up.  Transformers computes the delta rule and the gated norm in float32 whatever the
module's dtype, and the cache's f32 states are rounded to 24 bits after every token: float64 compute is held to
1e-5 (measured 6.5e-7 / 1.1e-6), float32 compute likewise to 1e-5 (4.5e-7 / 3.1e-6); f16 states (11 bits kept)
to 2e-2 (1.4e-3 / 9.8e-3), bf16 states (8 bits) to 1.5e-1 (6.6e-3 / 7.8e-2: the rounding of a matrix state
after every token accumulates).
"""

from __future__ import annotations

import numpy as np
import pytest

from recurrent_cache.models._deltanet import DeltaNetParams, deltanet_weights_from_hf, gated_deltanet
from recurrent_cache.models._storage import StateStorage

torch = pytest.importorskip("torch", reason="the transformers comparison needs torch (CPU)")
transformers = pytest.importorskip("transformers", reason="the comparison is against transformers' Qwen3-Next")
torch_forward = pytest.importorskip("recurrent_cache.models.torch_forward",
                                    reason="the torch backend needs array-api-compat (the torch extra)")

# (key heads, value heads, key head dim, value head dim): value heads sharing a key head, Dk != Dv (transformers
# allows it, llama.cpp does not); then llama.cpp's shape (Dk == Dv), one value head per key head, d_conv 3
CONFIGS = {"grouped": dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                           linear_value_head_dim=12, linear_conv_kernel_dim=4),
           "llama.cpp": dict(linear_num_key_heads=3, linear_num_value_heads=3, linear_key_head_dim=16,
                             linear_value_head_dim=16, linear_conv_kernel_dim=3)}
N_EMBD, N_SEQS = 32, 3
UBATCHES = ((0, 5), (5, 8), (8, 9), (9, 10), (10, 11))   # a prompt of 8 as 5 + 3 tokens, then three decode steps
N_TOKENS = UBATCHES[-1][1]
TORCH_DTYPE = {"f64": torch.float64, "f32": torch.float32}
NP_DTYPE = {"f64": np.float64, "f32": np.float32}
TORCH_STORAGE = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
TOLERANCE = {("f64", "f32"): 1e-5, ("f32", "f32"): 1e-5, ("f32", "f16"): 2e-2, ("f32", "bf16"): 1.5e-1}


def module_of(config_name, dtype):
    """transformers' layer from a small random ``Qwen3NextConfig``: every parameter drawn at random, ``A`` as
    transformers initialises it (uniform in [0.01, 16])."""
    config = transformers.Qwen3NextConfig(hidden_size=N_EMBD, num_hidden_layers=1, layer_types=["linear_attention"],
                                          **CONFIGS[config_name])
    torch.manual_seed(4)
    module = transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.3)
        module.A_log.copy_(torch.log(torch.empty_like(module.A_log).uniform_(0.01, 16.0)))
        module.norm.weight.add_(1.0)
    return config, module.to(TORCH_DTYPE[dtype])


def weights_of(config, module):
    """Our parameters and weights of ``module``, read through ``deltanet_weights_from_hf`` as a checkpoint is."""
    p = DeltaNetParams.from_hf_config(config.to_dict())
    tensors = {name: value.detach().numpy() for name, value in module.state_dict().items()}

    def weight(name, shape):
        assert [d for d in tensors[name].shape if d != 1] == [d for d in shape if d != 1], name
        return tensors[name].reshape(shape)
    return p, deltanet_weights_from_hf(weight, p)


def inputs(dtype):
    return np.random.default_rng(11).standard_normal((N_SEQS, N_TOKENS, N_EMBD)).astype(NP_DTYPE[dtype])


def cached_outputs(backend, p, w, x, storage_name):
    """The outputs of every token, the ubatches run in turn with the state carried through flat rows."""
    if backend == "torch":
        xp = torch_forward.TORCH_XP
        storage = torch_forward.TorchStateStorage(TORCH_STORAGE[storage_name])
        w = {name: torch.from_numpy(np.ascontiguousarray(value, dtype=x.dtype)) for name, value in w.items()}
        x = torch.from_numpy(x)
        conv = torch.zeros((N_SEQS, p.n_embd_r), dtype=storage.dtype)
        ssm = torch.zeros((N_SEQS, p.n_embd_s), dtype=storage.dtype)
    else:
        xp, storage = np, StateStorage.named(storage_name)
        w = {name: value.astype(x.dtype) for name, value in w.items()}
        conv = np.zeros((N_SEQS, p.n_embd_r), dtype=storage.dtype)
        ssm = np.zeros((N_SEQS, p.n_embd_s), dtype=storage.dtype)
    outputs = []
    for lo, hi in UBATCHES:
        out, conv, ssm, _ = gated_deltanet(xp, p, w, x[:, lo:hi], storage.decode(conv, x.dtype),
                                           storage.decode(ssm, x.dtype), storage, storage, 0)
        # what the cache keeps between ubatches: the rows in their storage dtype
        conv, ssm = storage.encode(conv), storage.encode(ssm)
        outputs.append(out.numpy() if backend == "torch" else out)
    return np.concatenate(outputs, axis=1)


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize(("compute", "storage"), list(TOLERANCE))
def test_layer_equals_transformers_full_forward(config_name, backend, compute, storage):
    config, module = module_of(config_name, compute)
    p, w = weights_of(config, module)
    x = inputs(compute)
    with torch.no_grad():
        theirs = module(torch.from_numpy(x)).numpy().astype(np.float64)
    with np.errstate(over="ignore"):
        ours = cached_outputs(backend, p, w, x, storage)
    assert ours.dtype == NP_DTYPE[compute]
    error = float(np.max(np.abs(ours - theirs))) / float(np.max(np.abs(theirs)))
    assert error <= TOLERANCE[(compute, storage)], f"{config_name} {backend} {compute}/{storage}: {error:.2e}"


def test_state_layout_is_transformers_state_transposed():
    """The s row after a prompt holds transformers' recurrent state [Hv, Dk, Dv] as [Hv, Dv, Dk], the r row its
    conv state [channels, d_conv-1] (the module's own cache, fed the same prompt)."""
    config, module = module_of("grouped", "f64")
    p, w = weights_of(config, module)
    x = inputs("f64")[:, :6]
    cache = transformers.DynamicCache(config=config)
    with torch.no_grad():
        module(torch.from_numpy(x), cache=cache)
    their_ssm = cache.get_recurrent_state(0, state_idx=0).numpy()
    their_conv = cache.get_conv_state(0, state_idx=0).numpy()
    storage = StateStorage.named("f32")
    with np.errstate(over="ignore"):
        _, conv, ssm, _ = gated_deltanet(np, p, w, x, np.zeros((N_SEQS, p.n_embd_r)), np.zeros((N_SEQS, p.n_embd_s)),
                                         storage, storage, 0)
    ours = ssm.reshape((N_SEQS, p.n_v_heads, p.head_v_dim, p.head_k_dim))
    np.testing.assert_allclose(ours, their_ssm.swapaxes(-1, -2), rtol=0, atol=1e-5 * np.abs(their_ssm).max())
    # transformers keeps d_conv inputs (the oldest one is never read again); llama.cpp and we keep d_conv-1
    np.testing.assert_allclose(conv.reshape((N_SEQS, p.conv_channels, p.d_conv - 1)), their_conv[..., 1:],
                               rtol=0, atol=1e-6 * np.abs(their_conv).max())
