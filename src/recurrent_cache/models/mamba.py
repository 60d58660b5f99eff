"""Mamba-1 in numpy, as llama.cpp computes it (architecture ``mamba``), served from the cache.

Per layer, for each token (llama.cpp's ``build_mamba_layer``)::

    u      = rms_norm(x) * attn_norm
    xi, z  = split(ssm_in @ u)                        # d_inner each
    window = [conv state ; xi]                        # per channel: the last d_conv inputs
    xc     = silu(sum_k window[:, k] * ssm_conv1d[:, k] + ssm_conv1d.bias)
    dt, B, C = split(ssm_x @ xc)                      # dt_rank, d_state, d_state
    (dt, B, C = rms_norm of each, when mamba.ssm.dt_b_c_rms is set: Falcon-Mamba)
    dt     = softplus(ssm_dt @ dt + ssm_dt.bias)
    h      = h * exp(dt[:, None] * ssm_a) + B[None, :] * (dt * xc)[:, None]
    y      = (h @ C + xc * ssm_d) * silu(z)
    x      = x + ssm_out @ y

and ``logits = output @ (rms_norm(x) * output_norm)``, with ``output`` tied to
``token_embd`` when the file has no ``output.weight``.

The states live in the cache in llama.cpp's layout (``recurrent.py``), so state
blobs are interchangeable with llama.cpp for the same model: the conv channels
are the d_inner inputs ``xi``.  With f32 states the per-token rounding of the
state is below llama.cpp's own float32 error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _args
from ..errors import ModelError
from ._storage import StateStorage
from .recurrent import (RecurrentModel, ReferenceRun, StepStates, causal_conv, checked_layers, conv_steps, conv_window,
                        rms_norm, softplus, silu)
from .vocab import Vocabulary

__all__ = ["ARCH", "LAYER_TENSORS", "MambaHParams", "MambaLayer", "MambaModel", "ReferenceRun",
           "random_model"]

ARCH = "mamba"


# -- hyper-parameters and weights ------------------------------------------------


@dataclass(frozen=True)
class MambaHParams:
    """The sizes of a Mamba-1 model (llama.cpp's ``mamba.*`` GGUF keys)."""

    n_vocab: int
    n_embd: int             # mamba.embedding_length
    n_layer: int            # mamba.block_count
    d_conv: int             # mamba.ssm.conv_kernel
    d_inner: int            # mamba.ssm.inner_size
    d_state: int            # mamba.ssm.state_size
    dt_rank: int            # mamba.ssm.time_step_rank
    rms_eps: float = 1e-5   # mamba.attention.layer_norm_rms_epsilon
    dt_b_c_rms: bool = False  # mamba.ssm.dt_b_c_rms: RMS-norm dt, B and C (Falcon-Mamba)

    def __post_init__(self) -> None:
        for name in ("n_vocab", "n_embd", "n_layer", "d_conv", "d_inner", "d_state", "dt_rank"):
            # d_conv = 1 would leave no rolling state: the cache needs rows of width >= 1
            minimum = 2 if name == "d_conv" else 1
            _args.count(getattr(self, name), f"hyper-parameter {name}", minimum, ModelError, int32_only=False)
        if not self.rms_eps > 0:
            raise ModelError(f"rms_eps must be positive, got {self.rms_eps!r}")

    @property
    def conv_channels(self) -> int:
        """Channels of the causal conv: the d_inner inputs ``xi``."""
        return self.d_inner

    @property
    def n_embd_r(self) -> int:
        """Width of a cache r row: the conv window without its newest input."""
        return (self.d_conv - 1) * self.d_inner

    @property
    def n_embd_s(self) -> int:
        """Width of a cache s row: the SSM state."""
        return self.d_state * self.d_inner

    def describe(self) -> str:
        return (f"Mamba-1, {self.n_layer} layers, n_embd {self.n_embd}, d_inner {self.d_inner}, "
                f"d_state {self.d_state}, d_conv {self.d_conv}, dt_rank {self.dt_rank}, vocab {self.n_vocab}")


@dataclass
class MambaLayer:
    """The weights of one layer, in numpy (C-order) shapes: ggml's ``{ne0, ne1}`` reversed."""

    attn_norm: np.ndarray    # [n_embd]
    ssm_in: np.ndarray       # [2*d_inner, n_embd]: x rows, then z rows
    ssm_conv1d: np.ndarray   # [d_inner, d_conv]
    ssm_conv1d_b: np.ndarray  # [d_inner]
    ssm_x: np.ndarray        # [dt_rank + 2*d_state, d_inner]: dt, B, C rows
    ssm_dt: np.ndarray       # [d_inner, dt_rank]
    ssm_dt_b: np.ndarray     # [d_inner]
    ssm_a: np.ndarray        # [d_inner, d_state], already negative: A = -exp(A_log)
    ssm_d: np.ndarray        # [d_inner]
    ssm_out: np.ndarray      # [n_embd, d_inner]


# GGUF tensor name of each layer field (``blk.N.`` + this).
LAYER_TENSORS = {
    "attn_norm": "attn_norm.weight",
    "ssm_in": "ssm_in.weight",
    "ssm_conv1d": "ssm_conv1d.weight",
    "ssm_conv1d_b": "ssm_conv1d.bias",
    "ssm_x": "ssm_x.weight",
    "ssm_dt": "ssm_dt.weight",
    "ssm_dt_b": "ssm_dt.bias",
    "ssm_a": "ssm_a",
    "ssm_d": "ssm_d",
    "ssm_out": "ssm_out.weight",
}


def layer_shapes(p: MambaHParams) -> dict[str, tuple[int, ...]]:
    """The numpy shape of each ``MambaLayer`` field (as llama.cpp's GGUF stores it)."""
    return {
        "attn_norm": (p.n_embd,),
        "ssm_in": (2 * p.d_inner, p.n_embd),
        "ssm_conv1d": (p.d_inner, p.d_conv),
        "ssm_conv1d_b": (p.d_inner,),
        "ssm_x": (p.dt_rank + 2 * p.d_state, p.d_inner),
        "ssm_dt": (p.d_inner, p.dt_rank),
        "ssm_dt_b": (p.d_inner,),
        "ssm_a": (p.d_inner, p.d_state),
        "ssm_d": (p.d_inner,),
        "ssm_out": (p.n_embd, p.d_inner),
    }


class MambaModel(RecurrentModel):
    """A Mamba-1 language model: weights, and the forward pass over the cache (``RecurrentModel``).

    ``output=None`` ties the output projection to ``token_embd``.  Every weight
    is stored in ``dtype``, the type the forward pass computes in.
    """

    hparams: MambaHParams
    layers: list[MambaLayer]

    def __init__(self, hparams: MambaHParams, token_embd: Any, layers: Sequence[MambaLayer],
                 output_norm: Any, output: Any = None, dtype: Any = np.float64,
                 vocab: Vocabulary | None = None) -> None:
        super().__init__(hparams, token_embd, output_norm, output, dtype, vocab)
        self.layers = checked_layers(layers, hparams.n_layer, MambaLayer, LAYER_TENSORS, layer_shapes(hparams),
                                     self.dtype)

    def mixer(self, layer: MambaLayer, u: np.ndarray, conv: np.ndarray, ssm: np.ndarray,
              storage_r: StateStorage, storage_s: StateStorage, m: int = 0,
              steps: StepStates | None = None) -> np.ndarray:
        """One Mamba block on ``u`` [n_seqs, n_tokens, n_embd] (see ``RecurrentModel.mixer``).

        conv: [n_seqs, d_inner, d_conv-1] and ssm: [n_seqs, d_inner, d_state].
        """
        p = self.hparams
        n_tokens = u.shape[1]
        xz = u @ layer.ssm_in.T
        z = xz[..., p.d_inner:]
        window = conv_window(conv, xz[..., :p.d_inner], storage_r)       # [n_seqs, d_inner, d_conv-1+n_tokens]
        xc = causal_conv(window, layer.ssm_conv1d, layer.ssm_conv1d_b, n_tokens)  # [n_seqs, n_tokens, d_inner]

        dbc = xc @ layer.ssm_x.T
        dt = dbc[..., :p.dt_rank]
        b = dbc[..., p.dt_rank:p.dt_rank + p.d_state]
        c = dbc[..., p.dt_rank + p.d_state:]
        if p.dt_b_c_rms:
            dt, b, c = rms_norm(dt, p.rms_eps), rms_norm(b, p.rms_eps), rms_norm(c, p.rms_eps)
        dt = softplus(dt @ layer.ssm_dt.T + layer.ssm_dt_b)                  # [n_seqs, n_tokens, d_inner]
        dt_x = dt * xc

        # The selective scan: the only loop over tokens, vectorised over sequences.
        first_step = n_tokens - 1 - m
        ssm_steps = np.empty((ssm.shape[0], m) + ssm.shape[1:], dtype=ssm.dtype)
        y = np.empty_like(xc)
        for t in range(n_tokens):
            h = ssm * np.exp(dt[:, t, :, None] * layer.ssm_a) + dt_x[:, t, :, None] * b[:, t, None, :]
            y[:, t] = (h @ c[:, t, :, None])[..., 0]
            ssm[...] = storage_s.round(h)
            if first_step <= t < n_tokens - 1:
                ssm_steps[:, t - first_step] = ssm
        if m and steps is not None:
            steps.append((conv_steps(window, p.d_conv, m), ssm_steps))
        result: np.ndarray = ((y + xc * layer.ssm_d) * silu(z)) @ layer.ssm_out.T
        return result

# -- random weights -------------------------------------------------------------------


def random_model(seed: int = 0, *, n_vocab: int = 256, n_embd: int = 64, n_layer: int = 4,
                 d_state: int = 16, d_conv: int = 4, d_inner: int | None = None,
                 dt_rank: int | None = None, rms_eps: float = 1e-5, tied: bool = False,
                 dtype: Any = np.float64) -> MambaModel:
    """A Mamba-1 model with seeded random weights, initialised as ``mamba_ssm`` does.

    Defaults follow the reference architecture: ``d_inner = 2*n_embd``,
    ``dt_rank = ceil(n_embd/16)``, S4D-real ``A = -[1..d_state]``, ``D = 1``,
    ``dt`` log-uniform in [1e-3, 1e-1] through the softplus bias.  The output
    projection is scaled so that logits spread over a few units: greedy
    decoding is not degenerate and sampling is not uniform.
    """
    d_inner = 2 * n_embd if d_inner is None else d_inner
    dt_rank = -(n_embd // -16) if dt_rank is None else dt_rank
    p = MambaHParams(n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, d_conv=d_conv, d_inner=d_inner,
                     d_state=d_state, dt_rank=dt_rank, rms_eps=rms_eps)
    rng = np.random.default_rng(seed)

    def uniform(bound: float, *shape: int) -> np.ndarray:
        return rng.uniform(-bound, bound, size=shape)

    layers = []
    for _ in range(n_layer):
        dt_init = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), size=d_inner))
        layers.append(MambaLayer(
            attn_norm=1.0 + 0.1 * rng.standard_normal(n_embd),
            ssm_in=rng.standard_normal((2 * d_inner, n_embd)) / np.sqrt(n_embd),
            ssm_conv1d=uniform(1 / np.sqrt(d_conv), d_inner, d_conv),
            ssm_conv1d_b=uniform(1 / np.sqrt(d_conv), d_inner),
            ssm_x=uniform(1 / np.sqrt(d_inner), dt_rank + 2 * d_state, d_inner),
            ssm_dt=uniform(1 / np.sqrt(dt_rank), d_inner, dt_rank),
            ssm_dt_b=dt_init + np.log(-np.expm1(-dt_init)),  # softplus(bias) = dt_init
            ssm_a=-np.tile(np.arange(1, d_state + 1, dtype=np.float64), (d_inner, 1)),
            ssm_d=np.ones(d_inner),
            # residual branches scaled by 1/sqrt(n_layer), as mamba_ssm's rescale_prenorm_residual
            ssm_out=rng.standard_normal((n_embd, d_inner)) / np.sqrt(d_inner * n_layer),
        ))
    token_embd = rng.standard_normal((n_vocab, n_embd))
    output_norm = 1.0 + 0.1 * rng.standard_normal(n_embd)
    output = None if tied else 3.0 * rng.standard_normal((n_vocab, n_embd)) / np.sqrt(n_embd)
    return MambaModel(p, token_embd, layers, output_norm, output, dtype=dtype)


