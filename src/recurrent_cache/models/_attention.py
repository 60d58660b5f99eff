"""The attention layer of the hybrid families, over a KV cache's rows, written once against an array namespace ``xp``.

One ubatch of ``n_tokens`` tokens, ``x`` [n_tokens, n_embd] -> [n_tokens, n_embd]::

    q, gate = split_per_head(x @ wq.T + bq)        # gate only when the layer is gated (Qwen3-Next)
    k, v    = x @ wk.T + bk, x @ wv.T + bv
    q, k    = rms_norm(q) * q_norm, rms_norm(k) * k_norm    # per head, when the layer has the norms
    q, k    = rope(q, pos), rope(k, pos)           # the first n_rot values of each head
    k_cache[cells], v_cache[cells] = k, v          # rounded to the cache's storage dtype
    p       = softmax(q @ K[:n_kv].T * scale + mask)  # head h reads KV head h // (n_head / n_head_kv)
    out     = ((p @ V[:n_kv]) * sigmoid(gate)) @ wo.T + bo

``K`` and ``V`` are the cache's rows read back (float32 / float16 / bfloat16
storage, widened to ``x``'s dtype), so a token attends to the keys exactly as
the cache holds them, whether they were written by this ubatch or an earlier
one: the output does not depend on the ubatch boundaries.  The mask is the KV
table's (``kv_reference.KVCells.mask``): 0 where token t sees cell j, -inf
elsewhere.

**RoPE.**  llama.cpp's two layouts of the rotated pairs, at angle
``pos * freq_scale * freq_base ** (-2i / n_rot)`` for pair i < n_rot / 2:
"normal" rotates adjacent values (2i, 2i+1); "neox" rotates (i, i + n_rot/2)
— transformers' ``rotate_half``.  The values of a head past ``n_rot`` are not
rotated (partial rotary).  Normal on weights whose q / k rows are permuted
pairwise (``convert_hf_to_gguf``'s ``LlamaModel.permute``) equals neox on the
original weights.  What each hybrid family uses:

==============  ==================  ===========================  =========  ==============================
family          llama.cpp: rope     transformers                 q/k norm   besides
==============  ==================  ===========================  =========  ==============================
Jamba           jamba: none         no rotary embedding          no
Bamba           granitehybrid:      rotate_half over the first   no         llama.cpp's converter permutes
                normal              half (partial factor 0.5)               q / k (normal = neox)
Granite-4.0-H   granitehybrid:      none (position_embedding_    no         rope only for Bamba or a
                none (see besides)  type "nope")                            model without SSM layers
Nemotron-H      nemotron_h: none    no rotary embedding          no
Falcon-H1       falcon-h1: neox     rotate_half                  no         k times key_multiplier
Qwen3-Next      qwen3next: neox     rotate_half, first quarter   yes (1+w)  sigmoid output gate
                                    (partial factor 0.25)
LFM2            lfm2: neox          rotate_half                  yes        o_proj is out_proj
==============  ==================  ===========================  =========  ==============================

llama.cpp's converter permutes each whole head of Bamba's q / k rows, then rotates
the first n_rot values the "normal" way: for a partial rotary head this is not
transformers' rotation (pairs (i, i + head_dim/2) rather than (i, i + n_rot/2);
measured on a random Bamba layer the outputs differ by 7.6 of 11).  Transformers'
Bamba is neox over the first n_rot values of the unpermuted rows.

Qwen3-Next's norms multiply by ``1 + weight`` (transformers' ``Qwen3NextRMSNorm``;
a GGUF file stores ``1 + weight``): pass the weight the norm multiplies by.
Its ``q_proj`` gives, per head, head_dim query values then head_dim gate
values; the gate multiplies the attention output by ``sigmoid(gate)`` before
``o_proj``.  Falcon-H1's ``key_multiplier`` is a scale a loader folds into wk and bk.

**A row the mask hides entirely** attends to nothing: its attention output is
0 (then ``wo``'s bias), as llama.cpp's flash-attention kernel gives (it scales
by ``1/S`` only when ``S != 0``); llama.cpp's non-flash ``soft_max`` asserts
the sum is positive instead.  No NaN comes out of a hidden row.

**The key shift** (``shift_keys``): after ``seq_add`` / ``seq_div`` the table
reports each cell's pending position change (``KVCells.shifts()``); the stored
keys are rotated by it as llama.cpp's ``build_rope_shift`` does (in x's dtype,
rounded back to the storage dtype), rows with no shift untouched.  After
``seq_div`` the table's pending shift is ``p_new - p_old`` — how far the key's
position moved — where llama.cpp's ``llama_kv_cells::pos_div`` records
``p_old - p_new`` and so rotates the keys away from their new positions
(measured on a random layer: 3.3 off, against 2e-7 the right way round); the
tables fix it (docs/hybrid.md).

Every check happens before a cache row changes: a refused call changes nothing.
The softmax runs in ``x``'s dtype (float32 in a float32 model, as ggml's), the
row maximum subtracted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ArgumentError, ConfigError
from ._arrays import Array
from ._ssm import FEW_ROWS, linear, linear_rows, rms_norm
from ._storage import StateStorage

__all__ = ["ROPE_STYLES", "AttentionParams", "Rope", "apply_rope", "attention", "rope_cos_sin", "shift_keys"]

ROPE_STYLES = ("none", "normal", "neox")


@dataclass(frozen=True)
class Rope:
    """Rotary position embedding: llama.cpp's ``style`` ("none", "normal": adjacent pairs, "neox": halves) of the
    first ``n_rot`` values of each head, at frequency base ``freq_base`` and linear position scale ``freq_scale``."""

    style: str = "none"
    n_rot: int = 0
    freq_base: float = 10000.0
    freq_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.style not in ROPE_STYLES:
            raise ConfigError(f"rope style {self.style!r} is not one of {', '.join(ROPE_STYLES)}")
        if self.style == "none" and self.n_rot != 0:
            raise ConfigError(f"rope style 'none' rotates nothing, got n_rot {self.n_rot}")
        if self.style != "none" and (self.n_rot < 2 or self.n_rot % 2):
            raise ConfigError(f"n_rot must be even and >= 2 for rope style {self.style!r}, got {self.n_rot}")
        if not (math.isfinite(self.freq_base) and self.freq_base > 0):
            raise ConfigError(f"freq_base must be finite and > 0, got {self.freq_base}")
        if not (math.isfinite(self.freq_scale) and self.freq_scale > 0):
            raise ConfigError(f"freq_scale must be finite and > 0, got {self.freq_scale}")


@dataclass(frozen=True)
class AttentionParams:
    """The shape of one attention layer: ``n_head`` query heads over ``n_head_kv`` KV heads of ``head_dim`` values,
    its ``rope``, the score scale (``1/sqrt(head_dim)`` when ``None``), the per-head q / k norm's epsilon, and
    whether ``wq`` also gives an output gate (Qwen3-Next)."""

    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rope: Rope = Rope()
    scale: float | None = None
    norm_eps: float = 1e-6
    gated: bool = False

    def __post_init__(self) -> None:
        for name in ("n_embd", "n_head", "n_head_kv", "head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_head % self.n_head_kv:
            raise ConfigError(f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")
        if self.rope.n_rot > self.head_dim:
            raise ConfigError(f"n_rot {self.rope.n_rot} is larger than head_dim {self.head_dim}")

    @property
    def n_embd_k(self) -> int:
        """The width of a cell's key row: n_head_kv * head_dim (a value row is as wide)."""
        return self.n_head_kv * self.head_dim

    @property
    def kq_scale(self) -> float:
        """What the scores ``q @ k`` are multiplied by."""
        return 1.0 / math.sqrt(self.head_dim) if self.scale is None else self.scale


# -- RoPE --------------------------------------------------------------------------------------------


def rope_cos_sin(rope: Rope, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of each token's angles, [n_tokens, n_rot/2] float64 on the host: pair i of a token at ``p``
    turns by ``p * freq_scale * freq_base ** (-2i / n_rot)``."""
    freqs = rope.freq_base ** (-np.arange(0, rope.n_rot, 2, dtype=np.float64) / rope.n_rot)
    angles = (np.asarray(positions, dtype=np.float64) * rope.freq_scale)[:, None] * freqs
    return np.cos(angles), np.sin(angles)


def apply_rope(xp: Any, x: Array, cos: Array, sin: Array, rope: Rope) -> Array:
    """``x`` [n_tokens, n_heads, head_dim] with the first ``n_rot`` values of each head rotated by the angles
    whose ``cos`` / ``sin`` [n_tokens, 1, n_rot/2] are given (``rope_cos_sin``, as ``x``'s arrays)."""
    n_rot = rope.n_rot
    if rope.style == "neox":
        x0, x1 = x[..., :n_rot // 2], x[..., n_rot // 2:n_rot]
    else:
        x0, x1 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
    r0, r1 = x0 * cos - x1 * sin, x0 * sin + x1 * cos
    rotated = (xp.concat([r0, r1], axis=-1) if rope.style == "neox"
               else xp.reshape(xp.stack([r0, r1], axis=-1), (*x.shape[:-1], n_rot)))
    return rotated if n_rot == x.shape[-1] else xp.concat([rotated, x[..., n_rot:]], axis=-1)


def _rotated(xp: Any, x: Array, positions: np.ndarray, rope: Rope) -> Array:
    """``x`` [n_tokens, n_heads, head_dim] rotated to ``positions`` (host ints)."""
    if rope.style == "none":
        return x
    cos, sin = (xp.asarray(c[:, None, :], dtype=x.dtype, device=x.device) for c in rope_cos_sin(rope, positions))
    return apply_rope(xp, x, cos, sin, rope)


# -- the checks, all before a row changes --------------------------------------------------------------


def _host_ints(values: Any, name: str, length: int) -> np.ndarray:
    """``values`` as a host int64 array [length]; ``ArgumentError`` otherwise."""
    array = np.asarray(values)
    if array.ndim != 1 or array.shape[0] != length or (array.size and array.dtype.kind not in "iu"):
        raise ArgumentError(f"{name} must be {length} integers, got shape {array.shape} of {array.dtype}")
    return array.astype(np.int64)


def _check_caches(params: AttentionParams, k_cache: Array, v_cache: Array, v_trans: bool) -> int:
    """The caches' number of cells, after checking their shapes ([kv_size, n_embd_k]; V the same or transposed)."""
    width = params.n_embd_k
    if len(k_cache.shape) != 2 or k_cache.shape[1] != width:
        raise ArgumentError(f"k_cache has shape {tuple(k_cache.shape)}, expected (kv_size, {width})")
    kv_size = int(k_cache.shape[0])
    expected = (width, kv_size) if v_trans else (kv_size, width)
    if tuple(v_cache.shape) != expected:
        raise ArgumentError(f"v_cache has shape {tuple(v_cache.shape)}, expected {expected}"
                            f" ({'transposed' if v_trans else 'a row per cell'})")
    return kv_size


def _check_ubatch(params: AttentionParams, x: Array, positions: Any, cells: Any, mask: Any,
                  kv_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The ubatch's positions and cells as host ints, after checking ``x``, them and ``mask`` agree."""
    if len(x.shape) != 2 or x.shape[1] != params.n_embd:
        raise ArgumentError(f"x has shape {tuple(x.shape)}, expected (n_tokens, {params.n_embd})")
    n_tokens = int(x.shape[0])
    if n_tokens < 1:
        raise ArgumentError("a ubatch has at least one token, got none")
    pos = _host_ints(positions, "positions", n_tokens)
    slot = _host_ints(cells, "cells", n_tokens)
    outside = slot[(slot < 0) | (slot >= kv_size)]
    if outside.size:
        raise ArgumentError(f"cell {outside[0]} is outside the cache's {kv_size} cells")
    if np.unique(slot).size != n_tokens:
        raise ArgumentError(f"two tokens of the ubatch write one cell: cells {slot.tolist()}")
    if not isinstance(mask, np.ndarray) or mask.dtype != np.float32 or mask.ndim != 2:
        raise ArgumentError("the mask must be a 2-D float32 numpy array (KVCells.mask writes it)")
    if mask.shape[0] != n_tokens or not 1 <= mask.shape[1] <= kv_size:
        raise ArgumentError(f"the mask has shape {mask.shape}, expected ({n_tokens}, n_kv) with "
                            f"1 <= n_kv <= {kv_size}")
    return pos, slot


# -- the layer -----------------------------------------------------------------------------------------


def _projected(x: Array, w: dict[str, Array], weight: str, bias: str) -> Array:
    out = linear(x, w[weight])
    return out + w[bias] if bias in w else out


def _dense(xp: Any, a: Array) -> Array:
    """``a`` with C-contiguous memory (a copy only when it is not): the products below then take one path of
    the BLAS, whichever layout the values came from — the transposed and the row-per-cell V give the same bits."""
    return xp.reshape(xp.reshape(a, (-1,)), a.shape)


def _heads_product(xp: Any, a: Array, b: Array, n_tokens: int) -> Array:
    """``a @ b`` head by head, ``a`` [heads, M, K] and ``b`` [heads, K, N]: for a ubatch of up to ``FEW_ROWS``
    tokens in numpy, the compiled kernel (``_ssm.linear_rows``, in its threads: a forward of so few rows runs
    them, and BLAS's own threads, which its product of a few hundred cells wakes and which then spin on the
    same cores, would make every later pass wait: 8 sequences of a Qwen3-Next-like model at two threads, ~3x
    slower); otherwise the library's matmul."""
    if xp is not np or n_tokens > FEW_ROWS or a.dtype != b.dtype or a.dtype not in (np.float32, np.float64):
        return a @ b
    return np.stack([linear_rows(np.ascontiguousarray(a[h]), np.ascontiguousarray(b[h]).T)
                     for h in range(a.shape[0])])


def _softmax(xp: Any, scores: Array) -> Array:
    """Softmax over the last axis, the row maximum subtracted; a row of -inf only gives zeros, not NaN."""
    row_max = xp.max(scores, axis=-1, keepdims=True)
    weights = xp.exp(scores - xp.where(xp.isinf(row_max), xp.zeros_like(row_max), row_max))
    total = xp.sum(weights, axis=-1, keepdims=True)
    return weights / xp.where(total > 0, total, xp.ones_like(total))


def attention(xp: Any, w: dict[str, Array], x: Array, params: AttentionParams, positions: Any, cells: Any,
              mask: np.ndarray, k_cache: Array, v_cache: Array, storage_k: StateStorage, storage_v: StateStorage,
              v_trans: bool = False) -> Array:
    """One attention layer over one ubatch (see the module's docstring): ``x`` [n_tokens, n_embd] -> the layer's
    output [n_tokens, n_embd], in ``x``'s dtype.

    ``w`` holds ``wq`` [n_head*head_dim (x2 when gated), n_embd], ``wk`` / ``wv`` [n_embd_k, n_embd], ``wo``
    [n_embd, n_head*head_dim], and optionally the biases ``bq`` ``bk`` ``bv`` ``bo`` and the per-head norms'
    weights ``q_norm`` ``k_norm`` [head_dim].  Token t at ``positions[t]`` writes its key and value rows into
    cell ``cells[t]`` of ``k_cache`` [kv_size, n_embd_k] and ``v_cache`` ([kv_size, n_embd_k], or
    [n_embd_k, kv_size] when ``v_trans``: llama.cpp's layout without flash attention), rounded to their storage
    (``storage_k`` / ``storage_v``); then every token attends over cells [0, n_kv) through ``mask``
    [n_tokens, n_kv] (0 visible, -inf hidden).  ``ArgumentError`` before anything is written when the shapes,
    cells or mask do not agree.
    """
    kv_size = _check_caches(params, k_cache, v_cache, v_trans)
    pos, slot = _check_ubatch(params, x, positions, cells, mask, kv_size)
    n_tokens, n_kv = len(slot), mask.shape[1]
    n_head, n_head_kv, head_dim = params.n_head, params.n_head_kv, params.head_dim
    q = xp.reshape(_projected(x, w, "wq", "bq"), (n_tokens, n_head, -1))
    gate = xp.reshape(q[..., head_dim:], (n_tokens, n_head * head_dim)) if params.gated else None
    q = q[..., :head_dim]
    k = xp.reshape(_projected(x, w, "wk", "bk"), (n_tokens, n_head_kv, head_dim))
    v = _projected(x, w, "wv", "bv")
    if "q_norm" in w:
        q = rms_norm(xp, q, params.norm_eps) * w["q_norm"]
    if "k_norm" in w:
        k = rms_norm(xp, k, params.norm_eps) * w["k_norm"]
    q, k = _rotated(xp, q, pos, params.rope), _rotated(xp, k, pos, params.rope)

    rows = xp.asarray(slot, device=k_cache.device)
    k_cache[rows] = storage_k.encode(xp.reshape(k, (n_tokens, -1)))
    if v_trans:
        v_cache[:, rows] = xp.permute_dims(storage_v.encode(v), (1, 0))
    else:
        v_cache[rows] = storage_v.encode(v)

    # the cells as the cache holds them: [n_head_kv, n_kv, head_dim]
    keys = storage_k.decode(xp.reshape(k_cache[:n_kv], (n_kv, n_head_kv, head_dim)), x.dtype)
    keys = xp.permute_dims(keys, (1, 2, 0))                                        # [n_head_kv, head_dim, n_kv]
    if v_trans:
        values = xp.permute_dims(xp.reshape(v_cache[:, :n_kv], (n_head_kv, head_dim, n_kv)), (0, 2, 1))
    else:
        values = xp.permute_dims(xp.reshape(v_cache[:n_kv], (n_kv, n_head_kv, head_dim)), (1, 0, 2))
    values = _dense(xp, storage_v.decode(values, x.dtype))

    # query head h reads KV head h // group: the group's queries of every token as rows of one product
    group = n_head // n_head_kv
    queries = xp.reshape(xp.permute_dims(xp.reshape(q, (n_tokens, n_head_kv, group, head_dim)), (1, 2, 0, 3)),
                         (n_head_kv, group * n_tokens, head_dim))
    scores = (xp.reshape(_heads_product(xp, queries, keys, n_tokens), (n_head_kv, group, n_tokens, n_kv))
              * params.kq_scale)
    scores = scores + xp.asarray(mask, dtype=x.dtype, device=x.device)
    probs = xp.reshape(_softmax(xp, scores), (n_head_kv, group * n_tokens, n_kv))
    heads = xp.reshape(_heads_product(xp, probs, values, n_tokens), (n_head_kv, group, n_tokens, head_dim))
    out = xp.reshape(xp.permute_dims(heads, (2, 0, 1, 3)), (n_tokens, n_head * head_dim))
    if gate is not None:
        out = out / (1.0 + xp.exp(-gate))
    return _projected(out, w, "wo", "bo")


def shift_keys(xp: Any, k_cache: Array, shifts: Any, params: AttentionParams, storage_k: StateStorage,
               dtype: Any) -> None:
    """Rotate each cell's stored key by its pending position change (``KVCells.shifts()``, [kv_size] ints), in
    ``dtype`` and rounded back to the storage, as llama.cpp's ``build_rope_shift``; rows whose shift is 0 are
    not touched.  A layer without rope has nothing to rotate.  ``ArgumentError`` (nothing rotated) when the
    shapes disagree; the table's ``reset_shift()`` is the caller's, once every layer is rotated."""
    width = params.n_embd_k
    if len(k_cache.shape) != 2 or k_cache.shape[1] != width:
        raise ArgumentError(f"k_cache has shape {tuple(k_cache.shape)}, expected (kv_size, {width})")
    delta = _host_ints(shifts, "shifts", int(k_cache.shape[0]))
    moved = np.flatnonzero(delta)
    if params.rope.style == "none" or not moved.size:
        return
    rows = xp.asarray(moved, device=k_cache.device)
    keys = storage_k.decode(xp.reshape(k_cache[rows], (moved.size, params.n_head_kv, params.head_dim)), dtype)
    rotated = _rotated(xp, keys, delta[moved], params.rope)
    k_cache[rows] = storage_k.encode(xp.reshape(rotated, (moved.size, width)))
