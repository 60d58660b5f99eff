"""Issue 28's attack on the hybrid memory: a storage failing at every call of every operation, torch
rows of every flavour given to ``seq_restore`` on both paths, and ``state_write_into`` targets that
share one byte (the first or the last) with any tensor of the memory.

After a refused call the memory equals a twin that never saw it: both halves' cells, every K, V, r
and s row, the rollback reach of every sequence and the state bytes.  After a storage failure part-way
it is either that, or broken: every later call raises ``BrokenCacheError`` (the storage's exception
chained) until ``clear()`` gives a clean memory again — never one serving rows that are not its twin's.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache.hybrid import HybridCache
from recurrent_cache.hybrid_prefix import HybridPrefixCache

from hybrid_model import Histories, assert_holds_its_history, decode, same, snapshot
from storage_doubles import GAP, ArenaStorage, DeviceOutOfMemory, FailingStorage, chain, strike

N_SEQ = 4


def new_cache(storage: Any, engine: str = "compiled") -> HybridCache:
    return HybridCache(4, attn_layers=[1, 3], recr_layers=[0, 3], n_embd_k=3, n_embd_v=5, n_embd_r=2, n_embd_s=4,
                       kv_size=24, n_seq_max=N_SEQ, dtype_k="f32", dtype_v="f32", n_rollback=2, engine=engine,
                       storage=storage)


def everything(cache: HybridCache) -> tuple[Any, ...]:
    """``snapshot`` (cells and rows of both halves) with what it leaves out: how far each sequence
    can roll back (the recurrent history) and the state bytes."""
    return snapshot(cache) + ([cache.seq_rollback_min(s) for s in range(N_SEQ)], cache.state_write())


def alike(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return same(a[:-2], b[:-2]) and a[-2:] == b[-2:]


# -- a storage failing at every call of every operation ------------------------------------------

@dataclass
class Run:
    cache: HybridCache
    prefix: HybridPrefixCache
    histories: Histories = field(default_factory=lambda: Histories(N_SEQ))
    kept: dict[str, Any] = field(default_factory=dict)


def new_run(storage: Any) -> Run:
    cache = new_cache(storage)
    return Run(cache, HybridPrefixCache(cache, max_bytes=1 << 16, block_size=2))


def tokens_of(run: Run, seq: int) -> list[int]:
    return list(run.histories.of_seq[seq])


def restore_elsewhere(run: Run) -> None:
    state = run.kept["rows"]
    run.cache.seq_restore(3, state.pos, state.k, state.v, state.r, state.s)
    run.histories.copy(2, 3)


def read_into_3(run: Run) -> None:
    run.cache.state_read(run.kept["blob"], 3)
    run.histories.copy(2, 3)


def forget(run: Run, seq: int) -> None:
    run.cache.seq_rm(seq)
    run.histories.forget(seq)


def prefix_restore(run: Run) -> None:
    if run.prefix.restore(3, tokens_of(run, 0) + [1]):
        run.histories.copy(0, 3)


def rollback(run: Run) -> None:
    p0 = run.cache.seq_pos_max(0) - 1
    assert run.cache.seq_rm(0, p0, -1)
    run.histories.keep_before(0, p0)


def fork(run: Run) -> None:
    run.cache.seq_cp(0, 2)
    run.histories.copy(0, 2)


def keep_0(run: Run) -> None:
    run.cache.seq_keep(0)
    for seq in range(1, N_SEQ):
        run.histories.forget(seq)


def clear(run: Run) -> None:
    run.cache.clear()
    run.histories = Histories(N_SEQ)


# The script: every public operation of the memory and its prefix cache, one call each (a decode: one
# ubatch, so that a failure leaves no earlier ubatch applied).
STEPS: list[tuple[str, Callable[[Run], Any]]] = [
    ("decode 0 and 1", lambda run: decode(run.cache, run.histories, {0: [1, 2, 3], 1: [4, 5, 6]})),
    ("seq_cp", fork),
    ("decode the fork", lambda run: decode(run.cache, run.histories, {2: [7]})),
    ("decode with steps", lambda run: decode(run.cache, run.histories, {0: [8, 9, 10]})),
    ("rollback", rollback),
    ("seq_add", lambda run: run.cache.seq_add(1, -1, -1, 0)),
    ("seq_div", lambda run: run.cache.seq_div(1, 0, -1, 1)),
    ("kv_reset_shift", lambda run: run.cache.kv_reset_shift()),
    ("state_write", lambda run: run.kept.__setitem__("blob", run.cache.state_write(2))),
    ("state_write_into", lambda run: run.cache.state_write_into(bytearray(run.cache.state_size()))),
    ("state_write_into a file", lambda run: run.cache.state_write_into(io.BytesIO())),
    ("state_read", read_into_3),
    ("seq_state", lambda run: run.kept.__setitem__("rows", run.cache.seq_state(2))),
    ("seq_rm", lambda run: forget(run, 3)),
    ("seq_restore", restore_elsewhere),
    ("decode after a restore", lambda run: decode(run.cache, run.histories, {3: [11, 12], 2: [13, 14]})),
    ("prefix save", lambda run: run.prefix.save(0, tokens_of(run, 0))),
    ("seq_rm for the prefix", lambda run: forget(run, 3)),
    ("prefix restore", prefix_restore),
    ("whole state_read", lambda run: run.cache.state_read(run.cache.state_write())),
    ("seq_keep", keep_0),
    ("clear", clear),
    ("decode after clear", lambda run: decode(run.cache, run.histories, {1: [15, 16]})),
]


def replay(run: Run, upto: int) -> None:
    for _, step in STEPS[:upto]:
        step(run)


def calls_of_each_step() -> list[int]:
    storage = FailingStorage()
    run = new_run(storage)
    counts = []
    for _, step in STEPS:
        storage.arm(None)
        step(run)
        counts.append(storage.calls)
    assert_holds_its_history(run.cache, run.histories)
    return counts


CALLS = calls_of_each_step()
# "decode 0 and 1", calls 1 and 2: the KV half takes the ubatch, then the recurrent half's apply fails (its step
# scratch not allocated): the memory breaks (it kept the KV half applied alone before HybridState.apply's fix)
ATTACKS = [pytest.param(i, n, id=f"{STEPS[i][0]}-call{n}")
           for i, count in enumerate(CALLS) for n in range(1, count + 1)]


def test_the_script_reaches_the_storage_from_every_kind_of_operation():
    assert len(ATTACKS) >= 40
    touched = {name for (name, _), count in zip(STEPS, CALLS) if count}
    assert {"seq_restore", "state_read", "whole state_read", "seq_state", "state_write", "clear",
            "prefix restore", "decode the fork"} <= touched


def every_call_refuses(run: Run) -> None:
    cache, state = run.cache, run.kept.get("rows")
    probes: list[Callable[[], Any]] = [
        lambda: cache.init_batch(rc.Batch(token=[1], seq_id=[1])),
        lambda: cache.seq_rm(0), lambda: cache.seq_cp(0, 1), lambda: cache.seq_keep(0),
        lambda: cache.seq_add(0, 0, -1, 1), lambda: cache.seq_div(0, 0, -1, 2), lambda: cache.kv_reset_shift(),
        lambda: cache.seq_pos_min(0), lambda: cache.seq_pos_max(0), lambda: cache.seq_state(0),
        lambda: cache.state_write(), lambda: cache.state_write(0), lambda: cache.state_size(),
        lambda: cache.state_write_into(bytearray(1 << 14)), lambda: cache.state_write_into(io.BytesIO()),
        lambda: cache.state_read(run.kept.get("blob", b""), 3), lambda: cache.check(),
        lambda: cache.kv_cell(0), lambda: cache.kv_cells(), lambda: cache.seq_kv_cells(0),
        lambda: cache.kv_shifts(), lambda: run.prefix.save(0, [1]),
    ]
    if state is not None:
        probes.append(lambda: cache.seq_restore(3, state.pos, state.k, state.v, state.r, state.s))
    for k, probe in enumerate(probes):
        try:
            probe()
        except rc.BrokenCacheError as exc:
            assert "the cache is broken" in str(exc), exc
            assert any(isinstance(e, (DeviceOutOfMemory, MemoryError)) for e in chain(exc.__cause__)), exc
        except Exception as exc:
            pytest.fail(f"probe {k} of a broken memory: {type(exc).__name__}: {exc}")
        else:
            pytest.fail(f"probe {k} was served by a broken memory")


@pytest.mark.parametrize(("index", "n"), ATTACKS)
def test_a_storage_failing_mid_call_leaves_the_memory_as_it_was_or_broken(index, n):
    attacked, twin, failure = strike(new_run, STEPS, index, n)
    name, step = STEPS[index]
    if isinstance(failure, rc.BrokenCacheError):
        every_call_refuses(attacked)
        clear(attacked)
        clear(twin)
        assert alike(everything(attacked.cache), everything(twin.cache)), f"{name}: clear() left rows"
        for run in (attacked, twin):
            decode(run.cache, run.histories, {0: [1, 2], 1: [3]})
        assert alike(everything(attacked.cache), everything(twin.cache))
        assert_holds_its_history(attacked.cache, attacked.histories)
        return
    if isinstance(failure, (DeviceOutOfMemory, MemoryError)):   # raised before anything changed
        assert alike(everything(attacked.cache), everything(twin.cache)), f"{name}: not as it was"
        attacked.cache.check()
        return
    if failure is not None:
        raise failure
    step(twin)   # the failure hit nothing the call needed: the call must have done its work
    assert alike(everything(attacked.cache), everything(twin.cache)), f"{name}: a swallowed failure changed it"


def test_a_broken_memory_stays_broken_when_clear_fails_too():
    storage = FailingStorage()
    run = new_run(storage)
    replay(run, 13)   # up to seq_state: sequence 2's rows are kept
    forget(run, 3)
    storage.arm(CALLS[14])   # the last storage call of seq_restore: the V rows' put
    with pytest.raises(rc.BrokenCacheError):
        restore_elsewhere(run)
    storage.arm(1)   # clear()'s first zeroing fails
    with pytest.raises(rc.BrokenCacheError):
        run.cache.clear()
    storage.arm(None)
    with pytest.raises(rc.BrokenCacheError):
        run.cache.seq_pos_max(0)
    run.cache.clear()
    run.cache.check()
    assert run.cache.kv_used == 0 and run.cache.seq_pos_max(0) == -1


def test_a_state_prepared_before_the_memory_broke_is_stale():
    storage = FailingStorage()
    run = new_run(storage)
    replay(run, 13)
    forget(run, 3)
    st = run.cache.init_batch(rc.Batch(token=[1], seq_id=[1]))
    storage.arm(CALLS[14])
    with pytest.raises(rc.BrokenCacheError):
        restore_elsewhere(run)
    storage.arm(None)
    with pytest.raises((rc.BrokenCacheError, rc.UsageError)):
        st.apply()


# -- torch rows of every flavour, on both paths ----------------------------------------------------

def torch_flavours() -> dict[str, Callable[[Any], Any]]:
    torch = pytest.importorskip("torch", reason="torch rows need torch")

    def inference(t: Any) -> Any:
        with torch.inference_mode():
            return t.clone()

    def strided(t: Any) -> Any:   # the same values, through a transposed (non-contiguous) tensor
        return t.transpose(1, 2).contiguous().transpose(1, 2)

    return {"sparse": lambda t: t.to_sparse(), "meta": lambda t: t.to("meta"),
            "requires_grad": lambda t: t.clone().requires_grad_(True), "inference": inference,
            "non-contiguous": strided}


REFUSED = {"sparse": "sparse", "meta": "meta"}
PATHS = ["host", "index"]


def torch_cache(path: str) -> tuple[HybridCache, Histories]:
    from recurrent_cache.storage import TorchStorage
    cache = new_cache(TorchStorage("cpu", host_access=path == "host"))
    histories = Histories(N_SEQ)
    decode(cache, histories, {0: [1, 2, 3], 1: [4, 5]})
    return cache, histories


@pytest.mark.needs_torch
@pytest.mark.parametrize("which", ["k", "v", "r"])
@pytest.mark.parametrize("flavour", ["sparse", "meta", "requires_grad", "inference", "non-contiguous"])
def test_seq_restore_of_torch_kv_rows_of_every_flavour_is_checked_alike_on_both_paths(flavour, which):
    make = torch_flavours()[flavour]
    outcomes = []
    for path in PATHS:
        cache, histories = torch_cache(path)
        state = cache.seq_state(0)
        rows = {"k": state.k, "v": state.v, "r": list(state.r)}
        if which == "r":
            rows["r"][-1] = make(rows["r"][-1][None, None])[0, 0]   # the last layer's row, flavoured as 3-D
        else:
            rows[which] = make(rows[which])
        before = everything(cache)
        try:
            cache.seq_restore(2, state.pos, rows["k"], rows["v"], rows["r"], state.s)
        except rc.ArgumentError as exc:
            assert flavour in REFUSED and REFUSED[flavour] in str(exc), exc
            assert alike(everything(cache), before), f"{path}: a refused restore changed the memory"
            outcomes.append(("refused", str(exc)))
            continue
        assert flavour not in REFUSED, f"{path}: a {flavour} row was taken"
        histories.copy(0, 2)
        assert_holds_its_history(cache, histories)
        cache.check()
        assert not any(t.requires_grad or t.grad_fn is not None for t in cache.kv_tensors)
        outcomes.append(("ok", everything(cache)))
    (host_kind, host_result), (index_kind, index_result) = outcomes
    assert host_kind == index_kind
    assert host_result == index_result if host_kind == "refused" else alike(host_result, index_result)


# -- state_write_into: a target sharing one byte with any tensor -----------------------------------

ARENAS = [("numpy", True, "compiled"), ("numpy", True, "reference"), ("torch", True, "compiled"),
          ("torch", True, "reference"), ("torch", False, "compiled")]


@pytest.mark.parametrize("framing", ["bare", "llama"])
@pytest.mark.parametrize(("kind", "host_access", "engine"), ARENAS,
                         ids=[f"{k}-{'host' if h else 'indices'}-{e}" for k, h, e in ARENAS])
def test_state_write_into_refuses_a_target_sharing_the_first_or_last_byte_of_any_tensor(kind, host_access, engine,
                                                                                        framing):
    storage = ArenaStorage(kind, host_access)
    cache = new_cache(storage, engine)
    decode(cache, Histories(N_SEQ), {0: [1], 1: [2], 2: [3]})
    extents = list(storage.extents)   # K, V, the recurrent rows, their history and scratch
    arch = "jamba" if framing == "llama" else None
    n = cache.state_size(framing=framing, arch=arch)
    assert n < GAP and len(extents) >= 4
    before = everything(cache)
    for begin, end in (extent for extent in extents if extent[0] < extent[1]):
        for target in (storage.arena[begin - n + 1:begin + 1], storage.arena[end - 1:end - 1 + n]):
            arena = storage.arena.copy()
            with pytest.raises(rc.ArgumentError, match="the target shares memory with the cache's state tensors"):
                cache.state_write_into(target, framing=framing, arch=arch)
            assert np.array_equal(storage.arena, arena), "bytes written before the target was refused"
    assert alike(everything(cache), before)
    free = storage.arena[storage.next_free:storage.next_free + n]
    assert cache.state_write_into(free, framing=framing, arch=arch) == n
    assert bytes(free) == cache.state_write(framing=framing, arch=arch)


# -- seq_restore's positions: the recurrent state sits at the last, so they must not go down ------

@pytest.mark.parametrize("pos", [[2, 1, 0], [0, 2, 1], [1, 1, 0]])
def test_seq_restore_refuses_positions_out_of_order_changing_nothing(pos):
    cache, twin = new_cache("numpy"), new_cache("numpy")
    for memory in (cache, twin):
        decode(memory, Histories(N_SEQ), {0: [1, 2, 3]})
    state = cache.seq_state(0)
    with pytest.raises(rc.ArgumentError, match="increasing order"):
        cache.seq_restore(1, pos, state.k, state.v, state.r, state.s)
    assert alike(everything(cache), everything(twin))
    cache.check()


def test_seq_restore_takes_repeated_positions_as_seq_div_leaves_them():
    cache, histories = new_cache("numpy"), Histories(N_SEQ)
    decode(cache, histories, {0: [1, 2, 3, 4]})
    cache.seq_div(0, 0, -1, 2)   # positions 0 0 1 1
    state = cache.seq_state(0)
    assert state.pos.tolist() == [0, 0, 1, 1]
    cache.seq_restore(1, state.pos, state.k, state.v, state.r, state.s)
    cache.check()
    restored = cache.seq_state(1)
    assert cache.seq_pos_max(1) == 1 and restored.pos.tolist() == [0, 0, 1, 1]
    assert np.array_equal(restored.k, state.k) and np.array_equal(restored.v, state.v)


@pytest.mark.needs_torch
@pytest.mark.parametrize("path", PATHS)
def test_a_memory_made_inside_inference_mode_serves_outside_it_and_inside(path):
    torch = pytest.importorskip("torch", reason="inference mode is torch's")
    from recurrent_cache.storage import TorchStorage
    with torch.inference_mode():   # a serving idiom: the model and its memory made under inference mode
        cache = new_cache(TorchStorage("cpu", host_access=path == "host"))
        histories = Histories(N_SEQ)
        decode(cache, histories, {0: [1, 2, 3]})
    assert not any(t.is_inference() for t in cache.kv_tensors)
    decode(cache, histories, {0: [4]})
    cache.seq_cp(0, 1)
    histories.copy(0, 1)
    decode(cache, histories, {1: [5], 0: [6]})
    state = cache.seq_state(1)
    cache.seq_restore(2, state.pos, state.k, state.v, state.r, state.s)
    histories.copy(1, 2)
    cache.state_read(cache.state_write(0), 3)
    histories.copy(0, 3)
    with torch.inference_mode():
        decode(cache, histories, {2: [7]})
        inside = cache.seq_state(2)
    decode(cache, histories, {2: [8]})
    assert inside.pos.tolist() == list(range(6))
    assert_holds_its_history(cache, histories)
    cache.check()
