"""``HybridState``: the ubatches of one ``HybridCache.init_batch``, applied one at a time to both halves
of the hybrid memory, and the KV half's plan of them (``KvPlan``: the compiled ``_hybrid_step.KvPlan``, or
``TokenPlan`` through the KV table's Python interface)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from . import _args, _engines
from ._args import as_flag
from .errors import OutOfRangeError, UsageError
from .memory_state import MemoryState, MemoryStatus, Ubatch, each_ubatch
from .storage import Tensor

__all__ = ["Guard", "HybridMemory", "HybridState", "KvPlan", "KvTokens", "TokenPlan", "kv_tokens", "seq_lists"]


class HybridMemory(Protocol):
    """What a ``HybridState`` reads of its ``HybridCache`` (which constructs it)."""

    @property
    def generation(self) -> int: ...
    @property
    def attn_layers(self) -> tuple[int, ...]: ...
    @property
    def v_trans(self) -> bool: ...
    @property
    def k(self) -> tuple[Any, ...]: ...
    @property
    def v(self) -> tuple[Any, ...]: ...


class Guard(Protocol):
    """One thread at a time inside a hybrid memory: ``memory_state.ThreadGuard``, or the compiled
    engine's ``_hybrid_step.StepGuard``."""

    def enter(self) -> None: ...
    def leave(self) -> None: ...


KvTokens = tuple[np.ndarray, np.ndarray, np.ndarray]


class KvPlan(Protocol):
    """The KV half of one ``init_batch``: each ubatch's tokens and cells (``_hybrid_step.KvPlan`` on the
    compiled engine, ``TokenPlan`` on the reference)."""

    def apply(self, u: int, pad: int) -> int: ...
    def cells(self, u: int) -> np.ndarray: ...
    def tokens(self, u: int) -> KvTokens: ...


class TokenPlan:
    """``KvPlan`` from the recurrent half's ubatches (``MemoryState.planned``) as numpy arrays, through
    the KV table's Python interface: the reference engine's, and a model without attention layers
    (whose table is never touched)."""

    __slots__ = ("_table", "_tokens", "_slots", "_attend")

    def __init__(self, table: _engines.KVTable, tokens: list[KvTokens], slots: list[np.ndarray],
                 attend: bool) -> None:
        self._table = table
        self._tokens = tokens
        self._slots = slots
        self._attend = attend

    @classmethod
    def prepare(cls, table: _engines.KVTable, recurrent: MemoryState, attend: bool) -> TokenPlan | None:
        tokens = [kv_tokens(recurrent.planned(u)) for u in range(recurrent.n_ubatches)]
        slots = table.prepare(tokens) if attend else [np.empty(0, dtype=np.int32) for _ in tokens]
        return None if slots is None else cls(table, tokens, slots, attend)

    def apply(self, u: int, pad: int) -> int:
        if self._attend:
            self._table.apply_arrays(self._slots[u], *self._tokens[u])
        return self._table.n_kv(pad)

    def cells(self, u: int) -> np.ndarray:
        return self._slots[u]

    def tokens(self, u: int) -> KvTokens:
        return self._tokens[u]


def kv_tokens(ubatch: Ubatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A ubatch's tokens for the KV table: positions, every token's seq ids back to back (each token
    lists its group's), and their offsets ``[n_tokens + 1]``."""
    flat, offsets = ubatch.seq_id_flat, ubatch.seq_id_offset
    n_seq_tokens = ubatch.n_seq_tokens
    pos = np.ascontiguousarray(ubatch.pos, dtype=np.int32)
    if n_seq_tokens == 1:
        return pos, np.ascontiguousarray(flat, dtype=np.int32), np.ascontiguousarray(offsets, dtype=np.int32)
    lengths = np.repeat(np.diff(offsets), n_seq_tokens)
    token_offsets = np.zeros(lengths.size + 1, dtype=np.int32)
    np.cumsum(lengths, out=token_offsets[1:])
    picks = [np.tile(flat[offsets[g]:offsets[g + 1]], n_seq_tokens) for g in range(offsets.size - 1)]
    return pos, np.concatenate(picks).astype(np.int32), token_offsets


def seq_lists(flat: np.ndarray, offsets: np.ndarray) -> Any:
    """The KV table's per-token seq ids: one id each as a 1-D array, else a list of lists."""
    if flat.size == offsets.size - 1:
        return flat
    return [flat[offsets[t]:offsets[t + 1]].tolist() for t in range(offsets.size - 1)]


class HybridState:
    """The ubatches of one ``HybridCache.init_batch``, applied one at a time to both halves.

    As ``MemoryState``: ``apply()`` places the current ubatch, then the model reads ``ubatch``, its
    recurrent rows ``r(il)`` / ``s(il)`` (and ``r_steps`` / ``s_steps`` with rollback), and its
    attention memory: ``k(il)`` / ``v(il)`` (the layer's whole K and V tensors), ``kv_cells`` (the cell
    of each token: where the model writes its keys and values), ``n_kv`` (attend to cells
    ``[0, n_kv)``) and ``kv_mask()``; ``next()`` moves on.  Or iterate.  A state is stale once the
    cache changed after its ``init_batch`` (or after its last ``apply``) other than through it.
    """

    __slots__ = ("_cache", "_recurrent", "_plan", "status", "_generation", "_u", "_applied", "_n_kv", "_masks",
                 "_apply_both", "_build_mask")

    def __init__(self, cache: HybridMemory, recurrent: MemoryState, plan: KvPlan | None, status: MemoryStatus,
                 generation: int, apply_both: Callable[[int, KvPlan, int, Callable[[], object]], tuple[int, int]],
                 build_mask: Callable[[KvTokens, int, bool], np.ndarray]) -> None:
        self._cache = cache
        self._recurrent = recurrent
        self._plan = plan            # None: no ubatch to apply (status is not SUCCESS)
        self.status = status
        self._generation = generation   # the cache's, when init_batch made this state
        self._u = 0
        self._applied = False
        self._n_kv = 0
        self._masks: dict[bool, np.ndarray] | None = None   # built when first read
        self._apply_both = apply_both   # the KV half, then the recurrent half (its apply, given), or broken
        self._build_mask = build_mask

    # -- stepping ----------------------------------------------------------------------

    def apply(self) -> bool:
        """Place the current ubatch in both halves. Returns True."""
        if self.status is not MemoryStatus.SUCCESS or self._plan is None:
            raise UsageError(f"apply() on a state whose status is {self.status.name}")
        if self._applied:
            raise UsageError(f"ubatch {self._u} is already applied; call next() first")
        # the KV half first, on the slot init_batch found on the table as it still is (a stale state
        # is refused there before anything changes); then the recurrent half's own prepared ubatch.
        # A change made through the C API moves the recurrent core's counter only: refused here.
        if self._recurrent.stale:
            raise UsageError("the cache changed after this state was prepared (a sequence operation, a "
                             "state_read or another state's apply): call init_batch again")
        self._generation, self._n_kv = self._apply_both(self._generation, self._plan, self._u, self._recurrent.apply)
        self._masks = None
        self._applied = True
        return True

    def next(self) -> bool:
        """Move to the next ubatch; False after the last one."""
        if not self._recurrent.next():
            return False
        self._u += 1
        self._applied = False
        return True

    def __iter__(self) -> Iterator[Ubatch]:
        return each_ubatch(self)

    @property
    def applied(self) -> bool:
        """Whether the current ubatch is applied."""
        return self._applied

    # -- what the model reads -------------------------------------------------------------

    @property
    def n_ubatches(self) -> int:
        """Number of ubatches (0 for a failed prepare)."""
        return self._recurrent.n_ubatches if self.status == MemoryStatus.SUCCESS else 0

    @property
    def ubatch(self) -> Ubatch:
        """The current ubatch (``memory_state.Ubatch``)."""
        return self._recurrent.ubatch

    @property
    def out_ids(self) -> np.ndarray:
        """[n_outputs] int64: the batch index of each output row, in ubatch order."""
        return self._recurrent.out_ids

    def _current(self) -> None:
        if not self._applied:
            raise UsageError(f"ubatch {self._u} is not applied yet: call apply() first")
        if self._generation != self._cache.generation or self._recurrent.stale:
            raise UsageError("the cache changed after this ubatch was applied: its cells may hold other "
                             "sequences now")

    def r(self, il: int) -> Tensor:
        """The applied ubatch's recurrent r rows of layer il (``MemoryState.r``)."""
        self._current()
        return self._recurrent.r(il)

    def s(self, il: int) -> Tensor:
        """The applied ubatch's recurrent s rows of layer il (``MemoryState.s``)."""
        self._current()
        return self._recurrent.s(il)

    def r_steps(self, il: int) -> Tensor:
        """``MemoryState.r_steps``: where the model writes layer il's r state after each token but the
        last of every group, with ``n_rollback > 0``."""
        self._current()
        return self._recurrent.r_steps(il)

    def s_steps(self, il: int) -> Tensor:
        """``MemoryState.s_steps``."""
        self._current()
        return self._recurrent.s_steps(il)

    @property
    def copy_src(self) -> np.ndarray:
        """The recurrent half's copy plan (``MemoryState.copy_src``)."""
        return self._recurrent.copy_src

    @property
    def zero(self) -> np.ndarray:
        """The recurrent rows zeroed (``MemoryState.zero``)."""
        return self._recurrent.zero

    def _attention(self, tensors: tuple[Any, ...], il: int) -> Tensor:
        il = _args.index(il, "layer index", len(tensors), OutOfRangeError)
        if tensors[il] is None:
            raise OutOfRangeError(f"layer {il} has no attention (attn_layers={self._cache.attn_layers})")
        self._current()
        tensor: Tensor = tensors[il]
        return tensor

    def k(self, il: int) -> Tensor:
        """Layer il's whole K tensor ``[kv_size, n_embd_k]``: the model writes the ubatch's keys at rows
        ``kv_cells`` and attends to rows ``[0, n_kv)``."""
        return self._attention(self._cache.k, il)

    def v(self, il: int) -> Tensor:
        """Layer il's whole V tensor: ``[n_embd_v, kv_size]`` with ``v_trans`` (the values of cell c in
        column c), else ``[kv_size, n_embd_v]``."""
        return self._attention(self._cache.v, il)

    @property
    def v_trans(self) -> bool:
        """Whether ``v(il)`` is transposed (``HybridCache.v_trans``)."""
        return self._cache.v_trans

    @property
    def kv_cells(self) -> np.ndarray:
        """[n_tokens] int32: the KV cell of each token of the applied ubatch (ubatch order)."""
        self._current()
        assert self._plan is not None
        return self._plan.cells(self._u)

    @property
    def n_kv(self) -> int:
        """The cells to attend to: ``[0, n_kv)`` (the used ones, padded; at most ``kv_size``)."""
        self._current()
        return self._n_kv

    def kv_mask(self, sliding: bool = False) -> np.ndarray:
        """float32 ``[n_tokens, n_kv]``: 0 where token i may attend to cell j, -inf elsewhere (its own
        sequence, positions not after its own; ``sliding``: within the sliding window too).  A numpy
        array, built once per ubatch and kind (a torch model moves it to its device)."""
        self._current()
        sliding = as_flag(sliding, "sliding")
        if self._masks is None:
            self._masks = {}
        mask = self._masks.get(sliding)
        if mask is None:
            assert self._plan is not None
            mask = self._masks[sliding] = self._build_mask(self._plan.tokens(self._u), self._n_kv, sliding)
        return mask

    def __repr__(self) -> str:
        return (f"HybridState({self.status.name}, ubatch {self._u + 1}/{self.n_ubatches}, "
                f"{'applied' if self._applied else 'pending'})")
