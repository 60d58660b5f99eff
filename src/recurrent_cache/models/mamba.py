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

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._arrays import Array
from ._registry import Family, register
from ._ssm import (conv_tokens, linear, random_conv, random_dt_bias, random_head, rms_norm, selective_scan, silu,
                   softplus)
from ._storage import StateStorage
from .recurrent import MixerResult, RecurrentModel, ReferenceRun, check_sizes, checked_layers
from .gguf_io import GGUFReader
from .hf import Checkpoint, built, common_sizes, head_tensors
from .vocab import Vocabulary

__all__ = ["ARCH", "LAYER_TENSORS", "MambaHParams", "MambaLayer", "MambaModel", "ReferenceRun", "mamba_mixer",
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
        check_sizes(self, ("n_vocab", "n_embd", "n_layer", "d_conv", "d_inner", "d_state", "dt_rank"))

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


# The weights ``linear`` multiplies by (kept in its layout).
PRODUCTS = frozenset({"ssm_in", "ssm_x", "ssm_dt", "ssm_out"})


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
                                     self.dtype, PRODUCTS)

    def mixer(self, xp: Any, w: dict[str, Array], u: Array, conv: Array, ssm: Array,
              storage_r: StateStorage, storage_s: StateStorage, m: int) -> MixerResult:
        """One Mamba block on ``u`` [n_seqs, n_tokens, n_embd] (``mamba_mixer``)."""
        return mamba_mixer(xp, self.hparams, w, u, conv, ssm, storage_r, storage_s, m)


def mamba_mixer(xp: Any, p: MambaHParams, w: dict[str, Array], u: Array, conv: Array, ssm: Array,
                storage_r: StateStorage, storage_s: StateStorage, m: int) -> MixerResult:
    """One Mamba block of sizes ``p`` on ``u`` [n_seqs, n_tokens, n_embd] (see ``RecurrentModel.mixer``).

    conv: [n_seqs, d_inner, d_conv-1] and ssm: [n_seqs, d_inner, d_state].  With ``p.dt_b_c_rms``, dt, B
    and C are RMS-normed, and multiplied by ``w``'s ``ssm_dt_norm`` / ``ssm_b_norm`` / ``ssm_c_norm`` where
    the layer has them (Jamba; Falcon-Mamba's norms have no weight).
    """
    xz = linear(u, w["ssm_in"])
    z = xz[..., p.d_inner:]
    # [n_seqs, n_tokens, d_inner], the conv states after the last token (and the step states)
    xc, conv, conv_steps = conv_tokens(xp, conv, xz[..., :p.d_inner], w["ssm_conv1d"], w["ssm_conv1d_b"], storage_r, m)

    dbc = linear(xc, w["ssm_x"])
    dt = dbc[..., :p.dt_rank]
    b = dbc[..., p.dt_rank:p.dt_rank + p.d_state]
    c = dbc[..., p.dt_rank + p.d_state:]
    if p.dt_b_c_rms:
        dt, b, c = rms_norm(xp, dt, p.rms_eps), rms_norm(xp, b, p.rms_eps), rms_norm(xp, c, p.rms_eps)
        if "ssm_dt_norm" in w:
            dt, b, c = dt * w["ssm_dt_norm"], b * w["ssm_b_norm"], c * w["ssm_c_norm"]
    dt = softplus(xp, linear(dt, w["ssm_dt"]) + w["ssm_dt_b"])               # [n_seqs, n_tokens, d_inner]
    # per channel: the decay exp(dt * A[ch, :]) and the input dt * xc, over d_state
    y, ssm, ssm_steps = selective_scan(xp, ssm, dt[..., None], w["ssm_a"], dt * xc, b, c, storage_s, m)
    out = linear((y + xc * w["ssm_d"]) * silu(xp, z), w["ssm_out"])
    return out, conv, ssm, None if conv_steps is None else (conv_steps, ssm_steps)


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
        dt_bias = random_dt_bias(rng, d_inner)
        attn_norm = 1.0 + 0.1 * rng.standard_normal(n_embd)
        ssm_in = rng.standard_normal((2 * d_inner, n_embd)) / np.sqrt(n_embd)
        conv_weight, conv_bias = random_conv(rng, d_inner, d_conv)
        layers.append(MambaLayer(
            attn_norm=attn_norm, ssm_in=ssm_in, ssm_conv1d=conv_weight, ssm_conv1d_b=conv_bias,
            ssm_x=uniform(1 / np.sqrt(d_inner), dt_rank + 2 * d_state, d_inner),
            ssm_dt=uniform(1 / np.sqrt(dt_rank), d_inner, dt_rank),
            ssm_dt_b=dt_bias,
            ssm_a=-np.tile(np.arange(1, d_state + 1, dtype=np.float64), (d_inner, 1)),
            ssm_d=np.ones(d_inner),
            # residual branches scaled by 1/sqrt(n_layer), as mamba_ssm's rescale_prenorm_residual
            ssm_out=rng.standard_normal((n_embd, d_inner)) / np.sqrt(d_inner * n_layer),
        ))
    token_embd, output_norm, output = random_head(rng, n_vocab, n_embd, tied)
    return MambaModel(p, token_embd, layers, output_norm, output, dtype=dtype)


# -- files: GGUF (llama.cpp's converter) and Hugging Face checkpoints (transformers' MambaForCausalLM) ----------


def _from_gguf(read: GGUFReader, sizes: dict[str, Any], head: tuple[Any, Any, Any], dtype: Any,
               vocab: Vocabulary | None) -> MambaModel:
    """The model of a GGUF file of architecture ``mamba`` (``load_gguf``)."""
    hparams = MambaHParams(**sizes, dt_rank=read.key("ssm.time_step_rank", int),
                           dt_b_c_rms=read.key("ssm.dt_b_c_rms", bool, False))
    shapes = layer_shapes(hparams)
    layers = [MambaLayer(**{field: read.tensor(f"blk.{il}.{suffix}", shapes[field])
                            for field, suffix in LAYER_TENSORS.items()})
              for il in range(hparams.n_layer)]
    token_embd, output_norm, output = head
    return MambaModel(hparams, token_embd, layers, output_norm, output, dtype=dtype, vocab=vocab)


def _gguf_layout(model: MambaModel) -> dict[str, tuple[str, tuple[int, ...]]]:
    shapes = layer_shapes(model.hparams)
    return {field: (suffix, shapes[field]) for field, suffix in LAYER_TENSORS.items()}


def _write_gguf_keys(writer: Any, model: MambaModel) -> None:
    writer.add_ssm_time_step_rank(model.hparams.dt_rank)
    writer.add_layer_norm_rms_eps(model.hparams.rms_eps)
    writer.add_ssm_dt_b_c_rms(model.hparams.dt_b_c_rms)


def _from_hf(checkpoint: Checkpoint, dtype: Any, vocab: Vocabulary | None) -> MambaModel:
    """The model of a ``MambaForCausalLM`` checkpoint directory (``load_hf``)."""
    config = checkpoint.config
    common = common_sizes(checkpoint)
    n_embd = common["n_embd"]
    d_inner = checkpoint.field("intermediate_size", int, int(checkpoint.field("expand", int, 2) * n_embd))
    rank = config.get("time_step_rank", "auto")
    dt_rank = math.ceil(n_embd / 16) if rank == "auto" else checkpoint.field("time_step_rank", int)
    p = built(checkpoint, MambaHParams, **common, d_inner=d_inner, dt_rank=dt_rank)
    use_conv_bias = checkpoint.field("use_conv_bias", bool, True)
    layers = []
    for il in range(p.n_layer):
        weight = checkpoint.layer_tensors(il)
        layers.append(MambaLayer(
            attn_norm=weight("norm.weight", (p.n_embd,)),
            ssm_in=weight("mixer.in_proj.weight", (2 * p.d_inner, p.n_embd)),
            ssm_conv1d=weight("mixer.conv1d.weight", (p.d_inner, p.d_conv)),
            ssm_conv1d_b=(weight("mixer.conv1d.bias", (p.d_inner,)) if use_conv_bias
                          else np.zeros(p.d_inner, np.float32)),
            ssm_x=weight("mixer.x_proj.weight", (p.dt_rank + 2 * p.d_state, p.d_inner)),
            ssm_dt=weight("mixer.dt_proj.weight", (p.d_inner, p.dt_rank)),
            ssm_dt_b=weight("mixer.dt_proj.bias", (p.d_inner,)),
            ssm_a=-np.exp(weight("mixer.A_log", (p.d_inner, p.d_state)).astype(np.float64)),
            ssm_d=weight("mixer.D", (p.d_inner,)),
            ssm_out=weight("mixer.out_proj.weight", (p.n_embd, p.d_inner)),
        ))
    token_embd, output_norm, output = head_tensors(checkpoint, p.n_vocab, p.n_embd, tied_default=True)
    return built(checkpoint, MambaModel, hparams=p, token_embd=token_embd, layers=layers,
                    output_norm=output_norm, output=output, dtype=dtype, vocab=vocab)


FAMILY = register(Family(label="Mamba-1", gguf_arch=ARCH, hf_architecture="MambaForCausalLM", model_class=MambaModel,
                         from_gguf=_from_gguf, from_hf=_from_hf, gguf_layout=_gguf_layout,
                         write_gguf_keys=_write_gguf_keys))
