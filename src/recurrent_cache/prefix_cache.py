"""The prefix-state cache (docs/prefix-cache.md): reuse the state of every shared prompt prefix, exactly.

A recurrent state cannot be cut back to an earlier token, so a prefix can be
reused only if the state was saved at exactly that prefix length.
``PrefixCache`` keeps such *snapshots* (one sequence's r and s rows of every
layer, keyed by the exact tokens that produced them) in numpy pools allocated
once, tells the serving loop where to stop its prefill and save (``plan``),
and copies the longest reusable snapshot into a free cell (``restore``)::

    pc = rc.PrefixCache(cache, max_bytes=256 << 20)
    n = pc.restore(seq, prompt)              # 0: nothing reusable, seq still holds no cell
    for cut in pc.plan(prompt, n):           # block grid, junctions, the end of the prompt
        ...                                  # prefill prompt[n:cut] on seq (positions n .. cut-1)
        pc.save(seq, prompt[:cut])
        n = cut
    ...                                      # generate; then, for the next turn:
    pc.save(seq, prompt + reply[:-1])        # the text whose effect is in the state

Lookup.  Keys live in a trie of token *blocks* (``block_size`` tokens, as
little-endian int32 bytes).  Each node's children are a dict keyed by the
block's bytes: Python hashes the bytes and compares them exactly only when the
hashes agree, so a lookup costs one dict probe per block of the prompt, never
a token-by-token comparison in Python.  A snapshot whose length is not a
multiple of ``block_size`` sits in the node of its full blocks under the bytes
of its remaining tokens (its *tail*).  Each node also keeps its continuations
(child blocks and tails) sorted, so the point where a prompt leaves the
saved paths inside a block (a *junction*) is found by bisection (the
neighbours of the prompt's block), the common prefixes for all blocks of the
prompt in one numpy comparison.

Eviction (GreedyDual-Size-Frequency over tokens saved, with admission).
Every snapshot has a priority ``L + value``: ``L`` is the priority of the
last snapshot evicted (so the priorities of snapshots not used for a while
fall behind: recency), and ``value = weight(kind) * length * (1 + hits)``
is what the snapshot saves when used — its depth in tokens, times how often
requests have restored it, times how likely it is to be reused, by kind:

* *junction* (``JUNCTION_WEIGHT`` = 64): a saved path passes through it and
  continues elsewhere, so at least two requests share this prefix (a system
  prompt, a few-shot template);
* *end* (``END_WEIGHT`` = 8): a length off the block grid that no saved path
  passes: the end of a prompt or of a conversation turn, which the next turn
  extends;
* *grid* (``GRID_WEIGHT`` = 1): a multiple of ``block_size`` on a single path,
  useful only if a later request leaves the path within the next block.

When the budget is full, a new snapshot evicts the one with the lowest
priority if its own priority is higher, and is not let in otherwise (``save``
returns False): a full cache of junctions and conversation ends is not
flushed by the grid points of one long unique prompt.  A refused newcomer
still raises ``L`` to its priority, as if it had been let in and evicted at
once, so snapshots that traffic no longer uses age out.  A snapshot being
restored is never evicted.  A restore of a snapshot, or a save of a prefix
already held (another request reached it), raises its hits and refreshes its
priority.  The path of an evicted (or refused) snapshot is remembered
without its state (a *ghost*; at most ``max_ghosts``, least recent dropped
first), so ``plan`` still finds the junctions with it when memory is tight.

The second tier (``store=``, docs/prefix-cache.md): a store shared by every process
(``rc.stores.DirectoryStore``, ``rc.stores.RedisStore``), wrapped in a
``stores.StoreTier`` under keys made of ``namespace``, the cache's geometry
and dtypes and the token prefix.  Write-through: every ``save`` of a state
this process does not hold yet is written to the store at once (also when
memory does not let it in), so another replica restores a shared prefix as
soon as one process has computed it, and a restart loses nothing; the cost
is one encode and one put per new snapshot.  A snapshot whose write the
store did not confirm (it was down, or had the entry already) is offered
again when it is evicted (``_spill``).  ``restore`` asks the store, in one
lookup, for the longest candidate length beyond what memory holds — the
block grid and the junctions this process knows, longest first, keyed by
one hash of the prompt (``_fetch``) — places the hit and then promotes it
into memory (``_promote``).  A store that fails is a miss; a damaged or
foreign entry is a miss counted in ``stats()``.

Cost.  ``match``, ``plan``, ``restore`` and ``save`` cost time and memory in
proportion to the prompt (and the snapshots held), never to ``block_size``:
the junction comparison spans at most the prompt, and nothing is padded to
a block.  ``bench/prefix_cost.py`` has the figures.

Failures.  ``save`` reads the cache before it changes anything, and
``restore`` changes the prefix cache only once the sequence holds its state:
a call that raises (``UsageError``: another thread is inside the cache)
leaves the snapshots, their order and the stats as they were.
"""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_left, insort
from collections import OrderedDict
from typing import Any, Protocol
from collections.abc import Sequence

import numpy as np

from ._args import count, in_range, index, text
from .errors import ArgumentError, NoFreeCellError, PositionError, SeqIdError
from .formats.dtypes import STATE_TYPES
from .storage import Tensor, allocating
from .stores import Geometry, StoreTier

__all__ = ["PrefixCache", "NoFreeCellError", "SnapshotTier"]

# How likely a snapshot of each kind is to be reused, relative to a grid point (chosen on
# bench/prefix_cache.py's traces: 64 : 8 : 1 was never worse than the anchors at any budget
# on three seeds, and better than 8 : 8 : 1 or 16 : 4 : 1 at small budgets).
JUNCTION_WEIGHT = 64.0
END_WEIGHT = 8.0
GRID_WEIGHT = 1.0
GHOSTS_MIN = 256            # ghost paths kept (no state, tokens only): this many per snapshot
GHOSTS_PER_SNAPSHOT = 4     # the budget holds, at least GHOSTS_MIN and at most GHOSTS_MAX
GHOSTS_MAX = 4096

_TOKEN = np.dtype("<i4")  # tokens as llama.cpp stores them: int32, little-endian
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1


class SnapshotTier(Protocol):
    """A second tier behind the in-memory snapshots (``stores.StoreTier`` over a store).

    ``put`` writes the state after ``tokens`` (one row per layer; the rows are
    only read during the call) and returns whether the tier confirms a new
    write; ``fetch`` returns ``(n, r_rows, s_rows)`` for the first of
    ``lengths`` (prefix lengths of ``tokens``, longest first) it holds, or
    None; ``stats`` returns the tier's ``damaged`` and ``errors`` counts.
    None of them raises for a failing store.
    """

    def put(self, tokens: np.ndarray, r: Sequence[np.ndarray], s: Sequence[np.ndarray]) -> bool: ...

    def fetch(self, tokens: np.ndarray,
              lengths: Sequence[int]) -> tuple[int, list[np.ndarray], list[np.ndarray]] | None: ...

    def stats(self) -> dict[str, int]: ...


class _Node:
    """The full blocks of a path; holds the snapshots whose length is in [depth*B, depth*B + B)."""

    __slots__ = ("parent", "block", "depth", "children", "tails", "tail_lengths", "tail_counts",
                 "continuations", "version", "branch_memo", "count")

    def __init__(self, parent: "_Node | None", block: bytes, depth: int) -> None:
        self.parent = parent
        self.block = block                       # this node's block, as bytes (b"" for the root)
        self.depth = depth                       # blocks from the root
        self.children: dict[bytes, _Node] = {}   # next block's bytes -> node
        self.tails: dict[bytes, _Snapshot] = {}  # bytes of the tokens after the blocks -> snapshot
        self.tail_lengths: list[int] = []        # distinct tail lengths in tokens, descending
        self.tail_counts: dict[int, int] = {}    # tail length -> snapshots with it
        self.continuations: list[bytes] = []     # child blocks and non-empty tails, sorted
        self.version = 0                         # bumped when the continuations change
        self.branch_memo: tuple[int, list[int]] = (-1, [])  # (parent's version, junctions in the parent)
        self.count = 0                           # snapshots in this node and below it

    def add_continuation(self, key: bytes) -> None:
        insort(self.continuations, key)
        self.version += 1

    def remove_continuation(self, key: bytes) -> None:
        del self.continuations[bisect_left(self.continuations, key)]
        self.version += 1

    def neighbours(self, mine: bytes) -> list[bytes]:
        """The continuations here that ``mine`` (the prompt's tokens after this node's blocks, at
        most one block) leaves deepest: one on each side of it in sorted order.

        Sorted, the continuations sharing the longest prefix with ``mine`` are its
        neighbours; those that are prefixes of ``mine`` (snapshots on its path) or extend
        it (paths the prompt ends on) are skipped: the prompt does not leave them.
        """
        options = self.continuations
        found = []
        i = bisect_left(options, mine)
        # past the prompt's own block and the paths the prompt ends on (they extend ``mine``)
        above = _above_extensions(mine)
        j = len(options) if above is None else bisect_left(options, above, i)
        if j < len(options):
            found.append(options[j])
        k = i - 1
        while k >= 0 and mine.startswith(options[k]):
            k -= 1
        if k >= 0:
            found.append(options[k])
        return found


def _above_extensions(prefix: bytes) -> bytes | None:
    """The least byte string that sorts after every string starting with ``prefix``; None if none does."""
    stem = prefix.rstrip(b"\xff")
    return stem[:-1] + bytes([stem[-1] + 1]) if stem else None


class _Snapshot:
    __slots__ = ("slot", "length", "node", "tail", "kind", "hits", "priority", "pinned", "stored")

    def __init__(self, slot: int, length: int, node: _Node, tail: bytes, kind: str) -> None:
        self.slot = slot        # row in the pools; -1: a ghost (the path is remembered, not the state)
        self.length = length    # tokens in the key
        self.node = node
        self.tail = tail
        self.kind = kind        # "junction" | "end" | "grid"
        self.hits = 0
        self.priority = 0.0
        self.pinned = False     # being restored: never evicted
        self.stored = False     # the second tier confirmed it holds this state


_KIND_WEIGHT = {"junction": JUNCTION_WEIGHT, "end": END_WEIGHT, "grid": GRID_WEIGHT}


class PrefixCache:
    """Snapshots of sequence states keyed by exact token prefixes, within ``max_bytes``.

    ``cache`` is a ``RecurrentCache`` (compiled or reference); snapshots are
    rows of every layer's r and s state, held in pools allocated here once:
    ``max_bytes // snapshot_bytes`` snapshots.  ``max_bytes`` bounds the state
    pools; the token keys are held besides (4 bytes per distinct block token).
    ``block_size`` is the grid ``plan`` cuts on.  ``store`` (a
    ``rc.stores.DirectoryStore``, ``rc.stores.RedisStore`` or any object
    with the store interface) is the second tier, shared between processes;
    ``namespace`` is the model's identity in it, part of every key with the
    cache's geometry and dtypes: set it (e.g. to the GGUF file's sha256) —
    two models sharing a namespace and a geometry would exchange states that
    mean nothing to each other.  Store hits are restored through memory, so
    ``max_bytes`` must hold at least one snapshot for them.
    """

    def __init__(self, cache: Any, max_bytes: int, block_size: int = 256, store: Any = None,
                 namespace: str = "") -> None:
        max_bytes = count(max_bytes, "PrefixCache: max_bytes", 0, int32_only=False)
        block_size = count(block_size, "PrefixCache: block_size", 1, int32_only=False)
        text(namespace, "PrefixCache: namespace")
        self.cache = cache
        self.max_bytes = max_bytes
        self.block_size = block_size
        self.namespace = namespace
        # the layers with state only (a layer filter leaves the others None): a snapshot holds
        # one row of each, in layer order, as cache.seq_state / seq_restore list them
        try:   # a RecurrentCache, or an object with its interface (a proxy)
            self._storage = cache.storage
            self._dtypes = (STATE_TYPES[cache.dtype_r], STATE_TYPES[cache.dtype_s])
            self._n_state = len(cache.layers)
        except (AttributeError, KeyError, TypeError):
            raise ArgumentError(f"PrefixCache: cache must be a RecurrentCache, got {type(cache).__name__}") from None
        self.snapshot_bytes = self._n_state * (cache.n_embd_r * self._dtypes[0].itemsize
                                               + cache.n_embd_s * self._dtypes[1].itemsize)
        self.capacity = self.max_bytes // max(1, self.snapshot_bytes)
        # The pools, in the cache's storage (on its device): snapshot slot i is row i of
        # pools[0] (r, [n_state, capacity, n_embd_r]) and of pools[1] (s).
        with allocating(f"PrefixCache's snapshot pools (max_bytes={max_bytes}: {self.capacity} snapshots of "
                        f"{self.snapshot_bytes} bytes) on {self._storage!r}"):
            self._pools = tuple(self._storage.allocate((self._n_state, self.capacity, tensor.shape[2]), dtype)
                                for tensor, dtype in zip(cache.tensors, self._dtypes))
        self._held: dict[int, _Snapshot] = {}   # slot -> the snapshot in it
        self._free_slots: list[int] = []        # slots freed by evictions; slots from len(_held) up are unused
        # Paths whose state was evicted or not let in, so that plan still finds the junctions
        # with them: least recently seen first, at most max_ghosts.
        self._ghosts: OrderedDict[_Snapshot, None] = OrderedDict()
        self.max_ghosts = min(GHOSTS_MAX, max(GHOSTS_MIN, GHOSTS_PER_SNAPSHOT * self.capacity))
        self._root = _Node(None, b"", 0)
        self._heap: list[tuple[float, int, _Snapshot]] = []  # (priority, order, snapshot), stale entries skipped
        self._order = itertools.count()
        self._inflation = 0.0                 # L: the priority of the last snapshot evicted
        self.store = store
        self._tier: SnapshotTier | None = None
        if store is not None:
            self._tier = StoreTier(store, namespace, Geometry.of(cache))
        self._stats = dict.fromkeys(("lookups", "hits", "tokens_matched", "tokens_recomputed", "saves",
                                     "rejected", "evictions"), 0)
        self._store_stats = dict.fromkeys(("store_lookups", "store_hits", "store_tokens_restored", "store_puts",
                                           "store_written", "store_spills"), 0)

    # -- public API --------------------------------------------------------------------

    def match(self, tokens: Sequence[int] | np.ndarray) -> int:
        """The longest prefix length ``n < len(tokens)`` that has a snapshot; 0 if none."""
        data, n_tokens = self._key(tokens)
        found = self._lookup(data, n_tokens)
        return found.length if found is not None else 0

    def restore(self, seq: int, tokens: Sequence[int] | np.ndarray) -> int:
        """Place the longest reusable snapshot of ``tokens`` in a free cell for ``seq``.

        ``seq`` must hold no cell.  It then holds the snapshot's state at
        position ``n - 1`` (placed as ``state_read`` of a one-cell blob would
        place it) and ``n`` is returned: feed ``tokens[n:]`` next.  ``n`` is
        less than ``len(tokens)``, so at least one token is left to produce
        logits.  Returns 0 and changes nothing when no prefix is reusable;
        raises ``NoFreeCellError`` (changing nothing) when one is but every
        cell is in use.  A call that raises leaves the prefix cache as it was
        (snapshots, their order, stats): a store hit is promoted into memory
        only once the sequence holds its state.
        """
        data, n_tokens = self._key(tokens)
        self._check_empty_seq(seq)
        if self.cache.used >= self.cache.size:
            found = self._lookup(data, n_tokens)   # (the tier is not asked: nothing could be placed)
            if found is None:
                return 0
            raise NoFreeCellError(f"restore seq {seq}: a snapshot of {found.length} tokens is held but all "
                                  f"{self.cache.size} cells are in use")
        counters = dict(self._store_stats)
        held = self._lookup(data, n_tokens)
        fetched = None
        if self._tier is not None:
            fetched = self._fetch(data, n_tokens, held.length if held is not None else 0)
        if fetched is not None:
            length, r_rows, s_rows = fetched
            found = None
        elif held is not None:
            length, found = held.length, held
            r_rows, s_rows = self._slot_rows(held.slot)
        else:
            self._stats["lookups"] += 1
            self._stats["tokens_recomputed"] += n_tokens
            return 0
        was_pinned = found.pinned if found is not None else False
        if found is not None:
            found.pinned = True   # its pool rows are being read
        try:
            self.cache.seq_restore(seq, length - 1, r_rows, s_rows)
        except BaseException:
            self._store_stats = counters   # the store lookup led nowhere: as if not made
            raise
        finally:
            if found is not None:
                found.pinned = was_pinned
        if fetched is not None:
            self._store_stats["store_hits"] += 1
            self._store_stats["store_tokens_restored"] += length
            found = self._promote(data, length, r_rows, s_rows)
        if found is not None:
            found.hits += 1
            self._touch(found)
        stats = self._stats
        stats["lookups"] += 1
        stats["hits"] += 1
        stats["tokens_matched"] += length
        stats["tokens_recomputed"] += n_tokens - length
        return length

    def plan(self, tokens: Sequence[int] | np.ndarray, start: int = 0) -> list[int]:
        """Prefix lengths in ``(start, len(tokens)]`` at which to stop the prefill and ``save``.

        Every multiple of ``block_size``, every junction (a length at which
        ``tokens`` leaves the path of a prefix saved earlier, at most two per
        block: the deepest branch on each side of the prompt's block in sorted
        order), and ``len(tokens)``; ascending.
        """
        data, n_tokens = self._key(tokens)
        start = in_range(start, "plan: start", 0, n_tokens + 1)
        block = self.block_size
        cuts = set(range((start // block + 1) * block, n_tokens + 1, block))
        cuts.update(j for j in self._junctions(data, n_tokens, start) if start < j < n_tokens)
        if n_tokens > start:
            cuts.add(n_tokens)
        return sorted(cuts)

    def save(self, seq: int, tokens: Sequence[int] | np.ndarray) -> bool:
        """Snapshot ``seq``'s current state as the state after ``tokens``.

        ``seq`` must hold a cell at position ``len(tokens) - 1``.  Returns True
        when the snapshot is held (new, or already held and refreshed), False
        when it is not let in: the budget is full of snapshots worth more
        (see the eviction policy) or holds none at all.  May evict others.
        With a store, a state not held in memory yet is written to it too
        (write-through), whether memory lets it in or not.
        """
        data, n_tokens = self._key(tokens)
        seq = index(seq, "save: seq", self.cache.size, SeqIdError)
        pos = self.cache.seq_pos_max(int(seq))
        if n_tokens == 0 or pos != n_tokens - 1:
            raise PositionError(f"save: seq {seq} is at position {pos}, but a snapshot of {n_tokens} tokens "
                                f"needs position {n_tokens - 1}")
        # All-or-nothing: the cache is read (which can raise: another thread inside it) before
        # anything here changes; what follows only moves numpy rows and never raises.
        rows = self._rows_of(int(seq))
        self._stats["saves"] += 1
        node, tail = self._path(data, n_tokens, create=False)
        known = node.tails.get(tail) if node is not None else None
        if known is not None and known.slot >= 0:   # another request reached this prefix: a use
            known.hits += 1
            self._touch(known)
            return True
        if known is not None:  # a ghost: out of the ghost list, so that no eviction below trims it
            del self._ghosts[known]
        kind = known.kind if known is not None else self._kind(data, n_tokens)
        if len(self._held) >= self.capacity:
            if not self._evict(self._inflation + self._value(kind, n_tokens, 0)):
                self._stats["rejected"] += 1
                if known is None:
                    known = self._add(data, n_tokens, -1, kind)
                self._ghost(known)
                if self._tier is not None:
                    self._write(known, data, rows)
                return False
        if known is None:
            known = self._add(data, n_tokens, -1, kind)
        slot = self._take_slot(known)
        self._fill(slot, rows)
        self._touch(known)
        if self._tier is not None:
            self._write(known, data, rows)
        return True

    def _rows_of(self, seq: int) -> tuple[Tensor, Tensor]:
        """Copies of ``seq``'s r and s rows, ``[n_state, 1, n_embd]`` each, in the cache's storage
        (zeros when its cell has no data yet, docs/concepts.md §2): one gather per kind."""
        src = self.cache.cell(self.cache.cell(seq)[2])[1]
        if src < 0:
            return self._zeros(1)
        found = np.array([src], dtype=np.int64)
        r, s = (self._storage.take(tensor, found) for tensor in self.cache.tensors)
        return r, s

    def _zeros(self, n: int) -> tuple[Tensor, Tensor]:
        r, s = (self._storage.allocate((self._n_state, n, pool.shape[2]), dtype)
                for pool, dtype in zip(self._pools, self._dtypes))
        return r, s

    def _fill(self, slot: int, rows: tuple[Tensor, Tensor]) -> None:
        """Pool slot ``slot`` := ``rows`` (``[n_state, 1, n_embd]`` per kind): one write per kind."""
        where = np.array([slot], dtype=np.int64)
        for pool, kind_rows in zip(self._pools, rows):
            self._storage.put(pool, where, kind_rows)

    def _slot_rows(self, slot: int) -> tuple[list[Tensor], list[Tensor]]:
        """Views of pool slot ``slot``: one r and one s row per layer with state."""
        return ([self._pools[0][k, slot] for k in range(self._n_state)],
                [self._pools[1][k, slot] for k in range(self._n_state)])

    def stats(self) -> dict[str, int]:
        """Counters for operators.

        ``lookups`` / ``hits``: ``restore`` calls and those that restored
        something; ``tokens_matched``: tokens restored instead of recomputed;
        ``tokens_recomputed``: tokens the callers had left to compute;
        ``saves``, ``rejected`` (saves not let in), ``evictions``;
        ``snapshots`` and ``bytes`` held, ``ghosts`` (paths remembered without state),
        ``capacity`` (snapshots) and ``max_bytes``.  With a store:
        ``store_lookups`` (restores that asked it), ``store_hits`` (restores
        from it), ``store_tokens_restored``, ``store_puts`` (states handed to
        it: each new save, and ``store_spills`` of them evicted snapshots
        whose write it had not confirmed), ``store_written`` (puts it confirmed
        as new: not there already, not failed), ``store_damaged`` (damaged or
        foreign entries: a miss) and ``store_errors`` (failed calls: a miss or
        a skipped write) — these two include the store object's own counts.
        """
        held = len(self._held)
        out = {**self._stats, "snapshots": held, "ghosts": len(self._ghosts), "bytes": held * self.snapshot_bytes,
               "capacity": self.capacity, "max_bytes": self.max_bytes}
        if self._tier is not None:
            tier = self._tier.stats()
            out.update(self._store_stats, store_damaged=tier["damaged"], store_errors=tier["errors"])
        return out

    def __len__(self) -> int:
        return len(self._held)

    def __repr__(self) -> str:
        return (f"PrefixCache({len(self)} of {self.capacity} snapshots, {self.snapshot_bytes} bytes each, "
                f"block_size={self.block_size})")

    # -- keys and the trie ----------------------------------------------------------------

    @staticmethod
    def _key(tokens: Sequence[int] | np.ndarray) -> tuple[bytes, int]:
        """``tokens`` as little-endian int32 bytes, and its length; bad input raises ArgumentError."""
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ArgumentError(f"tokens must be a 1-D sequence of integers, got shape {array.shape}")
        if array.size == 0:
            return b"", 0
        if array.dtype.kind not in "iu":
            raise ArgumentError(f"tokens must be integers, got dtype {array.dtype}")
        if array.dtype.itemsize > 4 or array.dtype == np.uint32:
            low, high = int(array.min()), int(array.max())
            if low < _INT32_MIN or high > _INT32_MAX:
                raise ArgumentError(f"token {low if low < _INT32_MIN else high} does not fit in int32")
        return np.ascontiguousarray(array, dtype=_TOKEN).tobytes(), int(array.size)

    def _walk(self, data: bytes, n_tokens: int) -> list[_Node]:
        """The nodes of the saved paths that ``data``'s full blocks follow, from the root."""
        step = 4 * self.block_size
        node = self._root
        nodes = [node]
        for q in range(n_tokens // self.block_size):
            child = node.children.get(data[q * step:(q + 1) * step])
            if child is None:
                break
            node = child
            nodes.append(node)
        return nodes

    def _path(self, data: bytes, n_tokens: int, create: bool) -> tuple[_Node | None, bytes]:
        """The node a snapshot of ``data`` belongs in, and its tail (created if asked)."""
        step = 4 * self.block_size
        full = n_tokens // self.block_size
        node = self._root
        for q in range(full):
            block = data[q * step:(q + 1) * step]
            child = node.children.get(block)
            if child is None:
                if not create:
                    return None, b""
                child = node.children[block] = _Node(node, block, q + 1)
                node.add_continuation(block)
            node = child
        return node, data[full * step:]

    def _lookup(self, data: bytes, n_tokens: int) -> _Snapshot | None:
        """The held snapshot of the longest proper prefix of ``data``."""
        block = self.block_size
        for node in reversed(self._walk(data, n_tokens)):
            base = node.depth * block
            for r in node.tail_lengths:   # descending: the first hit is the longest in this node
                if 0 < base + r < n_tokens:
                    found = node.tails.get(data[4 * base:4 * (base + r)])
                    if found is not None and found.slot >= 0:
                        return found
        return None

    def _junctions(self, data: bytes, n_tokens: int, start: int = 0) -> list[int]:
        """Lengths above ``start`` at which ``data`` leaves a saved path, block by block along its path.

        In each node on the path, the neighbours of the prompt's block among the node's
        sorted continuations (``_Node.neighbours``); the common prefixes with them are
        computed in one numpy comparison, and memoised in the prompt's child node until
        its parent's continuations change.
        """
        step, block = 4 * self.block_size, self.block_size
        if n_tokens == 0:
            return []
        nodes = self._walk(data, n_tokens)
        junctions: list[int] = []
        pending: list[tuple[int, _Node | None, bytes]] = []   # (depth, memo holder, neighbour)
        for i, node in enumerate(nodes):
            if not node.continuations or (node.depth + 1) * block <= start:
                continue
            child = nodes[i + 1] if i + 1 < len(nodes) else None   # the prompt goes on into a saved block
            if child is not None and child.branch_memo[0] == node.version:
                junctions += child.branch_memo[1]
                continue
            if child is not None:
                child.branch_memo = (node.version, [])
            mine = child.block if child is not None else data[node.depth * step:(node.depth + 1) * step]
            pending += [(node.depth, child, other) for other in node.neighbours(mine)]
        if pending:
            # Compared over at most the prompt's length, never a whole block: a block can be far
            # longer than the prompt, and a node's prompt tokens and continuations fit in this.
            width = min(block, n_tokens)
            span = 4 * width
            depths = np.fromiter((depth for depth, _, _ in pending), np.int64, len(pending))
            mine_rows = np.frombuffer(b"".join(data[depth * step:depth * step + span].ljust(span, b"\0")
                                               for depth, _, _ in pending), _TOKEN).reshape(-1, width)
            other_rows = np.frombuffer(b"".join(other[:span].ljust(span, b"\0") for _, _, other in pending),
                                       _TOKEN).reshape(-1, width)
            differ = mine_rows != other_rows
            first = np.where(differ.any(axis=1), differ.argmax(axis=1), width)
            limit = np.fromiter((min(len(other) // 4, n_tokens - depth * block) for depth, _, other in pending),
                                np.int64, len(pending))
            common = depths * block + np.minimum(first, limit)
            for (_, child, _), junction in zip(pending, common.tolist()):
                junctions.append(junction)
                if child is not None:
                    child.branch_memo[1].append(junction)
        return junctions

    def _kind(self, data: bytes, n_tokens: int) -> str:
        """junction: a saved path passes through this length and goes on; else end or grid."""
        node, tail = self._path(data, n_tokens, create=False)
        if node is not None:
            if tail == b"":
                passes = bool(node.children) or any(node.tails)
            else:
                options = node.continuations
                i = bisect_left(options, tail)
                passes = (i < len(options) and options[i] != tail and options[i].startswith(tail))
            if passes:
                return "junction"
        return "grid" if n_tokens % self.block_size == 0 else "end"

    def _add(self, data: bytes, n_tokens: int, slot: int, kind: str) -> _Snapshot:
        """A new snapshot (or ghost, ``slot = -1``) of ``data`` in the trie."""
        node, tail = self._path(data, n_tokens, create=True)
        assert node is not None   # create=True makes the path
        snapshot = _Snapshot(slot, n_tokens, node, tail, kind)
        node.tails[tail] = snapshot
        r = len(tail) // 4
        if r not in node.tail_counts:
            node.tail_counts[r] = 0
            insort(node.tail_lengths, r, key=lambda x: -x)
        node.tail_counts[r] += 1
        if tail:
            node.add_continuation(tail)
        up: _Node | None = node
        while up is not None:
            up.count += 1
            up = up.parent
        return snapshot

    def _remove(self, snapshot: _Snapshot) -> None:
        node, tail = snapshot.node, snapshot.tail
        del node.tails[tail]
        r = len(tail) // 4
        node.tail_counts[r] -= 1
        if node.tail_counts[r] == 0:
            del node.tail_counts[r]
            node.tail_lengths.remove(r)
        if tail:
            node.remove_continuation(tail)
        up: _Node | None = node
        while up is not None:
            up.count -= 1
            parent = up.parent
            if up.count == 0 and parent is not None:
                del parent.children[up.block]
                parent.remove_continuation(up.block)
            up = parent
        self._release_slot(snapshot)

    def _take_slot(self, snapshot: _Snapshot) -> int:
        """A pool slot for ``snapshot`` (there must be room)."""
        slot = self._free_slots.pop() if self._free_slots else len(self._held)
        self._held[slot] = snapshot
        snapshot.slot = slot
        return slot

    def _release_slot(self, snapshot: _Snapshot) -> None:
        if snapshot.slot >= 0:
            del self._held[snapshot.slot]
            self._free_slots.append(snapshot.slot)
            snapshot.slot = -1

    def _ghost(self, snapshot: _Snapshot) -> None:
        """Keep ``snapshot``'s path without its state (its slot, if any, is freed)."""
        self._release_slot(snapshot)
        self._ghosts[snapshot] = None
        self._ghosts.move_to_end(snapshot)
        while len(self._ghosts) > self.max_ghosts:
            oldest, _ = self._ghosts.popitem(last=False)
            self._remove(oldest)

    # -- eviction ---------------------------------------------------------------------------

    def _value(self, kind: str, length: int, hits: int) -> float:
        return _KIND_WEIGHT[kind] * length * (1 + hits)

    def _touch(self, snapshot: _Snapshot) -> None:
        snapshot.priority = self._inflation + self._value(snapshot.kind, snapshot.length, snapshot.hits)
        heapq.heappush(self._heap, (snapshot.priority, next(self._order), snapshot))
        if len(self._heap) > 4 * len(self._held) + 64:   # mostly stale entries: rebuild
            self._heap = [(held.priority, next(self._order), held) for held in self._held.values()]
            heapq.heapify(self._heap)

    def _evict(self, newcomer: float | None = None) -> bool:
        """Drop the held snapshot with the lowest priority that is not being restored.

        With ``newcomer`` (the priority a new snapshot would get), drop it only
        if it is lower: a snapshot that would be the first to go is not let in
        at the expense of a better one.  Returns whether a slot was freed.
        """
        skipped = []
        freed = False
        while self._heap:
            entry = self._heap[0]
            priority, _, snapshot = entry
            if snapshot.slot < 0 or priority != snapshot.priority:
                heapq.heappop(self._heap)  # stale: the snapshot was evicted or touched since
                continue
            if snapshot.pinned:
                skipped.append(heapq.heappop(self._heap))
                continue
            if newcomer is not None and newcomer <= priority:
                self._inflation = max(self._inflation, newcomer)   # as if let in and evicted at once
                break
            heapq.heappop(self._heap)
            self._inflation = priority
            self._spill(snapshot)
            self._ghost(snapshot)
            self._stats["evictions"] += 1
            freed = True
            break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return freed

    # -- the second tier ----------------------------------------------------------------------

    def _tokens_of(self, snapshot: _Snapshot) -> np.ndarray:
        blocks = []
        node: _Node | None = snapshot.node
        while node is not None:
            blocks.append(node.block)
            node = node.parent
        return np.frombuffer(b"".join(reversed(blocks)) + snapshot.tail, _TOKEN)

    def _write(self, snapshot: _Snapshot, data: bytes, rows: tuple[Tensor, Tensor]) -> None:
        """Write-through: hand ``snapshot``'s state (``[n_state, 1, n_embd]`` per kind, read during
        the call only) to the store, as host rows (one transfer per kind)."""
        assert self._tier is not None
        r, s = (self._storage.to_host(kind_rows) for kind_rows in rows)
        confirmed = self._tier.put(np.frombuffer(data, _TOKEN), [r[k, 0] for k in range(self._n_state)],
                                   [s[k, 0] for k in range(self._n_state)])
        snapshot.stored = snapshot.stored or confirmed   # "had it already" keeps an earlier confirmation
        self._store_stats["store_puts"] += 1
        self._store_stats["store_written"] += int(confirmed)

    def _spill(self, snapshot: _Snapshot) -> None:
        """An evicted snapshot whose write the store did not confirm is offered again."""
        if self._tier is None or snapshot.stored:
            return
        where = np.array([snapshot.slot], dtype=np.int64)
        r, s = (self._storage.take(pool, where) for pool in self._pools)
        self._write(snapshot, self._tokens_of(snapshot).tobytes(), (r, s))
        self._store_stats["store_spills"] += 1

    def _fetch(self, data: bytes, n_tokens: int,
               held: int) -> tuple[int, list[np.ndarray], list[np.ndarray]] | None:
        """On a memory miss, the longest candidate length the tier holds: ``(n, r_rows, s_rows)``,
        the rows of the pools' dtypes; None for a miss.  Changes nothing but ``store_lookups``.

        The candidates are the block grid and the junctions this process
        knows, beyond ``held`` (what memory has); one lookup, longest first.
        """
        if self.capacity == 0:
            return None
        candidates = set(range(self.block_size, n_tokens, self.block_size))
        candidates.update(self._junctions(data, n_tokens))
        lengths = sorted((n for n in candidates if held < n < n_tokens), reverse=True)
        if not lengths:
            return None
        assert self._tier is not None
        self._store_stats["store_lookups"] += 1
        found = self._tier.fetch(np.frombuffer(data, _TOKEN), lengths)
        if found is None:
            return None
        n, r_rows, s_rows = found
        n_state = self._n_state
        widths = [pool.shape[2] for pool in self._pools]
        kinds = [(dtype, width) for dtype, width in zip(self._dtypes, widths) for _ in range(n_state)]
        rows = list(r_rows) + list(s_rows)
        if not (n in lengths and len(r_rows) == n_state and len(s_rows) == n_state and all(
                np.asarray(row).nbytes == width * dtype.itemsize for row, (dtype, width) in zip(rows, kinds))):
            return None   # rows that do not fit this cache: a miss, never a wrong state
        # by the bytes: bf16 rows may be ml_dtypes.bfloat16 on one side and uint16 on the other
        typed = [np.ascontiguousarray(row).view(np.uint8).reshape(-1).view(dtype.numpy)
                 for row, (dtype, _) in zip(rows, kinds)]
        return n, typed[:n_state], typed[n_state:]

    def _promote(self, data: bytes, n: int, r_rows: list[np.ndarray], s_rows: list[np.ndarray]) -> _Snapshot | None:
        """A store hit of the first ``n`` tokens of ``data`` into memory; None if nothing can be evicted."""
        if len(self._held) >= self.capacity and not self._evict():
            return None   # every snapshot held is being restored
        prefix = data[:4 * n]
        node, tail = self._path(prefix, n, create=False)
        snapshot = node.tails.get(tail) if node is not None else None
        if snapshot is None:
            snapshot = self._add(prefix, n, -1, self._kind(prefix, n))
        elif snapshot.slot < 0:  # a ghost of it comes back to life
            del self._ghosts[snapshot]
        if snapshot.slot < 0:
            self._take_slot(snapshot)
        r, s = (self._storage.from_host(np.stack(rows)[:, None], dtype) if rows else self._zeros(1)[i]
                for i, (rows, dtype) in enumerate(zip((r_rows, s_rows), self._dtypes)))
        self._fill(snapshot.slot, (r, s))
        snapshot.stored = True
        return snapshot

    # -- checks -----------------------------------------------------------------------------

    def _check_empty_seq(self, seq: int) -> None:
        size = self.cache.size
        index(seq, "restore: seq", size, SeqIdError)
        if self.cache.cell(int(seq))[2] >= 0:
            raise ArgumentError(f"restore: seq {seq} already holds a cell (at position "
                                f"{self.cache.seq_pos_max(int(seq))}); remove it first with seq_rm")
