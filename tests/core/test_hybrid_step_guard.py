"""The hybrid memory's guard on the compiled engine (``_hybrid_step.StepGuard``: one atomic exchange
instead of a ``threading.Lock``) keeps ``memory_state.ThreadGuard``'s rule: one thread at a time,
a second one refused with ``UsageError`` instead of waiting, and no call left inside."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from recurrent_cache import Batch
from recurrent_cache.errors import UsageError
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


class CallingBack(Batch):
    """A batch whose positions, read inside ``init_batch`` (both guards held), run ``on_read`` first."""

    __slots__ = ()
    on_read: list = []

    @property   # type: ignore[override]
    def pos(self):
        for call in self.on_read:
            call()
        return Batch.pos.__get__(self)

    @pos.setter
    def pos(self, value):
        Batch.pos.__set__(self, value)


def test_a_second_thread_is_refused_while_a_step_is_inside_the_hybrid_and_served_after_it():
    cache = HybridCache(2, attn_layers=[0], recr_layers=[1], n_embd_k=4, n_embd_v=4, n_embd_r=4, n_embd_s=4,
                        kv_size=64, n_seq_max=4, engine="compiled")
    for _ in cache.init_batch(Batch(token=np.zeros(3, np.int32), seq_id=np.zeros(3, np.int32),
                                    pos=np.arange(3, dtype=np.int32))):
        pass
    outcome: list[object] = []

    def other_thread_clears() -> None:
        def clear() -> None:
            try:
                cache.clear()
                outcome.append("cleared")
            except UsageError as exc:
                outcome.append(exc)
        thread = threading.Thread(target=clear)
        thread.start()
        thread.join()

    batch = CallingBack(token=np.zeros(1, np.int32), seq_id=np.zeros(1, np.int32), pos=np.full(1, 3, np.int32))
    CallingBack.on_read[:] = [other_thread_clears]
    try:
        state = cache.init_batch(batch)
    finally:
        CallingBack.on_read[:] = []
    assert outcome and all(isinstance(exc, UsageError) and "another thread" in str(exc) for exc in outcome), outcome
    assert cache.seq_pos_max(0) == 2            # the refused clear changed nothing
    assert state.apply() and cache.seq_pos_max(0) == 3
    cache.check()
    cache.clear()                               # nothing is left inside: served from any thread now
    assert cache.seq_pos_max(0) == -1
