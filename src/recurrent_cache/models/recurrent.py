"""What every recurrent language model here shares: embedding, RMSNorm, the per-layer
residual, the output head, and the run over the cache (ubatches, state rows, step states).

A model architecture (Mamba-1 in ``mamba.py``, Mamba-2 in ``mamba2.py``)
subclasses ``RecurrentModel``, supplies only its mixer — one block's math on
``[n_seqs, n_tokens, n_embd]`` inputs, written once on an array namespace
``xp`` with the shared pieces of ``_ssm.py`` (numpy, or torch where the cache
keeps torch rows: ``_arrays.py``) — and registers itself (``_registry.py``).
Both keep their states in llama.cpp's layout:

* r row (n_embd_r = (d_conv-1) * conv_channels): the last d_conv-1 inputs of
  each conv channel, channel-major, oldest first: ``r[ch*(d_conv-1) + t]``;
* s row (n_embd_s = d_state * d_inner): ``h[ch, n]`` at ``s[ch*d_state + n]``
  (for Mamba-2, ``ch = head*head_dim + p``, as ggml's ``{d_state, head_dim, n_head}``).

Precision: weights and activations are in the model's ``dtype`` (float64 by
default).  The recurrent state is rounded to the cache's storage type (f32,
f16, bf16) after every token, not only where a ubatch ends as llama.cpp does,
so a sequence's result does not depend on how its tokens were split into
ubatches: a batched run equals a solo run even with f16 states.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, overload

import numpy as np

from .. import _args
from ..errors import ModelError, RecurrentCacheError
from ..storage import Storage
from ._arrays import NUMPY, Array, ModelWeights
from ._ssm import kernel_threads_for, rms_norm
from ._storage import StateStorage, StateUndo
from .language_model import LanguageModel, backend_of, checked_tensor

if TYPE_CHECKING:
    import torch

    from ..cache import RecurrentCache

__all__ = ["HostRows", "MixerResult", "ModelShape", "RecurrentModel", "ReferenceRun", "StepStates", "TorchRows",
           "check_sizes", "checked_layers", "checked_tensor"]


# Per layer, the states after a ubatch's last m-1 .. 1 tokens: (conv [n_seqs, m, ...], ssm [n_seqs, m, ...]).
StepStates = list[tuple[Array, Array]]

# What a mixer returns: its output to add to the residual, the conv and SSM states after the last token,
# and (m > 0) the states after the earlier ones.
MixerResult = tuple[Array, Array, Array, "tuple[Array, Array] | None"]


class ModelShape(Protocol):
    """The sizes every architecture's hyper-parameters provide (the cache's shape follows from them)."""

    @property
    def n_vocab(self) -> int: ...
    @property
    def n_embd(self) -> int: ...
    @property
    def n_layer(self) -> int: ...
    @property
    def d_conv(self) -> int: ...
    @property
    def d_inner(self) -> int: ...
    @property
    def d_state(self) -> int: ...
    @property
    def rms_eps(self) -> float: ...
    @property
    def conv_channels(self) -> int: ...
    @property
    def n_embd_r(self) -> int: ...
    @property
    def n_embd_s(self) -> int: ...
    def describe(self) -> str: ...


class HostRows(Protocol):
    """A batch state whose state rows are numpy arrays (a cache with numpy storage): the numpy forward."""

    def r(self, il: int) -> np.ndarray: ...


class TorchRows(Protocol):
    """A batch state whose state rows are torch tensors (a cache with torch storage): the torch forward."""

    def r(self, il: int) -> torch.Tensor: ...


Layer = TypeVar("Layer")


def check_sizes(hparams: Any, names: Sequence[str]) -> None:
    """``hparams``' sizes ``names`` positive integers (``d_conv`` at least 2) and ``rms_eps`` positive, or
    ``ModelError`` naming the bad one."""
    for name in names:
        # d_conv = 1 would leave no rolling state: the cache needs rows of width >= 1
        minimum = 2 if name == "d_conv" else 1
        _args.count(getattr(hparams, name), f"hyper-parameter {name}", minimum, ModelError, int32_only=False)
    if not hparams.rms_eps > 0:
        raise ModelError(f"rms_eps must be positive, got {hparams.rms_eps!r}")


def checked_layers(layers: Sequence[Any], n_layer: int, make: Callable[..., Layer], tensors: dict[str, str],
                   shapes: dict[str, tuple[int, ...]], dtype: np.dtype[Any],
                   products: frozenset[str] = frozenset()) -> list[Layer]:
    """``n_layer`` layers built by ``make`` from ``layers``' weights (attribute -> GGUF tensor name in
    ``tensors``), each checked by ``checked_tensor`` as ``blk.{il}.{tensor}``; ``ModelError`` otherwise.
    The weights named in ``products`` (those ``_ssm.linear`` multiplies by) are kept in its layout."""
    if len(layers) != n_layer:
        raise ModelError(f"{len(layers)} layers for a model of n_layer = {n_layer}")
    return [make(**{name: checked_tensor(getattr(layer, name), shapes[name], f"blk.{il}.{tensor}", dtype,
                                         product=name in products)
                    for name, tensor in tensors.items()})
            for il, layer in enumerate(layers)]


class RecurrentModel(LanguageModel):
    """A language model of recurrent layers on a ``RecurrentCache``: its layers, and the forward pass over
    the cache's state rows.  Subclasses set ``self.layers`` (objects with an ``attn_norm`` weight) and
    define ``mixer``."""

    hparams: ModelShape
    layers: list[Any]

    def new_cache(self, n_seq_max: int = 1, size: int | None = None, dtype: str = "f32", n_rollback: int = 0,
                  engine: Literal["compiled", "reference"] | None = None, storage: str | Storage = "numpy",
                  device: Any = None) -> RecurrentCache:
        """A ``RecurrentCache`` shaped for this model, with ``dtype`` states ("f32", "f16", "bf16");
        ``n_rollback`` past states per cell for speculative decoding (the model writes them);
        ``storage`` / ``device`` as ``RecurrentCache`` takes them (``forward`` then runs on that device)."""
        from .. import RecurrentCache

        p = self.hparams
        return RecurrentCache(p.n_layer, p.n_embd_r, p.n_embd_s, n_seq_max=n_seq_max, size=size,
                              dtype_r=dtype, dtype_s=dtype, n_rollback=n_rollback, engine=engine,
                              storage=storage, device=device)

    # -- running on the cache ---------------------------------------------------

    @overload
    def forward(self, st: HostRows, *, native: bool = False) -> np.ndarray: ...
    @overload
    def forward(self, st: TorchRows, *, native: bool = False) -> torch.Tensor: ...

    def forward(self, st: Any, *, native: bool = False) -> np.ndarray | torch.Tensor:
        """``LanguageModel.forward``: numpy rows give a numpy array, torch rows a tensor on their device."""
        logits: np.ndarray | torch.Tensor = super().forward(st, native=native)
        return logits

    def reference_run(self, dtype: str = "f32") -> ReferenceRun:
        """``ReferenceRun``: no cache, one token at a time, states rounded to ``dtype``."""
        return ReferenceRun(self, dtype, dtype)

    @overload
    def forward_ubatch(self, st: HostRows) -> np.ndarray: ...
    @overload
    def forward_ubatch(self, st: TorchRows) -> torch.Tensor: ...

    def forward_ubatch(self, st: Any) -> np.ndarray | torch.Tensor:
        """Run the ubatch that ``st`` has just applied, updating its state rows in place.

        Group ``s`` starts from rows ``st.r(il)[s]`` / ``st.s(il)[s]`` and its
        final states are written back there; with a cache that keeps a rollback
        history (``n_rollback > 0``) the states after the group's earlier tokens
        go into ``st.r_steps(il)`` / ``st.s_steps(il)`` (docs/rollback.md).  Returns the
        logits of the ubatch's output tokens in ubatch order, ``[n_outputs, n_vocab]``:
        a numpy array, or a torch tensor on the rows' device when the rows are torch
        tensors (``forward``).  One math serves both (``_ssm.py``, the architecture's
        ``mixer``); the rows' library decides the backend (``_arrays.py``, ``torch_forward.py``).
        """
        r_rows, s_rows = self.state_rows(st)
        backend, device = backend_of(r_rows[0])
        undo = StateUndo()   # a one-token step updates its rows in place: undone if anything fails
        storage_r, storage_s = backend.storage(r_rows[0]), backend.storage(s_rows[0]).with_undo(undo)
        xp = backend.xp
        p = self.hparams
        ub = st.ubatch
        n_seqs = ub.n_seqs
        m = st.r_steps(0).shape[1] if p.n_layer else 0   # step states the cache keeps per group
        with backend.computing(), kernel_threads_for(ub.n_tokens):
            weights = backend.weights(self, device)
            # the input is checked before any state is read or written: a bad token leaves the cache as it was
            x = self.embedded(backend, weights, device, ub.token, ub.embd).reshape((n_seqs, ub.n_seq_tokens, p.n_embd))
            dtype = backend.compute_dtype(self)
            conv = [storage_r.decode(rows, dtype).reshape((n_seqs, p.conv_channels, p.d_conv - 1)) for rows in r_rows]
            ssm = [storage_s.decode(rows, dtype).reshape((n_seqs, p.d_inner, p.d_state)) for rows in s_rows]
            steps: StepStates = []
            with undo:
                x = self.run_layers(xp, weights, x, conv, ssm, storage_r, storage_s, m, steps)

            # written once every layer has run (or stepped in place, undone on failure), so that an error in any
            # layer leaves every row as it was
            for il in range(p.n_layer):
                storage_r.write(r_rows[il], conv[il].reshape((n_seqs, p.n_embd_r)))
                storage_s.write(s_rows[il], ssm[il].reshape((n_seqs, p.n_embd_s)))
                if m:
                    storage_r.write(st.r_steps(il), steps[il][0].reshape((n_seqs, m, p.n_embd_r)))
                    storage_s.write(st.s_steps(il), steps[il][1].reshape((n_seqs, m, p.n_embd_s)))
            outputs = backend.from_host(np.flatnonzero(ub.output), device)
            logits: np.ndarray | torch.Tensor = self.head(xp, weights, xp.take(x.reshape((ub.n_tokens, p.n_embd)),
                                                                                outputs, axis=0))
            return logits

    def state_samples(self, st: Any) -> list[Any]:
        """``LanguageModel.state_samples``: layer 0's r and s rows (none when ``st`` cannot give them: the forward
        then raises what is wrong)."""
        if not self.hparams.n_layer:
            return []
        try:
            return [st.r(0), st.s(0)]
        except (RecurrentCacheError, AttributeError):
            return []

    def state_rows(self, st: Any) -> tuple[list[Any], list[Any]]:
        """The r and s rows of every layer for ``st``'s applied ubatch (numpy arrays or torch tensors),
        or ``ModelError`` when the cache is not shaped for this model."""
        p = self.hparams
        try:
            r_rows = [st.r(il) for il in range(p.n_layer)]
            s_rows = [st.s(il) for il in range(p.n_layer)]
        except IndexError:
            raise ModelError(f"the cache has fewer than the model's {p.n_layer} layers "
                             "(use model.new_cache())") from None
        if r_rows[0].shape[1] != p.n_embd_r or s_rows[0].shape[1] != p.n_embd_s:
            raise ModelError(f"the cache rows are {r_rows[0].shape[1]} / {s_rows[0].shape[1]} wide; "
                             f"this model needs {p.n_embd_r} / {p.n_embd_s} (use model.new_cache())")
        return r_rows, s_rows

    # -- the layers ---------------------------------------------------------------

    def zero_states(self, n_seqs: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Fresh conv and SSM states of every layer for ``n_seqs`` sequences (what ``run_layers`` updates)."""
        p = self.hparams
        conv = [np.zeros((n_seqs, p.conv_channels, p.d_conv - 1), self.dtype) for _ in range(p.n_layer)]
        ssm = [np.zeros((n_seqs, p.d_inner, p.d_state), self.dtype) for _ in range(p.n_layer)]
        return conv, ssm

    def run_layers(self, xp: Any, weights: ModelWeights, x: Array, conv: list[Array], ssm: list[Array],
                   storage_r: StateStorage, storage_s: StateStorage, m: int = 0,
                   steps: StepStates | None = None) -> Array:
        """All layers on ``x`` [n_seqs, n_tokens, n_embd]; ``conv`` / ``ssm`` (lists, one state per layer)
        are left holding the states after the last token.

        With ``m > 0`` each layer's states after tokens n_tokens-1-m .. n_tokens-2 are appended
        to ``steps`` as (conv [n_seqs, m, conv_channels, d_conv-1], ssm [n_seqs, m, d_inner, d_state]).
        """
        eps = self.hparams.rms_eps
        for il, layer in enumerate(weights.layers):
            out, conv[il], ssm[il], layer_steps = self.mixer(xp, layer, rms_norm(xp, x, eps) * layer["attn_norm"],
                                                             conv[il], ssm[il], storage_r, storage_s, m)
            x = x + out
            if layer_steps is not None and steps is not None:
                steps.append(layer_steps)
        return x

    @abstractmethod
    def mixer(self, xp: Any, w: dict[str, Array], u: Array, conv: Array, ssm: Array,
              storage_r: StateStorage, storage_s: StateStorage, m: int) -> MixerResult:
        """One block on ``u`` [n_seqs, n_tokens, n_embd] (already normed), in namespace ``xp`` with the
        layer's weights ``w`` (by field name).

        conv [n_seqs, conv_channels, d_conv-1] and ssm [n_seqs, d_inner, d_state]
        hold the states before the first token.  Returns the output to add to the
        residual, the states after the last token, and with ``m > 0`` the states
        after tokens n_tokens-1-m .. n_tokens-2 ((conv, ssm) with an axis of m
        after the first), else None.
        """

class ReferenceRun:
    """One sequence, one token at a time, with its own state and no cache.

    What every batched run through the cache must equal: it shares the
    per-token math with ``RecurrentModel.forward_ubatch`` but none of the cache
    plumbing (rows, splits, copy plans).  ``dtype_r`` / ``dtype_s`` are the
    cache storage types to mirror ("f32", "f16", "bf16").
    """

    def __init__(self, model: RecurrentModel, dtype_r: str = "f32", dtype_s: str = "f32") -> None:
        self.model = model
        self.dtype_r, self.dtype_s = dtype_r, dtype_s
        self.storage_r = StateStorage.named(dtype_r)
        self.storage_s = StateStorage.named(dtype_s)
        self.conv, self.ssm = model.zero_states(1)

    def feed(self, tokens: Sequence[int]) -> np.ndarray:
        """Run ``tokens`` in order; the logits after each one, ``[len(tokens), n_vocab]``."""
        model = self.model
        logits = []
        with NUMPY.computing():
            weights = NUMPY.weights(model)
            for token in tokens:
                x = model.embedded(NUMPY, weights, None, np.array([token]), None).reshape((1, 1, -1))
                x = model.run_layers(np, weights, x, self.conv, self.ssm, self.storage_r, self.storage_s)
                logits.append(model.head(np, weights, x[0]))
        return np.concatenate(logits)

    def copy(self) -> ReferenceRun:
        """An independent run from this one's current state (a fork)."""
        twin = ReferenceRun(self.model, self.dtype_r, self.dtype_s)
        twin.conv = [a.copy() for a in self.conv]
        twin.ssm = [a.copy() for a in self.ssm]
        return twin
