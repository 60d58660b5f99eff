"""The attack on the last release, kept: storages that fail mid-call, targets that alias the cache,
and find_slot's restart boundary.

A storage fails at the N-th of its calls made by a public operation, for every N a scripted run of
every operation reaches.  After each failure the cache either equals a twin that never failed (its
state before the call: cells, rows, rollback history, state bytes) and stays usable, or it is
broken: every later call raises ``BrokenCacheError`` (the storage's exception chained) until
``clear()`` gives a clean cache again.  Never a cache that serves rows other than its twin's.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache import PrefixCache

from rows import assign, host
from storage_doubles import GAP, ArenaStorage, DeviceOutOfMemory, FailingStorage, strike


N_LAYER, N_EMBD_R, N_EMBD_S, SIZE, N_ROLLBACK = 2, 3, 4, 4, 2


@dataclass
class Run:
    """A cache, its prefix cache and the script's bookkeeping: the tokens each sequence holds, how many
    ubatches the last decode applied, the blobs and rows it carries between steps."""

    cache: rc.RecurrentCache
    prefix: PrefixCache
    tokens: dict[int, list[int]] = field(default_factory=dict)
    applied: int = 0
    kept: dict[str, Any] = field(default_factory=dict)


def new_run(storage: Any) -> Run:
    cache = rc.RecurrentCache(N_LAYER, N_EMBD_R, N_EMBD_S, n_seq_max=SIZE, n_rollback=N_ROLLBACK, storage=storage)
    return Run(cache, PrefixCache(cache, max_bytes=1 << 16, block_size=2))


def decode(run: Run, seqs: list[int], n: int, n_ubatch: int, limit: int | None = None) -> None:
    """n tokens for each of seqs, split in ubatches of n_ubatch; a model whose rows and step states
    are functions of the rows it is given and its tokens.  ``limit``: apply only that many ubatches."""
    cache = run.cache
    token, seq_id, pos = [], [], []
    for seq in seqs:
        start = cache.seq_pos_max(seq) + 1
        token += [7 * seq + start + j for j in range(n)]
        seq_id += [seq] * n
        pos += range(start, start + n)
    tokens = np.array(token, dtype=np.float64)
    st = cache.init_batch(rc.Batch(token=token, seq_id=seq_id, pos=pos), n_ubatch)
    run.applied = 0
    for ub in st:
        taken = tokens[np.asarray(ub.batch_index)].reshape(ub.n_seqs, ub.n_seq_tokens)
        for il in cache.layers:
            for kind in ("r", "s"):
                rows = getattr(st, kind)(il)
                old = host(rows).astype(np.float64)
                steps = getattr(st, f"{kind}_steps")(il)
                for j in range(steps.shape[1]):
                    assign(steps[:, j], (old * 5 + taken[:, j:j + 1] + il + j) % 241)
                assign(rows, (old * 3 + taken.sum(axis=1, keepdims=True) + il) % 251)
        run.applied += 1
        if limit is not None and run.applied == limit:
            break
    for seq, t in zip(seq_id, token):
        run.tokens.setdefault(seq, []).append(t)


def restore_elsewhere(run: Run) -> int:
    r_rows, s_rows = run.kept["rows"]
    return run.cache.seq_restore(3, run.cache.seq_pos_max(2), r_rows, s_rows)


# The script: every public operation, each a step of one call (a decode: one call per ubatch).
STEPS: list[tuple[str, Callable[[Run], Any]]] = [
    ("decode 0 and 1", lambda run: decode(run, [0, 1], 3, 2)),
    ("seq_cp", lambda run: run.cache.seq_cp(0, 2)),
    ("decode the fork", lambda run: decode(run, [2], 1, 8)),
    ("decode with steps", lambda run: decode(run, [0], 3, 8)),
    ("rollback", lambda run: run.cache.seq_rm(0, run.cache.seq_pos_max(0) - 1, -1)),
    ("rollback_min", lambda run: run.cache.seq_rollback_min(1)),
    ("seq_add", lambda run: run.cache.seq_add(1, 0, -1, 2)),
    ("seq_div", lambda run: run.cache.seq_div(1, 0, -1, 2)),
    ("history", lambda run: run.cache.memory_core.history()),
    ("state_write", lambda run: run.kept.__setitem__("blob", run.cache.state_write(2))),
    ("state_write_into", lambda run: run.cache.state_write_into(bytearray(run.cache.state_size()))),
    ("state_write_into a file", lambda run: run.cache.state_write_into(io.BytesIO())),
    ("state_read", lambda run: run.cache.state_read(run.kept["blob"], 3)),
    ("seq_state", lambda run: run.kept.__setitem__("rows", run.cache.seq_state(2))),
    ("seq_rm", lambda run: run.cache.seq_rm(3)),
    ("seq_restore", restore_elsewhere),
    ("decode after a restore", lambda run: decode(run, [3, 2], 2, 8)),
    ("prefix save", lambda run: run.prefix.save(0, run.tokens[0][:run.cache.seq_pos_max(0) + 1])),
    ("seq_rm for the prefix", lambda run: run.cache.seq_rm(3)),
    ("prefix restore", lambda run: run.prefix.restore(3, run.tokens[0][:run.cache.seq_pos_max(0) + 1] + [1])),
    ("whole state_read", lambda run: run.cache.state_read(run.cache.state_write())),
    ("seq_keep", lambda run: run.cache.seq_keep(0)),
    ("clear", lambda run: run.cache.clear()),
    ("decode after clear", lambda run: decode(run, [1], 2, 1)),
]


def snapshot(cache: rc.RecurrentCache) -> tuple[Any, ...]:
    """Everything a cache serves: cells, head, used, every row's bytes (even of empty cells), the held
    history states (a slot whose tag is 0 holds nothing a rollback reaches), the state bytes."""
    tags, history = cache.memory_core.history()
    held = [(int(c), int(j), int(tags[c, j]), [h[c, j].tobytes() for h in history]) for c, j in np.argwhere(tags)]
    return ([cache.cell(i) for i in range(cache.size)], cache.head, cache.used,
            [cache.storage.to_host(tensor).tobytes() for tensor in cache.tensors], held, cache.state_write())


def calls_of_each_step() -> tuple[list[int], set[str]]:
    """How many storage calls each step makes in a run without failures, and their methods."""
    storage = FailingStorage()
    run = new_run(storage)
    counts, kinds = [], set()
    for _, step in STEPS:
        storage.arm(None)
        step(run)
        counts.append(storage.calls)
        kinds |= storage.kinds
    return counts, kinds


CALLS, KINDS = calls_of_each_step()
ATTACKS = [pytest.param(i, n, id=f"{STEPS[i][0]}-call{n}") for i, count in enumerate(CALLS) for n in
           range(1, count + 1)]


def test_the_script_makes_storage_calls_of_every_kind():
    assert KINDS == {"allocate", "take", "put", "zero", "stack", "to_host", "from_host"}
    assert len(ATTACKS) >= 100 and sum(1 for count in CALLS if count) >= 15


def every_call_refuses(run: Run) -> None:
    cache, blob = run.cache, bytes(run.kept.get("blob", b""))
    probes: list[Callable[[], Any]] = [
        lambda: cache.init_batch(rc.Batch(token=[1], seq_id=[1])),
        lambda: cache.seq_rm(0), lambda: cache.seq_cp(0, 1), lambda: cache.seq_keep(0),
        lambda: cache.seq_add(0, 0, -1, 1), lambda: cache.seq_div(0, 0, -1, 2),
        lambda: cache.seq_pos_min(0), lambda: cache.seq_pos_max(0), lambda: cache.seq_cell(0),
        lambda: cache.seq_row(0), lambda: cache.seq_state(0), lambda: cache.seq_rollback_min(0),
        lambda: cache.seq_restore(3, 0, [np.zeros(N_EMBD_R, np.float32)] * N_LAYER,
                                  [np.zeros(N_EMBD_S, np.float32)] * N_LAYER),
        lambda: cache.state_size(), lambda: cache.state_write(), lambda: cache.state_write(0),
        lambda: cache.state_write_into(bytearray(1 << 12)), lambda: cache.state_write_into(io.BytesIO()),
        lambda: cache.state_read(blob, 3), lambda: cache.check(), lambda: cache.cell(0),
        lambda: cache.memory_core.history(),
        lambda: run.prefix.save(0, [1]), lambda: run.prefix.restore(3, [1, 2, 3]),
    ]
    for probe in probes:
        with pytest.raises(rc.BrokenCacheError, match="the cache is broken") as info:
            probe()
        assert isinstance(info.value.__cause__, DeviceOutOfMemory)


@pytest.mark.parametrize(("index", "n"), ATTACKS)
def test_a_storage_failing_mid_call_leaves_the_cache_as_it_was_or_broken(index, n):
    attacked, twin, failure = strike(new_run, STEPS, index, n)
    name, step = STEPS[index]
    if isinstance(failure, rc.BrokenCacheError):
        every_call_refuses(attacked)
        # clear() gives a clean, usable cache: all rows zero, no cell, no history
        attacked.cache.clear()
        twin.cache.clear()
        assert snapshot(attacked.cache) == snapshot(twin.cache)
        attacked.tokens.clear()
        twin.tokens.clear()
        decode(attacked, [0, 1], 3, 2)
        decode(twin, [0, 1], 3, 2)
        assert snapshot(attacked.cache) == snapshot(twin.cache)
        return
    if isinstance(failure, (DeviceOutOfMemory, MemoryError)):   # before anything changed (a decode's earlier
        # ubatches stay)
        if name.startswith("decode") and attacked.applied:
            twin_step = STEPS[index][1]
            assert twin_step is step
            # the twin applies the same ubatches as the attacked cache did before its failure
            limited = {"decode 0 and 1": ([0, 1], 3, 2), "decode after clear": ([1], 2, 1)}[name]
            decode(twin, *limited, limit=attacked.applied)
        assert snapshot(attacked.cache) == snapshot(twin.cache), f"{name}: not as it was"
        return
    if failure is not None:
        raise failure
    # the failure did not surface (it hit nothing the call needed): the call must have done its work
    step(twin)
    assert snapshot(attacked.cache) == snapshot(twin.cache), f"{name}: a swallowed failure changed the result"


def test_a_broken_cache_stays_broken_when_clear_fails_too():
    storage = FailingStorage()
    run = new_run(storage)
    decode(run, [0], 1, 1)
    run.cache.seq_cp(0, 1)
    storage.arm(1)   # the copy of the fork's row into its own cell
    with pytest.raises(rc.BrokenCacheError):
        decode(run, [1], 1, 1)
    storage.arm(1)   # the zeroing of clear() fails
    with pytest.raises(rc.BrokenCacheError):
        run.cache.clear()
    storage.arm(None)
    with pytest.raises(rc.BrokenCacheError):
        run.cache.check()
    run.cache.clear()
    run.cache.check()
    assert run.cache.used == 0


# -- state_write_into's target may share no byte with the cache ---------------------------------

ARENAS = [("numpy", True, "compiled"), ("numpy", True, "reference"), ("numpy", False, "compiled"),
          ("torch", True, "compiled"), ("torch", True, "reference"), ("torch", False, "compiled")]


@pytest.mark.parametrize("framing", ["bare", "llama"])
@pytest.mark.parametrize(("kind", "host_access", "engine"), ARENAS,
                         ids=[f"{k}-{'host' if h else 'indices'}-{e}" for k, h, e in ARENAS])
def test_state_write_into_refuses_a_target_sharing_one_byte_with_any_tensor_of_the_cache(kind, host_access, engine,
                                                                                         framing):
    storage = ArenaStorage(kind, host_access)
    cache = rc.RecurrentCache(N_LAYER, N_EMBD_R, N_EMBD_S, n_seq_max=SIZE, n_rollback=N_ROLLBACK, storage=storage,
                              engine=engine)
    extents = list(storage.extents)   # the cache's tensors (a prefix cache allocates its own pool)
    run = Run(cache, PrefixCache(cache, max_bytes=1 << 16))
    decode(run, [0, 1, 2], 1, 8)   # one token a sequence: no step scratch grows, every tensor stays the cache's
    arch = "mamba" if framing == "llama" else None
    n = cache.state_size(framing=framing, arch=arch)
    assert n < GAP and len(extents) >= 2   # r and s at least (the compiled engine: history, steps too)
    before = cache.state_write()
    for begin, end in (extent for extent in extents if extent[0] < extent[1]):   # an empty tensor owns no byte
        for target in (storage.arena[begin - n + 1:begin + 1], storage.arena[end - 1:end - 1 + n]):
            arena = storage.arena.copy()
            with pytest.raises(rc.ArgumentError, match="the target shares memory with the cache's state tensors"):
                cache.state_write_into(target, framing=framing, arch=arch)
            assert np.array_equal(storage.arena, arena), "bytes written before the target was refused"
    assert cache.state_write() == before
    free = storage.arena[storage.next_free:storage.next_free + n]   # the arena's free tail: accepted
    assert cache.state_write_into(free, framing=framing, arch=arch) == n


# -- find_slot's restart: exactly when head > used + 2 * n_tokens ---------------------------------

def placed_after_a_lone_sequence_at(engine: str, head: int, n_tokens: int) -> tuple[Any, ...]:
    """A cache whose one sequence sits in cell ``head`` (head there, used 1) takes a newcomer of
    n_tokens tokens in one ubatch: where it goes, and the whole cell table after."""
    cache = rc.RecurrentCache(1, 1, 1, n_seq_max=head + 2, engine=engine)
    newcomer = head + 1
    # seqs 0..head at pos 0: the groups go from the end, seq head - c into cell c
    for _ in cache.init_batch(rc.Batch(token=[0] * (head + 1), pos=[0] * (head + 1), seq_id=list(range(head + 1)))):
        pass
    for seq in range(1, head + 1):
        assert cache.seq_rm(seq)
    for _ in cache.init_batch(rc.Batch(token=[0], pos=[1], seq_id=[0])):
        pass
    assert (cache.seq_cell(0), cache.head, cache.used) == (head, head, 1)
    st = cache.init_batch(rc.Batch(token=[0] * n_tokens, pos=list(range(n_tokens)), seq_id=[newcomer] * n_tokens))
    st.apply()
    return (st.head, st.n_kv, st.copy_src.tolist(), st.zero.tolist(), cache.seq_cell(newcomer),
            [cache.cell(i) for i in range(cache.size)])


@pytest.mark.parametrize("n_tokens", [1, 2, 3])
@pytest.mark.parametrize("past", [-1, 0, 1], ids=["below", "at", "above"])
def test_find_slot_restarts_its_search_only_when_head_is_past_used_plus_twice_the_ubatch(n_tokens, past):
    head = 1 + 2 * n_tokens + past   # used is 1
    compiled = placed_after_a_lone_sequence_at("compiled", head, n_tokens)
    assert compiled == placed_after_a_lone_sequence_at("reference", head, n_tokens)
    # restarted: the first free cell from 0; else the search goes on from head, whose cell is taken
    assert compiled[4] == (0 if past > 0 else head + 1)
