"""PrefixCache (SPEC §8): hand-worked cases, run on both engines through the ``rc`` fixture.

The "model" here writes into a sequence's rows a state that identifies the
exact token prefix (``fake_state``), so a restore can be checked row for row.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import recurrent_cache
from recurrent_cache.prefix_cache import NoFreeCellError, PrefixCache
from rows import assign, host

N_LAYER, N_EMBD_R, N_EMBD_S = 2, 3, 5


def fake_state(tokens, width: int, layer: int, which: str) -> np.ndarray:
    """The state after ``tokens``: a row that differs for every prefix, layer and tensor."""
    seed = zlib.crc32(np.asarray(tokens, dtype="<i4").tobytes() + f"{layer}{which}".encode())
    return np.random.default_rng(seed).standard_normal(width).astype(np.float32)


def make_cache(rc, n_seq_max: int = 2):
    return rc.RecurrentCache(N_LAYER, N_EMBD_R, N_EMBD_S, n_seq_max=n_seq_max)


def prefill(rc, cache, seq: int, tokens, start: int, end: int) -> None:
    """Feed tokens[start:end] on seq (positions start..end-1); its rows become fake_state(tokens[:end])."""
    batch = rc.Batch(token=list(tokens[start:end]), pos=list(range(start, end)), seq_id=[seq] * (end - start))
    st = cache.init_batch(batch, n_ubatch=512)
    for _ in st:
        pass
    row = cache.cell(seq)[2]
    for il in range(N_LAYER):
        assign(cache.r[il][row], fake_state(tokens[:end], N_EMBD_R, il, "r"))
        assign(cache.s[il][row], fake_state(tokens[:end], N_EMBD_S, il, "s"))


def assert_state_of(cache, seq: int, tokens) -> None:
    row = cache.cell(seq)[2]
    assert row >= 0
    assert cache.seq_pos_max(seq) == len(tokens) - 1
    for il in range(N_LAYER):
        np.testing.assert_array_equal(host(cache.r[il][row]), fake_state(tokens, N_EMBD_R, il, "r"))
        np.testing.assert_array_equal(host(cache.s[il][row]), fake_state(tokens, N_EMBD_S, il, "s"))


def serve(rc, cache, pc: PrefixCache, tokens, seq: int = 0) -> tuple[int, list[int]]:
    """What a serving loop does: restore, prefill with a save at every cut. Returns (restored, cuts)."""
    cache.seq_rm(seq, -1, -1)
    n = pc.restore(seq, tokens)
    if n:
        assert_state_of(cache, seq, tokens[:n])
    cuts = pc.plan(tokens, n)
    done = n
    for cut in cuts:
        prefill(rc, cache, seq, tokens, done, cut)
        pc.save(seq, tokens[:cut])
        done = cut
    return n, cuts


def snapshot_bytes() -> int:
    return N_LAYER * (N_EMBD_R + N_EMBD_S) * 4


def test_abc_junction(rc):
    """A (30 tokens), B shares 13 with A, C shares 13 with both: B's prefill is cut at 13, C reuses 13."""
    cache = make_cache(rc)
    pc = PrefixCache(cache, 100 * snapshot_bytes(), block_size=8)
    a = list(range(100, 130))
    b = a[:13] + list(range(500, 510))
    c = a[:13] + list(range(600, 615))
    assert serve(rc, cache, pc, a) == (0, [8, 16, 24, 30])
    assert serve(rc, cache, pc, b) == (8, [13, 16, 23])       # 13: where B leaves A's path
    assert serve(rc, cache, pc, c) == (13, [16, 24, 28])      # C restores the junction whole
    assert pc.match(a[:13] + [7]) == 13
    assert pc.match(a) == 24           # n < len(tokens): the full-length snapshot of A is not a match
    assert pc.match(a + [1]) == 30
    stats = pc.stats()
    assert (stats["lookups"], stats["hits"], stats["tokens_matched"]) == (3, 2, 21)
    assert stats["tokens_recomputed"] == 30 + (23 - 8) + (28 - 13)
    assert stats["snapshots"] == 4 + 3 + 3 and stats["bytes"] == 10 * snapshot_bytes()


def test_plan_lists_grid_junctions_and_end(rc):
    cache = make_cache(rc)
    pc = PrefixCache(cache, 100 * snapshot_bytes(), block_size=4)
    assert pc.plan([1, 2, 3, 4, 5, 6, 7, 8, 9], 0) == [4, 8, 9]
    assert pc.plan([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == [8, 9]
    assert pc.plan([1, 2, 3, 4, 5, 6, 7, 8, 9], 9) == []
    serve(rc, cache, pc, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # leaves the saved path at 6 (inside the second block) and at 1 (inside the first)
    assert pc.plan([1, 2, 3, 4, 5, 6, 0, 0, 0, 0], 0) == [4, 6, 8, 10]
    assert pc.plan([1, 0, 0], 0) == [1, 3]
    assert pc.plan([1, 2, 3, 4, 5, 6], 0) == [4, 6]    # ends on the saved path: no junction
    assert pc.plan([1, 2, 3, 4, 5, 6, 0, 0, 0, 0], 6) == [8, 10]
    with pytest.raises(recurrent_cache.ArgumentError, match="start"):
        pc.plan([1, 2, 3], 4)


def test_plan_finds_a_branch_beyond_a_path_the_prompt_ends_on(rc):
    """Saved [1, 2, 3] and [1, 5, 5]: the prompt [1, 2] ends on the first path and leaves the second at 1."""
    cache = make_cache(rc)
    pc = PrefixCache(cache, 100 * snapshot_bytes(), block_size=4)
    serve(rc, cache, pc, [1, 2, 3])
    serve(rc, cache, pc, [1, 5, 5])
    assert pc.plan([1, 2], 0) == [1, 2]
    assert pc.plan([1, 5], 0) == [1, 2]
    assert pc.plan([1, 2, 3, 4, 5], 0) == [1, 4, 5]


def test_multi_turn_restores_the_whole_previous_turn(rc):
    cache = make_cache(rc)
    pc = PrefixCache(cache, 100 * snapshot_bytes(), block_size=16)
    prompt = list(range(1, 11))
    serve(rc, cache, pc, prompt)
    reply = [50, 51, 52]
    prefill(rc, cache, 0, prompt + reply, len(prompt), len(prompt) + len(reply))  # generation
    assert pc.save(0, prompt + reply)
    turn2 = prompt + reply + [60, 61]
    n, cuts = serve(rc, cache, pc, turn2)
    assert (n, cuts) == (13, [15])
    reply2 = [70] * 4
    prefill(rc, cache, 0, turn2 + reply2, 15, 19)
    pc.save(0, turn2 + reply2)
    assert serve(rc, cache, pc, turn2 + reply2 + [80], seq=1)[0] == 19


def test_restore_places_as_a_one_cell_state_read(rc):
    """The cell, position and rows equal those a state_read of the same sequence's blob gives."""
    cache = make_cache(rc, n_seq_max=4)
    pc = PrefixCache(cache, 10 * snapshot_bytes(), block_size=4)
    tokens = [5, 6, 7, 8, 9, 10]
    prefill(rc, cache, 2, tokens, 0, 6)
    pc.save(2, tokens)
    blob = cache.state_write(2)
    prefill(rc, cache, 0, [1, 2], 0, 2)   # something else in the cache
    twin = make_cache(rc, n_seq_max=4)
    twin.state_read(cache.state_write())
    twin.seq_rm(2, -1, -1)
    cache.seq_rm(2, -1, -1)
    twin.state_read(blob, 3)
    assert pc.restore(3, tokens + [11]) == 6
    assert [cache.cell(i) for i in range(4)] == [twin.cell(i) for i in range(4)]
    assert cache.head == twin.head and cache.used == twin.used
    assert cache.state_write() == twin.state_write()
    cache.check()


def test_restore_into_a_sequence_that_holds_a_cell_is_refused(rc):
    cache = make_cache(rc)
    pc = PrefixCache(cache, 10 * snapshot_bytes(), block_size=4)
    tokens = [1, 2, 3, 4, 5]
    serve(rc, cache, pc, tokens)
    before = cache.state_write(), [cache.cell(i) for i in range(cache.size)], pc.stats()
    with pytest.raises(recurrent_cache.ArgumentError, match="seq 0 already holds a cell"):
        pc.restore(0, tokens + [6])
    assert (cache.state_write(), [cache.cell(i) for i in range(cache.size)], pc.stats()) == before
    with pytest.raises(recurrent_cache.SeqIdError, match=r"seq must be in \[0, 2\), got 2"):
        pc.restore(2, tokens + [6])


class FullCache:
    """A cache that reports every cell in use.

    On a real cache this cannot coincide with a sequence that holds no cell
    (``size`` cells, ``size`` sequence ids: a sequence without a cell leaves a
    cell free), so the guard is exercised through this proxy.
    """

    def __init__(self, cache) -> None:
        self._cache = cache

    def __getattr__(self, name):
        return getattr(self._cache, name)

    @property
    def used(self) -> int:
        return self._cache.size


def test_restore_with_no_free_cell_raises_and_changes_nothing(rc):
    cache = make_cache(rc, n_seq_max=2)
    pc = PrefixCache(FullCache(cache), 10 * snapshot_bytes(), block_size=4)
    tokens = [1, 2, 3, 4, 5]
    serve(rc, cache, pc, tokens)
    cache.seq_rm(0, -1, -1)
    before = cache.state_write(), [cache.cell(i) for i in range(cache.size)], pc.stats()
    with pytest.raises(NoFreeCellError, match="snapshot of 5 tokens .* all 2 cells are in use"):
        pc.restore(0, tokens + [6])
    assert isinstance(NoFreeCellError("x"), recurrent_cache.RecurrentCacheError)
    assert (cache.state_write(), [cache.cell(i) for i in range(cache.size)]) == before[:2]
    assert pc.stats()["hits"] == before[2]["hits"]
    assert pc.restore(0, [42, 43]) == 0   # nothing reusable: no error, nothing changes


def test_save_needs_the_matching_position(rc):
    cache = make_cache(rc)
    pc = PrefixCache(cache, 10 * snapshot_bytes(), block_size=4)
    prefill(rc, cache, 0, [1, 2, 3], 0, 3)
    with pytest.raises(recurrent_cache.PositionError, match="position 2.*needs position 3"):
        pc.save(0, [1, 2, 3, 4])
    with pytest.raises(recurrent_cache.PositionError, match="position -1"):
        pc.save(1, [1])
    with pytest.raises(recurrent_cache.PositionError):
        pc.save(0, [])
    with pytest.raises(recurrent_cache.SeqIdError):
        pc.save(5, [1, 2, 3])
    assert len(pc) == 0 and pc.stats()["saves"] == 0


@pytest.mark.parametrize("tokens", [[[1, 2]], [1.5, 2.0], [1, 2 ** 31], np.array([-(2 ** 31) - 1]), "ab"])
def test_bad_tokens_are_rejected(rc, tokens):
    cache = make_cache(rc)
    pc = PrefixCache(cache, 10 * snapshot_bytes())
    for call in (pc.match, pc.plan, lambda t: pc.restore(0, t)):
        with pytest.raises(recurrent_cache.ArgumentError):
            call(tokens)


@pytest.mark.parametrize("kwargs", [{"max_bytes": -1}, {"max_bytes": 1.5}, {"max_bytes": True},
                                    {"max_bytes": 10, "block_size": 0}, {"max_bytes": 10, "namespace": 3}])
def test_bad_arguments_are_rejected(rc, kwargs):
    with pytest.raises(recurrent_cache.ArgumentError):
        PrefixCache(make_cache(rc), **kwargs)


def test_tiny_budget_keeps_what_saves_most(rc):
    """Two snapshots' worth: the grid points of a unique prompt do not push out a shared junction.

    S is a 12-token system prompt (block_size 8).  Request 1 = S + u1 saves 8, 12?, 16, 20;
    request 2 = S + u2 leaves request 1's path at 12: the junction.  Then a long unique
    prompt's grid points (weight 1) are refused rather than evict it, and request 3 on S
    restores all 12 tokens.
    """
    cache = make_cache(rc)
    pc = PrefixCache(cache, 2 * snapshot_bytes(), block_size=8)
    assert pc.capacity == 2
    system = list(range(1, 13))
    serve(rc, cache, pc, system + [100, 101, 102, 103, 104, 105, 106, 107])
    n, cuts = serve(rc, cache, pc, system + [200, 201, 202])
    assert 12 in cuts
    unique = list(range(1000, 1040))
    serve(rc, cache, pc, unique)
    stats = pc.stats()
    assert stats["snapshots"] == 2 and stats["rejected"] > 0 and stats["evictions"] > 0
    n, _ = serve(rc, cache, pc, system + [300, 301])
    assert n == 12
    assert pc.restore(1, system + [400]) == 12   # the junction survived the request that used it
    assert_state_of(cache, 1, system)


def test_zero_budget_holds_nothing(rc):
    cache = make_cache(rc)
    pc = PrefixCache(cache, snapshot_bytes() - 1)
    assert pc.capacity == 0
    prefill(rc, cache, 0, [1, 2, 3], 0, 3)
    assert pc.save(0, [1, 2, 3]) is False
    cache.seq_rm(0, -1, -1)
    assert pc.restore(0, [1, 2, 3, 4]) == 0 and cache.used == 0


def test_save_of_a_held_key_refreshes_it(rc):
    cache = make_cache(rc)
    pc = PrefixCache(cache, 4 * snapshot_bytes(), block_size=4)
    serve(rc, cache, pc, [1, 2, 3, 4, 5])
    held = len(pc)
    cache.seq_rm(0, -1, -1)
    prefill(rc, cache, 0, [1, 2, 3, 4, 5], 0, 5)
    assert pc.save(0, [1, 2, 3, 4, 5]) and len(pc) == held


class DictTier:
    """A second tier in a dict (SnapshotTier); ``confirm``: what its put answers."""

    def __init__(self, confirm: bool = True) -> None:
        self.held: dict[tuple, tuple[list, list]] = {}
        self.asked: list[list[int]] = []
        self.puts: list[tuple] = []
        self.confirm = confirm

    def put(self, tokens, r, s) -> bool:
        self.puts.append(tuple(tokens.tolist()))
        self.held[tuple(tokens.tolist())] = ([x.copy() for x in r], [x.copy() for x in s])
        return self.confirm

    def fetch(self, tokens, lengths):
        self.asked.append(list(lengths))
        for n in lengths:
            entry = self.held.get(tuple(tokens[:n].tolist()))
            if entry is not None:
                return n, entry[0], entry[1]
        return None

    def stats(self):
        return {"damaged": 0, "errors": 0}


def test_second_tier_write_through_and_fetch(rc):
    """Every new save goes to the tier at once; a memory miss finds it there and promotes it."""
    cache = make_cache(rc)
    pc = PrefixCache(cache, 1 * snapshot_bytes(), block_size=4)
    tier = pc._tier = DictTier()   # noqa: SLF001 - a test tier put in place of the store's
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    serve(rc, cache, pc, a)   # saves 4, 8, 9 into one slot: each evicts the one before
    assert tier.puts == [tuple(a[:4]), tuple(a[:8]), tuple(a)]   # written through, once each
    assert pc.stats()["store_spills"] == 0 and pc.match(a + [10]) == 9
    cache.seq_rm(0, -1, -1)
    # a prompt that leaves a after 6: memory has nothing; the tier is asked for the junction 6
    # and the grid point 4, longest first, and has 4
    assert pc.restore(0, a[:6] + [0]) == 4
    assert tier.asked == [[8, 4], [6, 4]]   # (a's own restore asked for its grid, and missed)
    assert_state_of(cache, 0, a[:4])
    stats = pc.stats()
    assert (stats["store_hits"], stats["store_tokens_restored"], stats["store_lookups"]) == (1, 4, 2)
    assert pc.match(a[:4] + [0]) == 4   # promoted into memory


def test_second_tier_gets_unconfirmed_writes_again_on_eviction(rc):
    """A write the tier did not confirm (down, or had it already) is offered again when evicted."""
    cache = make_cache(rc)
    pc = PrefixCache(cache, 1 * snapshot_bytes(), block_size=4)
    tier = pc._tier = DictTier(confirm=False)   # noqa: SLF001 - a test tier put in place of the store's
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    serve(rc, cache, pc, a)
    assert tier.puts == [tuple(a[:4]), tuple(a[:4]), tuple(a[:8]), tuple(a[:8]), tuple(a)]
    assert pc.stats()["store_spills"] == 2 and pc.stats()["store_puts"] == 5


def test_exported_from_the_package():
    assert recurrent_cache.PrefixCache is PrefixCache
    assert "PrefixCache" in recurrent_cache.__all__


def test_a_snapshot_being_restored_is_never_evicted(rc):
    """Eviction skips a pinned snapshot (restore pins the one it copies) and takes the next lowest."""
    cache = make_cache(rc)
    pc = PrefixCache(cache, 2 * snapshot_bytes(), block_size=100)
    serve(rc, cache, pc, [1, 2, 3])          # an "end" snapshot of 3 tokens: the lowest priority
    serve(rc, cache, pc, [5, 6, 7, 8])
    lowest = pc._root.tails[np.array([1, 2, 3], "<i4").tobytes()]   # noqa: SLF001 - the trie's node
    lowest.pinned = True
    serve(rc, cache, pc, [9, 9, 9, 9, 9])    # worth more than both: evicts one
    assert pc.match([1, 2, 3, 0]) == 3 and pc.match([5, 6, 7, 8, 0]) == 0
    lowest.pinned = False
    serve(rc, cache, pc, [4] * 6)
    assert pc.match([1, 2, 3, 0]) == 0


def test_second_tier_rows_that_do_not_fit_are_a_miss(rc):
    cache = make_cache(rc)
    pc = PrefixCache(cache, 1 * snapshot_bytes(), block_size=4)
    tier = pc._tier = DictTier()   # noqa: SLF001 - a test tier put in place of the store's
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    serve(rc, cache, pc, a)
    r, s = tier.held[tuple(a[:4])]
    tier.held[tuple(a[:4])] = (r[:1], s)           # a damaged entry: a layer missing
    cache.seq_rm(0, -1, -1)
    assert pc.restore(0, a[:6] + [0]) == 0 and cache.cell(0)[2] == -1
    tier.held[tuple(a[:4])] = ([x.astype(np.float64) for x in r], s)   # rows of the wrong size
    assert pc.restore(0, a[:6] + [0]) == 0
    assert pc.stats()["store_hits"] == 0 and len(pc) == 1


def test_a_snapshot_no_longer_used_ages_out(rc):
    """Refused newcomers raise L as if let in and evicted at once, so a much-used junction that
    traffic has left behind is eventually replaced (recency), not kept forever."""
    cache = make_cache(rc)
    pc = PrefixCache(cache, 1 * snapshot_bytes(), block_size=100)
    system = list(range(1, 9))
    serve(rc, cache, pc, system + [50])
    for k in range(5):      # the snapshot at 9 tokens is restored five times
        assert serve(rc, cache, pc, system + [50, 60 + k])[0] == 9
        assert pc.stats()["rejected"] == k + 1     # each 10-token end is refused: 9 is worth more
    for k in range(200):    # new traffic, unrelated: refused at first, then let in
        serve(rc, cache, pc, [1000 + k, 7, 7, 7, 7, 7, 7, 7, 7])
        if pc.match(system + [50, 0]) == 0:
            break
    assert pc.match(system + [50, 0]) == 0 and 0 < k < 200   # refused at least once, then in
    assert pc.stats()["evictions"] == 1 and pc.stats()["rejected"] >= 5 + k
