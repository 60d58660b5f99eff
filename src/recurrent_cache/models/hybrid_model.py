"""Hybrid language models: attention layers beside recurrent layers, over one ``HybridCache``.

A hybrid family (``jamba.py``, ...) subclasses ``HybridModel`` and writes only its ``block``: one
layer's math on the residual stream ``x`` [n_seqs, n_tokens, n_embd], through a ``LayerRun`` that
gives the layer what it reads from the memory::

    def block(self, run, il, w, x):
        u = rms_norm(run.xp, x, eps) * w["attn_norm"]
        x = x + (run.attention(il, w, u, params) if il in attn_layers else run.recurrent(il, mixer, w, u))
        return x + mlp(run.xp, w, rms_norm(run.xp, x, eps) * w["ffn_norm"])

``run.attention`` writes the ubatch's keys and values into layer ``il``'s K / V rows at the KV
table's cells and attends through its mask (``_attention.attention``); ``run.recurrent`` hands a
recurrent mixer the layer's conv and state rows (decoded to the compute dtype, flat:
``[n_seqs, n_embd_r]`` and ``[n_seqs, n_embd_s]``) and keeps what it returns — the states after the
last token and, with rollback, after each earlier one — to write back once every layer has run.  A
layer may call both (Falcon-H1) or neither (Nemotron-H's MLP layers).  The hyper-parameters say which
layers hold which state (``attn_layers``, ``recr_layers``): ``new_cache`` builds the ``HybridCache``
from them.

The token order is the ubatch's: ``n_seqs`` groups of ``n_tokens`` tokens (the recurrent half's
equal split, ``memory_state.Ubatch``), so a recurrent mixer sees each sequence's tokens along axis
1 and attention sees the same tokens flattened, at their positions and KV cells.

One math for numpy and torch (``_arrays``), as the recurrent models: where the cache keeps its rows
decides the backend.  A refused input (a token outside the vocabulary, a cache of another shape) is
refused before any row is written; recurrent rows are written once every layer has run.  K / V rows
are written by each attention layer as it runs (its cells are already the ubatch's once ``apply``
placed it), so an error in a later layer leaves them holding this ubatch's keys: the cells hold
this ubatch's positions either way.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from ..errors import ModelError, OutOfRangeError, RecurrentCacheError
from ..memory_state import MemoryStatus
from ..storage import Storage
from ._arrays import Array, Backend, ModelWeights
from ._attention import AttentionParams, attention, shift_keys
from ._ssm import kernel_threads_for
from ._storage import StateStorage, StateUndo
from .language_model import LanguageModel, LanguageShape, backend_of, checked_tensor
from .vocab import Vocabulary

if TYPE_CHECKING:
    from ..hybrid import HybridCache

__all__ = ["FlatMixer", "HybridModel", "HybridReferenceRun", "HybridShape", "LayerRun", "flat_mixer"]

# A recurrent mixer on flat state rows: (xp, w, u [n_seqs, n_tokens, n_embd], conv [n_seqs, n_embd_r],
# ssm [n_seqs, n_embd_s], storage_r, storage_s, m) -> (out, conv after, ssm after, step states or None),
# the step states ([n_seqs, m, n_embd_r], [n_seqs, m, n_embd_s]) after tokens n_tokens-1-m .. n_tokens-2.
FlatMixer = Callable[..., tuple[Array, Array, Array, "tuple[Array, Array] | None"]]


class HybridShape(LanguageShape, Protocol):
    """What a hybrid model's hyper-parameters provide besides ``LanguageShape``: which layers hold which
    memory, and its widths."""

    @property
    def attn_layers(self) -> tuple[int, ...]: ...
    @property
    def recr_layers(self) -> tuple[int, ...]: ...
    @property
    def attention(self) -> AttentionParams | None: ...
    @property
    def n_embd_r(self) -> int: ...
    @property
    def n_embd_s(self) -> int: ...


def flat_mixer(mixer: Callable[..., Any], conv_shape: tuple[int, ...], ssm_shape: tuple[int, ...]) -> FlatMixer:
    """A mixer written on shaped states (``mamba.mamba_mixer``: conv [n_seqs, *conv_shape], ssm
    [n_seqs, *ssm_shape]) as a ``FlatMixer``; ``mixer`` takes ``(xp, w, u, conv, ssm, storage_r, storage_s, m)``."""
    def flat(xp: Any, w: dict[str, Array], u: Array, conv: Array, ssm: Array, storage_r: StateStorage,
             storage_s: StateStorage, m: int) -> tuple[Array, Array, Array, tuple[Array, Array] | None]:
        n_seqs = u.shape[0]
        out, conv, ssm, steps = mixer(xp, w, u, xp.reshape(conv, (n_seqs, *conv_shape)),
                                      xp.reshape(ssm, (n_seqs, *ssm_shape)), storage_r, storage_s, m)
        if steps is not None:
            steps = (xp.reshape(steps[0], (n_seqs, m, -1)), xp.reshape(steps[1], (n_seqs, m, -1)))
        return out, xp.reshape(conv, (n_seqs, -1)), xp.reshape(ssm, (n_seqs, -1)), steps
    return flat


class LayerRun:
    """One ubatch's run through the layers: what a family's ``block`` reads of the memory
    (``attention``, ``recurrent``), the namespace ``xp`` and the compute dtype."""

    def __init__(self, model: HybridModel, st: Any, backend: Backend, device: Any) -> None:
        self.xp = backend.xp
        self.dtype = backend.compute_dtype(model)
        self._st = st
        self._backend = backend
        self._device = device
        ub = st.ubatch
        self.n_seqs, self.n_tokens = ub.n_seqs, ub.n_seq_tokens
        self._positions = ub.pos
        self._m = 0
        self._v_trans = bool(st.v_trans) if model.hparams.attn_layers else False
        self._states: dict[int, tuple[Array, Array, tuple[Array, Array] | None]] = {}
        # the states a one-token step updated in their rows: put back if any layer fails (``forward_ubatch``)
        self.undo = StateUndo()
        recr = model.hparams.recr_layers
        if recr:
            self._m = int(st.r_steps(recr[0]).shape[1])

    def attention(self, il: int, w: dict[str, Array], u: Array, params: AttentionParams,
                  sliding: bool = False) -> Array:
        """Layer ``il``'s attention on ``u`` [n_seqs, n_tokens, n_embd] (``_attention.attention`` over the
        layer's K / V rows, the ubatch's cells and mask; ``sliding``: the sliding-window mask)."""
        xp = self.xp
        k_cache, v_cache = self._st.k(il), self._st.v(il)
        flat = xp.reshape(u, (self.n_seqs * self.n_tokens, u.shape[-1]))
        out = attention(xp, w, flat, params, self._positions, self._st.kv_cells, self._st.kv_mask(sliding),
                        k_cache, v_cache, self._backend.storage(k_cache), self._backend.storage(v_cache),
                        self._v_trans)
        return xp.reshape(out, u.shape)

    def recurrent(self, il: int, mixer: FlatMixer, w: dict[str, Array], u: Array) -> Array:
        """Layer ``il``'s recurrent ``mixer`` on ``u`` from the layer's rows; its states are kept to be written
        back once every layer has run (``write_states``).  Returns the mixer's output."""
        if il in self._states:
            raise ModelError(f"layer {il}'s recurrent state is updated twice in one ubatch")
        r_rows, s_rows = self._st.r(il), self._st.s(il)
        storage_r, storage_s = self._backend.storage(r_rows), self._backend.storage(s_rows).with_undo(self.undo)
        out, conv, ssm, steps = mixer(self.xp, w, u, storage_r.decode(r_rows, self.dtype),
                                      storage_s.decode(s_rows, self.dtype), storage_r, storage_s, self._m)
        self._states[il] = (conv, ssm, steps)
        result: Array = out
        return result

    def write_states(self) -> None:
        """Every recurrent layer's new states into its rows (and step states, with rollback)."""
        st = self._st
        for il, (conv, ssm, steps) in self._states.items():
            r_rows, s_rows = st.r(il), st.s(il)
            storage_r, storage_s = self._backend.storage(r_rows), self._backend.storage(s_rows)
            storage_r.write(r_rows, conv)
            storage_s.write(s_rows, ssm)
            if self._m and steps is not None:
                storage_r.write(st.r_steps(il), steps[0])
                storage_s.write(st.s_steps(il), steps[1])


class HybridModel(LanguageModel):
    """A language model of attention and recurrent layers over a ``HybridCache``.

    ``layers`` holds each layer's weights by field name (``layer_shapes(il)`` says which fields layer
    ``il`` has and their shapes; ``products()`` the weights kept in ``_ssm.linear``'s layout, 2-D or a
    mixture's stack of experts).
    Subclasses define ``layer_shapes``, ``products`` and ``block``.
    """

    hparams: HybridShape
    layers: list[dict[str, np.ndarray]]

    def __init__(self, hparams: HybridShape, token_embd: Any, layers: Sequence[Mapping[str, Any]], output_norm: Any,
                 output: Any = None, dtype: Any = np.float64, vocab: Vocabulary | None = None) -> None:
        super().__init__(hparams, token_embd, output_norm, output, dtype, vocab)
        if len(layers) != hparams.n_layer:
            raise ModelError(f"{len(layers)} layers for a model of n_layer = {hparams.n_layer}")
        products = self.products()
        checked = []
        for il, layer in enumerate(layers):
            shapes = self.layer_shapes(il)
            unknown = sorted(set(layer) - set(shapes))
            missing = sorted(set(shapes) - set(layer))
            if unknown or missing:
                raise ModelError(f"layer {il}: " + "; ".join(
                    ([f"unexpected tensors {', '.join(unknown)}"] if unknown else [])
                    + ([f"missing tensors {', '.join(missing)}"] if missing else [])))
            checked.append({name: checked_tensor(layer[name], shape, f"blk.{il}.{name}", self.dtype,
                                                 product=name in products and len(shape) >= 2)
                            for name, shape in shapes.items()})
        self.layers = checked

    @abstractmethod
    def layer_shapes(self, il: int) -> dict[str, tuple[int, ...]]:
        """Layer ``il``'s weight fields and their shapes."""

    @abstractmethod
    def products(self) -> frozenset[str]:
        """The fields ``_ssm.linear`` multiplies by (kept as ``[in, out]`` rows; ``[n, in, out]`` for experts)."""

    @abstractmethod
    def block(self, run: LayerRun, il: int, w: dict[str, Array], x: Array) -> Array:
        """Layer ``il`` on the residual stream ``x`` [n_seqs, n_tokens, n_embd]: the new ``x``."""

    # -- the memory ---------------------------------------------------------------------------

    def new_cache(self, n_seq_max: int = 1, *, dtype: str = "f32", n_rollback: int = 0,
                  engine: Literal["compiled", "reference"] | None = None, storage: str | Storage = "numpy",
                  device: Any = None, kv_size: int = 4096, dtype_kv: str | None = None, v_trans: bool = True,
                  kv_pad: int | None = None) -> HybridCache:
        """A ``HybridCache`` for this model: ``n_seq_max`` sequences, ``kv_size`` KV cells (tokens, over all
        sequences), recurrent states as ``dtype``, K / V rows as ``dtype_kv`` (``dtype`` when None; llama.cpp's
        default is "f16"), V transposed (``v_trans``, llama.cpp's layout without flash attention) or not,
        ``kv_pad`` (llama.cpp's 256 when None); the rest as ``RecurrentCache``."""
        from ..hybrid import HybridCache

        p = self.hparams
        params = p.attention
        n_embd_kv = params.n_embd_k if params is not None else 1
        options: dict[str, Any] = {} if kv_pad is None else {"kv_pad": kv_pad}
        return HybridCache(p.n_layer, attn_layers=p.attn_layers, recr_layers=p.recr_layers, n_embd_k=n_embd_kv,
                           n_embd_v=n_embd_kv, n_embd_r=p.n_embd_r, n_embd_s=p.n_embd_s, kv_size=kv_size,
                           n_seq_max=n_seq_max, dtype_k=dtype_kv or dtype, dtype_v=dtype_kv or dtype, dtype_r=dtype,
                           dtype_s=dtype, v_trans=v_trans, n_rollback=n_rollback, engine=engine, storage=storage,
                           device=device, **options)

    def reference_run(self, dtype: str = "f32") -> HybridReferenceRun:
        """``HybridReferenceRun``: the sequence alone on its own memory, one token per ubatch."""
        return HybridReferenceRun(self, dtype)

    def shift_keys(self, cache: HybridCache) -> None:
        """Rotate every attention layer's stored keys by the cache's pending shifts (after ``seq_add`` /
        ``seq_div``), then clear them (llama.cpp's K-shift before the next decode)."""
        params = self.hparams.attention
        if not cache.kv_has_shift:
            return
        if params is not None:
            shifts = cache.kv_shifts()
            for il in self.hparams.attn_layers:
                backend, _ = backend_of(cache.k[il])
                with backend.computing():
                    shift_keys(backend.xp, cache.k[il], shifts, params, backend.storage(cache.k[il]),
                               backend.compute_dtype(self))
        cache.kv_reset_shift()

    # -- running on the memory ------------------------------------------------------------------

    def forward_ubatch(self, st: Any) -> Any:
        """Run the ubatch that ``st`` (a ``HybridState``) has just applied: every layer's ``block``, the
        recurrent states written back, the logits of the ubatch's output tokens in ubatch order
        ``[n_outputs, n_vocab]`` (a numpy array, or a torch tensor on the rows' device)."""
        p = self.hparams
        probe = self._probe_rows(st)
        backend, device = backend_of(probe)
        ub = st.ubatch
        with backend.computing(), kernel_threads_for(ub.n_tokens):
            weights: ModelWeights = backend.weights(self, device)
            x = self.embedded(backend, weights, device, ub.token, ub.embd)
            x = backend.xp.reshape(x, (ub.n_seqs, ub.n_seq_tokens, p.n_embd))
            run = LayerRun(self, st, backend, device)
            with run.undo:
                for il, w in enumerate(weights.layers):
                    x = self.block(run, il, w, x)
            run.write_states()
            outputs = backend.from_host(np.flatnonzero(ub.output), device)
            return self.head(backend.xp, weights, backend.xp.take(backend.xp.reshape(x, (ub.n_tokens, p.n_embd)),
                                                                  outputs, axis=0))

    def state_samples(self, st: Any) -> list[Any]:
        """``LanguageModel.state_samples``: the first recurrent layer's r and s rows, the first attention layer's
        K and V rows (none when ``st`` cannot give them: the forward then raises what is wrong)."""
        p = self.hparams
        try:
            recurrent = [st.r(p.recr_layers[0]), st.s(p.recr_layers[0])] if p.recr_layers else []
            return recurrent + ([st.k(p.attn_layers[0]), st.v(p.attn_layers[0])] if p.attn_layers else [])
        except (RecurrentCacheError, AttributeError):
            return []

    def _probe_rows(self, st: Any) -> Any:
        """A state tensor of ``st`` (its library and device decide the backend), after checking that the
        cache is shaped for this model."""
        p = self.hparams
        try:
            if p.recr_layers:
                r_rows, s_rows = st.r(p.recr_layers[0]), st.s(p.recr_layers[0])
                if r_rows.shape[1] != p.n_embd_r or s_rows.shape[1] != p.n_embd_s:
                    raise ModelError(f"the cache's recurrent rows are {r_rows.shape[1]} / {s_rows.shape[1]} wide; "
                                     f"this model needs {p.n_embd_r} / {p.n_embd_s} (use model.new_cache())")
            if p.attn_layers:
                k = st.k(p.attn_layers[0])
                width = p.attention.n_embd_k if p.attention is not None else 0
                if k.shape[1] != width:
                    raise ModelError(f"the cache's K rows are {k.shape[1]} wide; this model needs {width} "
                                     "(use model.new_cache())")
                return k
            return r_rows
        except (IndexError, OutOfRangeError, AttributeError):
            raise ModelError(f"the cache does not hold this model's layers (attention {p.attn_layers}, "
                             f"recurrent {p.recr_layers}): use model.new_cache()") from None


class HybridReferenceRun:
    """One sequence of a hybrid model alone, one token at a time, on a memory of its own (``dtype``
    states and K / V rows): what every batched run must equal.  A hybrid model's attention needs the
    KV rows of every earlier token, so unlike ``ReferenceRun`` the run keeps a ``HybridCache`` of one
    sequence; it shares nothing with the batched run but the model's math."""

    def __init__(self, model: HybridModel, dtype: str = "f32", kv_size: int = 4096) -> None:
        self.model, self.dtype, self.kv_size = model, dtype, kv_size
        self.cache = model.new_cache(1, dtype=dtype, kv_size=kv_size)
        self.n_past = 0

    def feed(self, tokens: Sequence[int]) -> np.ndarray:
        """Run ``tokens`` in order, each its own batch; the logits after each one, ``[len(tokens), n_vocab]``."""
        from ..batch import Batch

        logits = []
        for token in tokens:
            st = self.cache.init_batch(Batch(token=[int(token)], seq_id=[0], pos=[self.n_past], logits=[1]))
            if st.status != MemoryStatus.SUCCESS:
                raise ModelError(f"the reference run's memory of {self.kv_size} KV cells is full")
            logits.append(np.asarray(self.model.forward(st)))
            self.n_past += 1
        return np.concatenate(logits) if logits else np.zeros((0, self.model.hparams.n_vocab), self.model.dtype)

    def copy(self) -> HybridReferenceRun:
        """An independent run from this one's current state (a fork)."""
        twin = HybridReferenceRun(self.model, self.dtype, self.kv_size)
        twin.cache.state_read(self.cache.state_write())
        twin.n_past = self.n_past
        return twin
