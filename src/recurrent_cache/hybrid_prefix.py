"""Prefix reuse for hybrid models (docs/hybrid.md, "Prefix reuse"): the KV rows of a prompt's tokens and
the recurrent state at exactly the same token, kept together under one byte budget.

A hybrid's prefix is two things of different shape.  Its attention rows cost per token, and the
rows of a shared prefix are the same for every prompt that extends it: they are kept once, in a
trie of token blocks (``block_size`` tokens; a node holds the K and V rows of its block's tokens,
keyed by the block's tokens under its parent, so a node stands for one exact prefix).  Its
recurrent state costs the same at any length and exists only where it was saved: a *snapshot*
holds the state after exactly its tokens, and the K and V rows of the tokens past its last full
block (its *tail*).  A snapshot can be kept at any token; a prefix is reusable up to the longest
snapshot of the prompt.

Budget and eviction.  Blocks and snapshots are counted against ``max_bytes`` together.  A block
lives while a snapshot at or below it does.  Eviction is GreedyDual-Size-Frequency over snapshots:
the priority of a snapshot is ``L + weight * length * (1 + hits) / bytes``, what restoring it saves
(tokens not recomputed, times its uses, times how likely it is to be reused) per byte it holds alone
(its state and tail, and the blocks no other snapshot needs), with ``L`` the priority of the last
snapshot evicted.  ``weight`` is ``JUNCTION_WEIGHT`` once saved prompts continue it with two
different tokens (a system prompt, a few-shot template: what conversations share), 1 before (the end
of a prompt or a reply, which only its own conversation extends).  A newcomer whose priority is
below the lowest is refused (``save`` returns False), so one long unique prompt does not flush the
shared ones.  Evicting a snapshot frees the blocks only it kept.

Exactness: a restored sequence holds, bit for bit, the K, V, r and s rows the saving sequence held
at those positions (``tests/prefix/test_hybrid_prefix.py``).  Rows are kept on the cache's storage.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._args import count, text, tokens as token_array
from .errors import ArgumentError, NoFreeCellError, PositionError, StateError
from .formats.geometry import Geometry
from .hybrid import HybridCache
from .stores.snapshot import hybrid_key_text
from .stores.tier import HybridStoreTier
from .storage import Tensor

__all__ = ["HybridPrefixCache", "JUNCTION_WEIGHT"]

JUNCTION_WEIGHT = 64.0   # as PrefixCache's: a prefix two saved prompts continue differently


class _Block:
    """A full block of tokens under its parent, with the K and V rows of its tokens."""

    __slots__ = ("parent", "key", "depth", "children", "snapshots", "k", "v", "users")

    def __init__(self, parent: _Block | None, key: bytes, depth: int, k: Tensor | None, v: Tensor | None) -> None:
        self.parent = parent
        self.key = key
        self.depth = depth                       # tokens from the root to the end of this block
        self.children: dict[bytes, _Block] = {}
        self.snapshots: dict[bytes, _Snapshot] = {}   # by tail (the tokens past this block)
        self.k, self.v = k, v                    # [n_attn, block_size, n_embd]; None at the root
        self.users = 0                           # snapshots at or below this block


class _Snapshot:
    __slots__ = ("block", "tail", "length", "k", "v", "r", "s", "hits", "priority", "nbytes", "order", "nexts")

    def __init__(self, block: _Block, tail: bytes, length: int, k: Tensor, v: Tensor, r: list[Tensor],
                 s: list[Tensor], nbytes: int, order: int) -> None:
        self.block, self.tail, self.length = block, tail, length
        self.k, self.v, self.r, self.s = k, v, r, s      # tail K / V rows [n_attn, tail, n_embd]; state rows
        self.hits = 0
        self.priority = 0.0
        self.nexts: set[int] = set()                     # the tokens saved prompts continue it with
        self.nbytes = nbytes                             # its state and tail
        self.order = order


class HybridPrefixCache:
    """Keep and restore hybrid prefixes: ``save(seq, tokens)`` after prefilling, ``restore(seq,
    tokens)`` before, ``match(tokens)`` to ask.  ``cache`` is the ``HybridCache`` both act on."""

    def __init__(self, cache: HybridCache, max_bytes: int, block_size: int = 16, store: Any = None,
                 namespace: str | None = None) -> None:
        if not isinstance(cache, HybridCache):
            raise ArgumentError(f"HybridPrefixCache needs a HybridCache, got {type(cache).__name__}")
        self._tier: HybridStoreTier | None = None
        if store is not None:
            if namespace is None:
                raise ArgumentError("a store needs a namespace: the model's identity (its file's hash, its name and "
                                    "revision), so that no other model's states are read")
            geometry = Geometry(cache.n_layer, cache.n_embd_r, cache.n_embd_s, cache.dtype_r, cache.dtype_s,
                                layers=cache.recr_layers)
            self._tier = HybridStoreTier(store, text(namespace, "namespace"), geometry, hybrid_key_text(cache))
        self._cache = cache
        self._max_bytes = count(max_bytes, "max_bytes", 1, int32_only=False)
        self._block = count(block_size, "block_size", 1)
        self._token_bytes = cache.kv_bytes_per_token
        self._state_bytes = cache.recurrent_bytes_per_seq
        self._root = _Block(None, b"", 0, None, None)
        self._heap: list[tuple[float, int, _Snapshot]] = []   # stale entries (order moved on) skipped
        self._count = 0
        self._clock = 0.0
        self._used = 0
        self._order = itertools.count()
        self._stats = {"saved": 0, "refused": 0, "evicted": 0, "restored": 0, "tokens_restored": 0,
                       "store_lookups": 0, "store_hits": 0, "store_tokens_restored": 0, "store_puts": 0,
                       "store_written": 0}

    @property
    def cache(self) -> HybridCache:
        """The memory this prefix cache restores into and saves from."""
        return self._cache

    # -- asking --------------------------------------------------------------------------

    def match(self, tokens: Sequence[int] | np.ndarray) -> int:
        """The longest prefix of ``tokens`` that ``restore`` would give (0: none)."""
        found = self._longest(self._bytes(tokens))
        return 0 if found is None else found.length

    @property
    def nbytes(self) -> int:
        """Bytes held: blocks and snapshots."""
        return self._used

    def __len__(self) -> int:
        return self._count

    def stats(self) -> dict[str, int]:
        """Counts: snapshots saved, refused, evicted, restores and tokens restored; snapshots and bytes held;
        with a store, its lookups, hits, tokens restored from it, puts and confirmed writes, and the
        entries it rejected (``store_damaged``) and calls that raised (``store_errors``)."""
        stats = dict(self._stats, snapshots=self._count, bytes=self._used)
        if self._tier is not None:
            tier = self._tier.stats()
            stats |= {"store_damaged": tier["damaged"], "store_errors": tier["errors"]}
        return stats

    # -- saving and restoring ----------------------------------------------------------------

    def save(self, seq: int, tokens: Sequence[int] | np.ndarray) -> bool:
        """Keep what ``seq`` holds after exactly ``tokens`` (it must hold positions ``0 .. len - 1``
        and nothing else); False when the budget does not let it in (nothing is kept then).
        Saving a prefix already kept counts a use of it."""
        return self._save(seq, tokens, to_store=True)

    def _save(self, seq: int, tokens: Sequence[int] | np.ndarray, to_store: bool) -> bool:
        data = self._bytes(tokens)
        n = len(data) // 4
        if n == 0:
            raise ArgumentError("save: a prefix needs at least one token")
        held = self._find(data)
        if held is not None:
            self._touch(held)
            return True
        state = self._cache.seq_state(seq)
        if state.pos.size != n or not np.array_equal(state.pos, np.arange(n)):
            raise PositionError(f"save: sequence {seq} holds positions {_shown(state.pos)}, not exactly 0 .. {n - 1} "
                                f"for {n} tokens")
        if to_store and self._tier is not None:   # the store takes it even when memory does not
            self._stats["store_puts"] += 1
            self._stats["store_written"] += self._tier.put(np.frombuffer(data, "<i4"), self._cache.state_write(seq))
        full = n // self._block * self._block
        path = self._blocks_for(data, full, state.k, state.v)
        snapshot = _Snapshot(path, data[full * 4:], n, state.k[:, full:], state.v[:, full:], state.r, state.s,
                             self._state_bytes + (n - full) * self._token_bytes, next(self._order))
        self._pin(path, 1)   # its blocks stay while others are evicted to make room
        alone = snapshot.nbytes + self._bytes_alone(path)
        self._passes(data)
        snapshot.nexts = self._continuations(path, snapshot.tail)
        weight = JUNCTION_WEIGHT if len(snapshot.nexts) > 1 else 1.0
        snapshot.priority = self._clock + weight * n / alone
        victims = self._victims(snapshot.nbytes, snapshot.priority)
        if victims is None:
            self._pin(path, -1)
            self._clock = max(self._clock, snapshot.priority)
            self._stats["refused"] += 1
            return False
        for victim in victims:
            self._evict(victim)
        path.snapshots[snapshot.tail] = snapshot
        self._used += snapshot.nbytes
        self._count += 1
        self._push(snapshot)
        self._stats["saved"] += 1
        return True

    def restore(self, seq: int, tokens: Sequence[int] | np.ndarray) -> int:
        """Give ``seq`` (which must hold nothing) the longest kept prefix of ``tokens``: its KV cells at
        positions ``0 .. n - 1`` with their rows and its recurrent state after token ``n - 1``.
        Returns ``n`` (0: nothing kept, ``seq`` unchanged).  With a store, a longer prefix it holds wins
        (read with ``HybridCache.state_read``, then kept in memory too, as budget allows)."""
        data = self._bytes(tokens)
        found = self._longest(data)
        from_store = 0 if self._tier is None else self._from_store(seq, data, 0 if found is None else found.length)
        if from_store:
            return from_store
        if found is None:
            return 0
        blocks = []
        block: _Block | None = found.block
        while block is not None and block.k is not None:
            blocks.append(block)
            block = block.parent
        blocks.reverse()
        cat = _concatenate
        k = cat([b.k for b in blocks] + [found.k])
        v = cat([b.v for b in blocks] + [found.v])
        self._cache.seq_restore(seq, np.arange(found.length, dtype=np.int32), k, v, found.r, found.s)
        self._touch(found)
        self._stats["restored"] += 1
        self._stats["tokens_restored"] += found.length
        return found.length

    def _from_store(self, seq: int, data: bytes, held: int) -> int:
        """Restore ``seq`` from the store when it holds a prefix of ``data`` longer than ``held``
        tokens: the whole prompt, all but its last token, or a multiple of ``block_size``, longest
        first (the lengths ``save`` is asked for by a serving loop).  Returns the tokens restored; 0,
        ``seq`` unchanged, on a miss or an entry the cache refuses."""
        assert self._tier is not None
        if self._cache.seq_pos_max(seq) >= 0:
            raise ArgumentError(f"restore: sequence {seq} holds positions already; it must hold nothing")
        tokens = np.frombuffer(data, "<i4")
        n = tokens.size
        lengths = sorted({length for length in (n, n - 1, *range(n // self._block * self._block, 0, -self._block))
                          if length > held}, reverse=True)
        if not lengths:
            return 0
        self._stats["store_lookups"] += 1
        found = self._tier.fetch(tokens, lengths)
        if found is None:
            return 0
        length, state = found
        try:   # an entry must hold exactly its tokens' positions (one shifted or cut is not this prefix)
            self._cache.state_read(state, seq, n_tokens=length)
        except (StateError, NoFreeCellError):   # an entry this cache cannot take: a miss, nothing changed
            self._tier.damaged(length)
            return 0
        self._stats["store_hits"] += 1
        self._stats["store_tokens_restored"] += length
        self._stats["restored"] += 1
        self._stats["tokens_restored"] += length
        self._save(seq, tokens[:length], to_store=False)   # promoted into memory as budget allows
        return length

    # -- the trie ---------------------------------------------------------------------------

    @staticmethod
    def _bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
        return token_array(tokens).astype("<i4").tobytes()

    def _find(self, data: bytes) -> _Snapshot | None:
        """The snapshot of exactly these tokens."""
        n = len(data) // 4
        full = n // self._block * self._block
        block: _Block | None = self._root
        step = self._block * 4
        for start in range(0, full * 4, step):
            block = block.children.get(data[start:start + step]) if block is not None else None
        return None if block is None else block.snapshots.get(data[full * 4:])

    def _longest(self, data: bytes) -> _Snapshot | None:
        """The longest snapshot whose tokens begin ``data``."""
        step = self._block * 4
        best: _Snapshot | None = None
        block: _Block | None = self._root
        at = 0
        while block is not None:
            for tail, snapshot in block.snapshots.items():
                if data.startswith(tail, at) and (best is None or snapshot.length > best.length):
                    best = snapshot
            block = block.children.get(data[at:at + step]) if len(data) - at >= step else None
            at += step
        return best

    def _passes(self, data: bytes) -> None:
        """A prompt is being saved: the snapshots it passes through learn the token it continues them
        with; one continued two ways is a junction."""
        step = self._block * 4
        block: _Block | None = self._root
        at = 0
        while block is not None:
            for tail, snapshot in block.snapshots.items():
                end = at + len(tail)
                if end < len(data) and data.startswith(tail, at):
                    before = len(snapshot.nexts)
                    snapshot.nexts.add(int.from_bytes(data[end:end + 4], "little", signed=True))
                    if before == 1 and len(snapshot.nexts) == 2:
                        self._refresh(snapshot)
            block = block.children.get(data[at:at + step]) if len(data) - at >= step else None
            at += step

    def _continuations(self, block: _Block, tail: bytes) -> set[int]:
        """The tokens the saved paths through a point (``tail`` past ``block``) continue it with: the
        next token of each deeper block and longer tail that begins there."""
        at = len(tail)
        keys = list(block.children) + [t for t in block.snapshots if len(t) > at]
        return {int.from_bytes(key[at:at + 4], "little", signed=True) for key in keys if key.startswith(tail)}

    def _blocks_for(self, data: bytes, full: int, k: Tensor, v: Tensor) -> _Block:
        """The block of the first ``full`` tokens, its path made (with the rows, counted) where missing."""
        block = self._root
        step = self._block * 4
        for start in range(0, full, self._block):
            key = data[start * 4:start * 4 + step]
            child = block.children.get(key)
            if child is None:
                end = start + self._block
                child = _Block(block, key, end, k[:, start:end], v[:, start:end])
                block.children[key] = child
                self._used += self._block * self._token_bytes
            block = child
        return block

    def _bytes_alone(self, block: _Block) -> int:
        """The bytes of the blocks of a path that no snapshot but the one pinned on it keeps."""
        total = 0
        node: _Block | None = block
        while node is not None and node.parent is not None and node.users == 1:
            total += self._block * self._token_bytes
            node = node.parent
        return total

    def _pin(self, block: _Block, change: int) -> None:
        """Add ``change`` to the users of a path; blocks left without one are freed."""
        node: _Block | None = block
        while node is not None:
            node.users += change
            parent = node.parent
            if node.users == 0 and parent is not None and not node.snapshots and not node.children:
                del parent.children[node.key]
                self._used -= self._block * self._token_bytes
            node = parent

    # -- eviction -----------------------------------------------------------------------------

    def _victims(self, needed: int, priority: float) -> list[_Snapshot] | None:
        """The snapshots of lower priority than a newcomer's whose eviction makes ``needed`` bytes fit,
        lowest first; None when even all of them would not (then nothing is evicted)."""
        over = self._used + needed - self._max_bytes
        if over <= 0:
            return []
        victims: list[_Snapshot] = []
        users: dict[int, int] = {}
        for entry_priority, order, candidate in sorted(self._heap):
            if over <= 0:
                break
            if order != candidate.order:
                continue
            if entry_priority > priority:
                return None
            victims.append(candidate)
            over -= candidate.nbytes
            node: _Block | None = candidate.block
            while node is not None and node.parent is not None:
                left = users.get(id(node), node.users) - 1
                users[id(node)] = left
                if left == 0:
                    over -= self._block * self._token_bytes
                node = node.parent
        return victims if over <= 0 else None

    def _touch(self, snapshot: _Snapshot) -> None:
        snapshot.hits += 1
        self._refresh(snapshot)

    def _refresh(self, snapshot: _Snapshot) -> None:
        weight = JUNCTION_WEIGHT if len(snapshot.nexts) > 1 else 1.0
        snapshot.priority = self._clock + weight * snapshot.length * (1 + snapshot.hits) / snapshot.nbytes
        snapshot.order = next(self._order)
        self._push(snapshot)

    def _push(self, snapshot: _Snapshot) -> None:
        heapq.heappush(self._heap, (snapshot.priority, snapshot.order, snapshot))
        if len(self._heap) > 2 * self._count + 64:   # drop the stale entries of touched and evicted snapshots
            self._heap = [entry for entry in self._heap if entry[1] == entry[2].order]
            heapq.heapify(self._heap)

    def _evict(self, snapshot: _Snapshot) -> None:
        snapshot.order = -1   # its heap entries are stale from now on
        self._clock = snapshot.priority
        del snapshot.block.snapshots[snapshot.tail]
        self._used -= snapshot.nbytes
        self._count -= 1
        self._pin(snapshot.block, -1)
        self._stats["evicted"] += 1


def _concatenate(parts: list[Any]) -> Any:
    """Row blocks along the token axis, numpy or torch."""
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts, axis=1)
    import torch
    return torch.cat(parts, dim=1)


def _shown(pos: np.ndarray) -> str:
    values = pos.tolist()
    return str(values if len(values) <= 8 else values[:8] + ["..."])
