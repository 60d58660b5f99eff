"""Churn: continuous batching with admissions and removals, timed operation by operation.

A server with 64 slots.  Each step, for every slot: a running sequence
finishes (``seq_rm``, p = 1/16), is replaced by a fork of another running one
(``seq_cp``, p = 1/16) or gets one decode token; a free slot admits a new
prompt of 1..32 tokens with p = 1/2.  Every 50th step starts with a
``seq_keep`` of one running sequence (a beam-search pick: every other slot
empties and is re-admitted later).  The step ends with one decode batch
holding the admissions' prompts and the decode tokens.

The schedule is planned once on a compiled shadow cache (so positions are
right and every Batch is built before any clock starts), then replayed on a
fresh cache of each implementation; each operation is timed on its own.
"""

from __future__ import annotations

import functools
import random
import time
from collections import defaultdict
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import numpy as np

import recurrent_cache as compiled

from .measure import Stats, Timing, expect, gc_paused, repeats_within
from .workloads import decode, make_cache

SLOTS = 64
P_FINISH = P_FORK = 1 / 16
P_ADMIT = 1 / 2
KEEP_EVERY = 50
MAX_PROMPT = 32

KINDS = ("seq_rm", "seq_cp", "seq_keep", "decode batch")
ALL_OPS = "all operations"


@dataclass(frozen=True)
class Op:
    kind: str     # one of KINDS
    args: tuple   # the method's arguments; a Batch for "decode batch"


def apply(impl: ModuleType, cache: Any, op: Op) -> None:
    if op.kind == "decode batch":
        decode(impl, cache, *op.args)
    else:
        getattr(cache, op.kind)(*op.args)


def bind(impl: ModuleType, cache: Any, op: Op) -> Callable[[], object]:
    """``op`` as a ready-to-call function, so the timed call has no dispatch in it."""
    if op.kind == "decode batch":
        return functools.partial(decode, impl, cache, *op.args)
    return functools.partial(getattr(cache, op.kind), *op.args)


def plan_step(shadow: Any, rng: random.Random, step: int) -> list[Op]:
    """The operations of one step, applied to ``shadow`` as they are planned."""
    ops = []
    if step % KEEP_EVERY == KEEP_EVERY - 1:
        running = [seq for seq in range(SLOTS) if shadow.seq_pos_max(seq) >= 0]
        if running:
            ops.append(Op("seq_keep", (rng.choice(running),)))
            apply(compiled, shadow, ops[-1])
    seq_ids: list[int] = []
    positions: list[int] = []
    for seq in range(SLOTS):
        start = shadow.seq_pos_max(seq) + 1
        roll = rng.random()
        if start == 0:
            if roll < P_ADMIT:
                length = rng.randint(1, MAX_PROMPT)
                seq_ids += [seq] * length
                positions += range(length)
            continue
        if roll < P_FINISH:
            ops.append(Op("seq_rm", (seq, -1, -1)))
        elif roll < P_FINISH + P_FORK:
            donors = [d for d in range(SLOTS) if d != seq and shadow.seq_pos_max(d) >= 0]
            if not donors:
                continue
            ops.append(Op("seq_cp", (rng.choice(donors), seq, -1, -1)))
        else:
            seq_ids.append(seq)
            positions.append(start)
            continue
        apply(compiled, shadow, ops[-1])
    if seq_ids:
        batch = compiled.Batch(token=np.zeros(len(seq_ids), dtype=np.int32), pos=positions, seq_id=seq_ids)
        ops.append(Op("decode batch", (batch,)))
        apply(compiled, shadow, ops[-1])
    return ops


@dataclass(frozen=True)
class Schedule:
    ops: list[Op]
    final_positions: list[int]   # seq_pos_max of every slot after the whole schedule


def plan(size: int, n_steps: int, seed: int = 0) -> Schedule:
    shadow = make_cache(compiled, SLOTS, size)
    rng = random.Random(seed)
    ops = [op for step in range(n_steps) for op in plan_step(shadow, rng, step)]
    return Schedule(ops, [shadow.seq_pos_max(seq) for seq in range(SLOTS)])


def replay_ns(impl: ModuleType, size: int, schedule: Schedule) -> dict[str, list[int]]:
    """Replay the schedule on a fresh cache; the ns of each operation, by kind."""
    cache = make_cache(impl, SLOTS, size)
    calls = [(op.kind, bind(impl, cache, op)) for op in schedule.ops]
    times: dict[str, list[int]] = defaultdict(list)
    clock = time.perf_counter_ns
    with gc_paused():
        for kind, call in calls:
            t0 = clock()
            call()
            times[kind].append(clock() - t0)
    cache.check()
    expect([cache.seq_pos_max(seq) for seq in range(SLOTS)] == schedule.final_positions,
           "the replay did not end where the plan did")
    return times


def mean_us(samples_ns: list[int]) -> float:
    return sum(samples_ns) / len(samples_ns) / 1000


def measure_churn(impl: ModuleType, size: int, schedule: Schedule, timing: Timing) -> dict[str, Stats]:
    """Mean µs per operation of each kind (and of all operations) per replay, over the replays.

    The first replay is the warm-up; its duration sets the number of replays.
    """
    warm_up = replay_ns(impl, size, schedule)
    replays = [replay_ns(impl, size, schedule)
               for _ in range(repeats_within(timing, sum(map(sum, warm_up.values()))))]
    stats = {ALL_OPS: Stats.of([mean_us([t for ts in r.values() for t in ts]) for r in replays],
                               len(schedule.ops))}
    for kind in KINDS:
        if kind in warm_up:
            stats[kind] = Stats.of([mean_us(r[kind]) for r in replays], len(warm_up[kind]))
    return stats
