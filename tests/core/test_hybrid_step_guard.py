"""The hybrid memory's guard on the compiled engine (``_hybrid_step.StepGuard``: one atomic exchange
instead of a ``threading.Lock``) keeps ``memory_state.ThreadGuard``'s rule: one thread at a time,
a second one refused with ``UsageError`` instead of waiting, and no call left inside."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from recurrent_cache import Batch
from recurrent_cache.errors import PositionError, UsageError
from recurrent_cache.hybrid import HybridCache

_hybrid_step = pytest.importorskip("recurrent_cache._hybrid_step", reason="the compiled engine is not built")


def test_the_guard_refuses_a_second_entry_from_any_thread_until_it_is_left():
    guard = _hybrid_step.StepGuard()
    guard.enter()
    with pytest.raises(UsageError, match="another thread"):
        guard.enter()
    refused: list[BaseException] = []

    def other() -> None:
        try:
            guard.enter()
        except UsageError as exc:
            refused.append(exc)
    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert len(refused) == 1
    guard.leave()
    guard.enter()      # free again once left
    guard.leave()


def test_a_hybrid_shared_by_two_threads_refuses_instead_of_corrupting():
    cache = HybridCache(2, attn_layers=[0], recr_layers=[1], n_embd_k=4, n_embd_v=4, n_embd_r=4, n_embd_s=4,
                        kv_size=64 * 310, n_seq_max=64, engine="compiled")
    errors_seen: list[BaseException] = []
    start = threading.Barrier(2)

    def worker(first: int) -> None:
        start.wait()
        for step in range(300):
            seqs = np.arange(first, first + 32, dtype=np.int32)
            try:
                for _ in cache.init_batch(Batch(token=np.zeros(32, np.int32), seq_id=seqs,
                                                pos=np.full(32, step, np.int32))):
                    pass
                cache.seq_pos_max(first)
            except UsageError as exc:
                errors_seen.append(exc)
                return
            except PositionError:
                return   # the other thread's refused call left this thread's positions behind

    threads = [threading.Thread(target=worker, args=(first,)) for first in (0, 32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cache.check()      # whatever interleaving happened, both halves are intact and agree
    for exc in errors_seen:
        assert "another thread" in str(exc) or "changed after" in str(exc)
    # nothing is left inside: the memory takes a step again from this thread
    state = cache.init_batch(Batch(token=np.zeros(1, np.int32), seq_id=np.zeros(1, np.int32),
                                   pos=np.full(1, cache.seq_pos_max(0) + 1, np.int32)))
    assert state.apply()
