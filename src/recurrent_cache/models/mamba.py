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

The states live in the cache in llama.cpp's layout, so state blobs are
interchangeable with llama.cpp for the same model:

* r row (n_embd_r = (d_conv-1) * d_inner): the last d_conv-1 inputs of each
  channel, channel-major, oldest first: ``r[ch*(d_conv-1) + t]``;
* s row (n_embd_s = d_state * d_inner): ``h[ch, n]`` at ``s[ch*d_state + n]``.

Precision: weights and activations are in the model's ``dtype`` (float64 by
default).  The recurrent state is rounded to the cache's storage type (f32,
f16, bf16) after every token, not only where a ubatch ends as llama.cpp does,
so a sequence's result does not depend on how its tokens were split into
ubatches: a batched run equals a solo run even with f16 states.  With f32
states this rounding is below llama.cpp's own float32 error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any
from collections.abc import Sequence

import numpy as np

from ..errors import RecurrentCacheError
from ..memory_state import MemoryStatus
from ._storage import StateStorage
from .gguf_file import FLOAT_TYPES, GGUFError, GGUFFile
from .vocab import Vocabulary

__all__ = ["ModelError", "MambaHParams", "MambaLayer", "MambaModel", "ReferenceRun",
           "random_model", "load_gguf", "write_gguf"]

ARCH = "mamba"


class ModelError(RecurrentCacheError, ValueError):
    """Weights, a model file or an input that do not make a valid Mamba model run."""


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
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ModelError(f"hyper-parameter {name} must be a positive integer, got {value!r}")
        if self.d_conv < 2:
            # d_conv = 1 would leave no rolling state: the cache needs rows of width >= 1
            raise ModelError(f"d_conv must be >= 2, got {self.d_conv}")
        if not self.rms_eps > 0:
            raise ModelError(f"rms_eps must be positive, got {self.rms_eps!r}")

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


def _layer_shapes(p: MambaHParams) -> dict[str, tuple[int, ...]]:
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


def _checked(array: Any, shape: tuple[int, ...], name: str, dtype: np.dtype) -> np.ndarray:
    array = np.asarray(array)
    if array.shape != shape:
        raise ModelError(f"tensor {name} has shape {array.shape}, expected {shape}")
    if array.dtype.kind not in "fiu":
        raise ModelError(f"tensor {name} holds {array.dtype}, not numbers")
    with np.errstate(all="ignore"):  # an overflow to inf is reported just below
        converted = np.ascontiguousarray(array, dtype=dtype)
    if not np.isfinite(converted).all():
        # NaN or inf weights would make every logit NaN: refuse them with the tensor's name
        raise ModelError(f"tensor {name} holds {np.size(converted) - np.isfinite(converted).sum()} "
                         f"values that are NaN or infinite (as {np.dtype(dtype).name})")
    return converted


# -- the math shared by the batched and the reference forward -----------------------


def rms_norm(v: np.ndarray, eps: float) -> np.ndarray:
    """``v / sqrt(mean(v*v) + eps)`` over the last axis (ggml_rms_norm, no weight)."""
    return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)


def silu(v: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-v) overflows to inf for very negative v: silu -> -0
        return v / (1.0 + np.exp(-v))


def softplus(v: np.ndarray) -> np.ndarray:
    """ggml's: ``v`` above 20, else ``log1p(exp(v))``."""
    return np.where(v > 20.0, v, np.log1p(np.exp(np.minimum(v, 20.0))))


class MambaModel:
    """A Mamba-1 language model: weights, and the forward pass over the cache.

    ``output=None`` ties the output projection to ``token_embd`` (as llama.cpp
    does when a GGUF file has no ``output.weight``).  Every weight is stored
    in ``dtype``, the type the forward pass computes in.
    """

    def __init__(self, hparams: MambaHParams, token_embd: Any, layers: Sequence[MambaLayer],
                 output_norm: Any, output: Any = None, dtype: Any = np.float64,
                 vocab: Vocabulary | None = None) -> None:
        p = self.hparams = hparams
        if vocab is None and p.n_vocab == 256:
            vocab = Vocabulary.of_bytes()
        if vocab is not None and len(vocab) > p.n_vocab:
            raise ModelError(f"a vocabulary of {len(vocab)} tokens for a model of n_vocab = {p.n_vocab}")
        if vocab is not None and len(vocab) < p.n_vocab:  # the converter pads n_vocab: padding decodes to nothing
            vocab = vocab.padded(p.n_vocab)
        # token ids <-> bytes; None when the model has no vocabulary (token ids only)
        self.vocab = vocab
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise ModelError(f"a model computes in float32 or float64, not {self.dtype}")
        if len(layers) != p.n_layer:
            raise ModelError(f"{len(layers)} layers for a model of n_layer = {p.n_layer}")
        self.token_embd = _checked(token_embd, (p.n_vocab, p.n_embd), "token_embd.weight", self.dtype)
        self.output_norm = _checked(output_norm, (p.n_embd,), "output_norm.weight", self.dtype)
        self.output = (self.token_embd if output is None
                       else _checked(output, (p.n_vocab, p.n_embd), "output.weight", self.dtype))
        shapes = _layer_shapes(p)
        self.layers = [
            MambaLayer(**{name: _checked(getattr(layer, name), shapes[name], f"blk.{il}.{tensor}", self.dtype)
                          for name, tensor in LAYER_TENSORS.items()})
            for il, layer in enumerate(layers)]

    @property
    def tied(self) -> bool:
        """True when the output projection is ``token_embd`` (no ``output.weight``)."""
        return self.output is self.token_embd

    def new_cache(self, n_seq_max: int = 1, size: int | None = None, dtype: str = "f32", n_rollback: int = 0,
                  engine: str | None = None):
        """A ``RecurrentCache`` shaped for this model, with ``dtype`` states ("f32", "f16", "bf16");
        ``n_rollback`` past states per cell for speculative decoding (the model writes them)."""
        from .. import RecurrentCache

        p = self.hparams
        return RecurrentCache(p.n_layer, p.n_embd_r, p.n_embd_s, n_seq_max=n_seq_max, size=size,
                              dtype_r=dtype, dtype_s=dtype, n_rollback=n_rollback, engine=engine)

    # -- running on the cache ---------------------------------------------------

    def forward(self, st) -> np.ndarray:
        """Run every ubatch of ``st`` (from ``cache.init_batch``), applying each in turn.

        Returns the logits of the output tokens, shape ``[n_outputs, n_vocab]``:
        row ``i`` belongs to batch index ``st.out_ids[i]``.
        """
        if st.status != MemoryStatus.SUCCESS:
            raise ModelError(f"cannot run a batch whose init_batch status is {st.status.name}")
        logits = [self.forward_ubatch(st) for _ in st]
        return np.concatenate(logits) if logits else np.zeros((0, self.hparams.n_vocab), self.dtype)

    def forward_ubatch(self, st) -> np.ndarray:
        """Run the ubatch that ``st`` has just applied, updating its state rows in place.

        Group ``s`` starts from rows ``st.r(il)[s]`` / ``st.s(il)[s]`` and its
        final states are written back there; with a cache that keeps a rollback
        history (``n_rollback > 0``) the states after the group's earlier tokens
        go into ``st.r_steps(il)`` / ``st.s_steps(il)`` (SPEC §7).  Returns the
        logits of the ubatch's output tokens in ubatch order, ``[n_outputs, n_vocab]``.
        """
        p = self.hparams
        ub = st.ubatch
        n_seqs, n_seq_tokens = ub.n_seqs, ub.n_seq_tokens
        try:
            r_rows = [st.r(il) for il in range(p.n_layer)]
            s_rows = [st.s(il) for il in range(p.n_layer)]
        except IndexError:
            raise ModelError(f"the cache has fewer than the model's {p.n_layer} layers "
                             "(use model.new_cache())") from None
        if r_rows[0].shape[1] != p.n_embd_r or s_rows[0].shape[1] != p.n_embd_s:
            raise ModelError(f"the cache rows are {r_rows[0].shape[1]} / {s_rows[0].shape[1]} wide; "
                             f"this model needs {p.n_embd_r} / {p.n_embd_s} (use model.new_cache())")
        storage_r, storage_s = StateStorage(r_rows[0].dtype), StateStorage(s_rows[0].dtype)
        conv = [storage_r.decode(rows, self.dtype).reshape(n_seqs, p.d_inner, p.d_conv - 1) for rows in r_rows]
        ssm = [storage_s.decode(rows, self.dtype).reshape(n_seqs, p.d_inner, p.d_state) for rows in s_rows]

        m = st.r_steps(0).shape[1] if p.n_layer else 0   # step states the cache keeps per group
        steps: list[tuple[np.ndarray, np.ndarray]] = []
        x = self._embed(ub.token, ub.embd).reshape(n_seqs, n_seq_tokens, p.n_embd)
        x = self._blocks(x, conv, ssm, storage_r, storage_s, m, steps)

        for il in range(p.n_layer):
            r_rows[il][...] = storage_r.encode(conv[il].reshape(n_seqs, p.n_embd_r))
            s_rows[il][...] = storage_s.encode(ssm[il].reshape(n_seqs, p.n_embd_s))
            if m:
                st.r_steps(il)[...] = storage_r.encode(steps[il][0].reshape(n_seqs, m, p.n_embd_r))
                st.s_steps(il)[...] = storage_s.encode(steps[il][1].reshape(n_seqs, m, p.n_embd_s))
        return self._logits(x.reshape(ub.n_tokens, p.n_embd)[ub.output])

    # -- the layers ---------------------------------------------------------------

    def _embed(self, tokens: np.ndarray | None, embd: np.ndarray | None = None) -> np.ndarray:
        p = self.hparams
        if tokens is None:
            if embd.shape[1] != p.n_embd:
                raise ModelError(f"embedding input of width {embd.shape[1]}; this model has n_embd {p.n_embd}")
            return embd.astype(self.dtype)
        tokens = np.asarray(tokens)
        bad = (tokens < 0) | (tokens >= p.n_vocab)
        if bad.any():
            raise ModelError(f"token id {int(tokens[bad][0])} is outside the vocabulary [0, {p.n_vocab})")
        return self.token_embd[tokens]

    def _blocks(self, x: np.ndarray, conv: list[np.ndarray], ssm: list[np.ndarray],
                storage_r: StateStorage, storage_s: StateStorage, m: int = 0,
                steps: list[tuple[np.ndarray, np.ndarray]] | None = None) -> np.ndarray:
        """All layers on ``x`` [n_seqs, n_tokens, n_embd]; ``conv`` / ``ssm`` are updated in place.

        With ``m > 0`` each layer's states after tokens n_tokens-1-m .. n_tokens-2 are appended
        to ``steps`` as (conv [n_seqs, m, d_inner, d_conv-1], ssm [n_seqs, m, d_inner, d_state]).
        """
        eps = self.hparams.rms_eps
        for layer, conv_l, ssm_l in zip(self.layers, conv, ssm):
            x = x + self._mixer(layer, rms_norm(x, eps) * layer.attn_norm, conv_l, ssm_l, storage_r, storage_s,
                                m, steps)
        return x

    def _mixer(self, layer: MambaLayer, u: np.ndarray, conv: np.ndarray, ssm: np.ndarray,
               storage_r: StateStorage, storage_s: StateStorage, m: int = 0,
               steps: list[tuple[np.ndarray, np.ndarray]] | None = None) -> np.ndarray:
        """One Mamba block on ``u`` [n_seqs, n_tokens, n_embd].

        conv: [n_seqs, d_inner, d_conv-1] and ssm: [n_seqs, d_inner, d_state],
        the states before the first token; they are left holding the states
        after the last one.
        """
        p = self.hparams
        n_tokens = u.shape[1]
        xz = u @ layer.ssm_in.T
        # The conv inputs are rounded as the cache stores them *before* use, so
        # the window is the same whether an input came from this ubatch or
        # from the cache: the result does not depend on ubatch boundaries.
        xi = storage_r.round(xz[..., :p.d_inner])
        z = xz[..., p.d_inner:]

        window = np.concatenate([conv, xi.transpose(0, 2, 1)], axis=2)  # [n_seqs, d_inner, d_conv-1+n_tokens]
        conv[...] = window[:, :, n_tokens:]
        xc = sum(window[:, :, k:k + n_tokens] * layer.ssm_conv1d[:, k, None] for k in range(p.d_conv))
        xc = silu(xc.transpose(0, 2, 1) + layer.ssm_conv1d_b)               # [n_seqs, n_tokens, d_inner]

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
        if m:
            conv_steps = np.stack([window[:, :, t + 1:t + p.d_conv] for t in range(first_step, n_tokens - 1)], axis=1)
            ssm_steps = np.empty((ssm.shape[0], m) + ssm.shape[1:], dtype=ssm.dtype)
        y = np.empty_like(xc)
        for t in range(n_tokens):
            h = ssm * np.exp(dt[:, t, :, None] * layer.ssm_a) + dt_x[:, t, :, None] * b[:, t, None, :]
            y[:, t] = (h @ c[:, t, :, None])[..., 0]
            ssm[...] = storage_s.round(h)
            if first_step <= t < n_tokens - 1:
                ssm_steps[:, t - first_step] = ssm
        if m and steps is not None:
            steps.append((conv_steps, ssm_steps))
        return ((y + xc * layer.ssm_d) * silu(z)) @ layer.ssm_out.T

    def _logits(self, x: np.ndarray) -> np.ndarray:
        return (rms_norm(x, self.hparams.rms_eps) * self.output_norm) @ self.output.T


class ReferenceRun:
    """One sequence, one token at a time, with its own state and no cache.

    What every batched run through the cache must equal: it shares the
    per-token math with ``MambaModel.forward_ubatch`` but none of the cache
    plumbing (rows, splits, copy plans).  ``dtype_r`` / ``dtype_s`` are the
    cache storage types to mirror ("f32", "f16", "bf16").
    """

    def __init__(self, model: MambaModel, dtype_r: str = "f32", dtype_s: str = "f32") -> None:
        p = model.hparams
        self.model = model
        self.dtype_r, self.dtype_s = dtype_r, dtype_s
        self.storage_r = StateStorage.named(dtype_r)
        self.storage_s = StateStorage.named(dtype_s)
        self.conv = [np.zeros((1, p.d_inner, p.d_conv - 1), model.dtype) for _ in range(p.n_layer)]
        self.ssm = [np.zeros((1, p.d_inner, p.d_state), model.dtype) for _ in range(p.n_layer)]

    def feed(self, tokens: Sequence[int]) -> np.ndarray:
        """Run ``tokens`` in order; the logits after each one, ``[len(tokens), n_vocab]``."""
        model = self.model
        logits = []
        for token in tokens:
            x = model._embed(np.array([[token]]))   # noqa: SLF001 - this module's model, run step by step
            x = model._blocks(x, self.conv, self.ssm, self.storage_r, self.storage_s)   # noqa: SLF001 - this module's model, run step by step
            logits.append(model._logits(x[0]))   # noqa: SLF001 - this module's model, run step by step
        return np.concatenate(logits)

    def copy(self) -> "ReferenceRun":
        """An independent run from this one's current state (a fork)."""
        twin = ReferenceRun(self.model, self.dtype_r, self.dtype_s)
        twin.conv = [a.copy() for a in self.conv]
        twin.ssm = [a.copy() for a in self.ssm]
        return twin


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


# -- GGUF files -------------------------------------------------------------------------

_GGUF_MISSING = ("quantized tensors and writing GGUF files need the gguf package: "
                 "pip install 'recurrent_cache[gguf]' (or pip install gguf)")


def _import_gguf():
    try:
        import gguf
    except ImportError as exc:
        raise ImportError(_GGUF_MISSING) from exc
    return gguf


def load_gguf(path: str | os.PathLike, dtype: Any = np.float64) -> MambaModel:
    """Load a Mamba-1 GGUF file written by llama.cpp's converter (or ``write_gguf``).

    Reads the ``mamba.*`` hyper-parameters, llama.cpp's tensor names and the
    vocabulary (``tokenizer.ggml.tokens``; none for a byte-level model).
    f32, f16, bf16 and f64 tensors need numpy only; quantized tensors are
    dequantized by the ``gguf`` package.  Without ``output.weight`` the output
    is tied to ``token_embd``.  The vocabulary size is ``token_embd``'s row
    count (llama.cpp's converter pads it to a multiple of 8).

    Any problem — a missing, empty, truncated or corrupt file, another
    architecture, a missing key or tensor, a wrong shape — raises
    ``ModelError`` naming the file and the problem.
    """
    name = os.fspath(path)
    try:
        return _load_gguf(GGUFFile(name), dtype)
    except ModelError as exc:
        raise ModelError(f"{name}: {exc}") from None
    except GGUFError as exc:
        raise ModelError(f"{name}: not a valid GGUF file: {exc}") from None
    except OSError as exc:
        raise ModelError(f"{name}: cannot read the file: {exc.strerror or exc}") from None
    except (ValueError, TypeError, OverflowError, MemoryError) as exc:  # e.g. a key of the wrong type
        raise ModelError(f"{name}: not a valid Mamba GGUF file: {exc}") from None


def _load_gguf(file: GGUFFile, dtype: Any) -> MambaModel:
    def key(name: str, kind: type, default: Any = None) -> Any:
        value = file.fields.get(name, default)
        if value is None:
            raise ModelError(f"GGUF key {name} is missing")
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ModelError(f"GGUF key {name} is {value!r}, not an integer")
        if kind is float and not isinstance(value, (int, float)):
            raise ModelError(f"GGUF key {name} is {value!r}, not a number")
        return kind(value)

    arch = file.fields.get("general.architecture")
    if arch != ARCH:
        raise ModelError(f"architecture {arch!r}; this loader reads {ARCH!r} (Mamba-1) models")

    def tensor(name: str, required: bool = True) -> np.ndarray | None:
        info = file.tensors.get(name)
        if info is None:
            if required:
                raise ModelError(f"tensor {name} is missing")
            return None
        if info.type_id in FLOAT_TYPES:
            return file.floats(info)
        return _dequantized(file, info)

    token_embd = tensor("token_embd.weight")
    if token_embd.ndim != 2:
        raise ModelError(f"tensor token_embd.weight has shape {token_embd.shape}, not 2-D")
    hparams = MambaHParams(
        n_vocab=int(token_embd.shape[0]),
        n_embd=key("mamba.embedding_length", int),
        n_layer=key("mamba.block_count", int),
        d_conv=key("mamba.ssm.conv_kernel", int),
        d_inner=key("mamba.ssm.inner_size", int),
        d_state=key("mamba.ssm.state_size", int),
        dt_rank=key("mamba.ssm.time_step_rank", int),
        rms_eps=key("mamba.attention.layer_norm_rms_epsilon", float),
        dt_b_c_rms=key("mamba.ssm.dt_b_c_rms", bool, False),
    )
    layers = []
    for il in range(hparams.n_layer):
        weights = {name: tensor(f"blk.{il}.{suffix}") for name, suffix in LAYER_TENSORS.items()}
        # Early converters kept the conv weight as {d_conv, 1, d_inner}: drop the unit axis.
        if weights["ssm_conv1d"].size == hparams.d_inner * hparams.d_conv:
            weights["ssm_conv1d"] = weights["ssm_conv1d"].reshape(hparams.d_inner, hparams.d_conv)
        layers.append(MambaLayer(**weights))
    return MambaModel(hparams, token_embd, layers, tensor("output_norm.weight"),
                      tensor("output.weight", required=False), dtype=dtype, vocab=_vocabulary(file))


def _vocabulary(file: GGUFFile) -> Vocabulary | None:
    """The file's vocabulary: its tokens, or bytes for a token-free ("no_vocab") model of 256 tokens."""
    tokens = file.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        return None  # MambaModel takes a 256-token model as byte-level
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ModelError("GGUF key tokenizer.ggml.tokens is not a list of strings")
    types = file.fields.get("tokenizer.ggml.token_type")
    try:
        eos = file.fields.get("tokenizer.ggml.eos_token_id")
        return Vocabulary.from_gguf_tokens(str(file.fields.get("tokenizer.ggml.model", "gpt2")), tokens, types,
                                           eos if isinstance(eos, int) else None)
    except ValueError as exc:
        raise ModelError(f"vocabulary: {exc}") from None


def _dequantized(file: GGUFFile, info) -> np.ndarray:
    try:
        gguf = _import_gguf()
    except ImportError:
        raise ModelError(f"tensor {info.name} is {info.type_name} (quantized); {_GGUF_MISSING}") from None
    try:
        qtype = gguf.GGMLQuantizationType(info.type_id)
        raw = file.raw(info).reshape(int(np.prod(info.shape[:-1], dtype=np.int64)), -1)
        values = gguf.quants.dequantize(raw, qtype)
    except (NotImplementedError, ValueError) as exc:
        raise ModelError(f"tensor {info.name} has type {info.type_name}: {exc}") from None
    return values.reshape(info.shape)


# Tensors llama.cpp's converter keeps in f32 in an f16 file: every 1-D tensor,
# ssm_conv1d, and everything not named ".weight" (ssm_a, ssm_d).
def _stays_f32(name: str, array: np.ndarray) -> bool:
    return array.ndim <= 1 or ".ssm_conv1d." in name or not name.endswith(".weight")


def write_gguf(model: MambaModel, path: str | os.PathLike, file_type: str = "f32",
               name: str = "recurrent-cache-random-mamba", tokens: Sequence[str] | None = None,
               token_types: Sequence[int] | None = None, tokenizer: str = "gpt2", eos: int | None = None) -> None:
    """Write ``model`` as a GGUF file that llama.cpp loads (architecture ``mamba``).

    Keys and tensor names are those of llama.cpp's converter.  ``file_type``
    "f16" stores the 2-D weights in f16 as the converter's ``--outtype f16``
    does (1-D tensors, ``ssm_conv1d``, ``ssm_a`` and ``ssm_d`` stay f32).  A
    tied model gets no ``output.weight``.  Without ``tokens`` there is no
    tokenizer (``tokenizer.ggml.model = "no_vocab"``): the model takes token
    ids, or bytes when it has 256 tokens.  ``tokens`` (with ``token_types``
    and the ``eos`` token id) are written as ``tokenizer.ggml.tokens`` of a ``tokenizer`` model, as
    llama.cpp's converter writes them ("gpt2": byte-level BPE pieces).
    """
    if file_type not in ("f32", "f16"):
        raise ModelError(f"file_type must be 'f32' or 'f16', got {file_type!r}")
    gguf = _import_gguf()
    p = model.hparams
    writer = gguf.GGUFWriter(os.fspath(path), ARCH)
    writer.add_name(name)
    writer.add_context_length(2**20)  # the converter's placeholder: a recurrent model has no limit
    writer.add_embedding_length(p.n_embd)
    writer.add_feed_forward_length(0)  # unused, but llama.cpp requires the key
    writer.add_head_count(0)           # likewise
    writer.add_block_count(p.n_layer)
    writer.add_ssm_conv_kernel(p.d_conv)
    writer.add_ssm_inner_size(p.d_inner)
    writer.add_ssm_state_size(p.d_state)
    writer.add_ssm_time_step_rank(p.dt_rank)
    writer.add_layer_norm_rms_eps(p.rms_eps)
    writer.add_ssm_dt_b_c_rms(p.dt_b_c_rms)
    writer.add_vocab_size(p.n_vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if file_type == "f16" else gguf.LlamaFileType.ALL_F32)
    if tokens is None:
        writer.add_tokenizer_model("no_vocab")
    else:
        writer.add_tokenizer_model(tokenizer)
        writer.add_token_list(list(tokens))
        if token_types is not None:
            writer.add_token_types(list(token_types))
        if eos is not None:
            writer.add_eos_token_id(eos)

    named = {"token_embd.weight": model.token_embd, "output_norm.weight": model.output_norm}
    if not model.tied:
        named["output.weight"] = model.output
    for il, layer in enumerate(model.layers):
        for field_name, suffix in LAYER_TENSORS.items():
            named[f"blk.{il}.{suffix}"] = getattr(layer, field_name)
    for tensor_name, array in named.items():
        stored = np.float32 if file_type == "f32" or _stays_f32(tensor_name, array) else np.float16
        writer.add_tensor(tensor_name, np.ascontiguousarray(array, dtype=stored))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
