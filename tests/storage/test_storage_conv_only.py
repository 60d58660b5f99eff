"""Every storage holds what numpy holds for a conv-only recurrent state (``n_embd_s = 0``, LFM2's).

``test_storage``'s lockstep scripts — batches with step states, every sequence operation, rollbacks,
state bytes, seq_state / seq_restore, prefix-cache saves and restores — on caches whose s rows are 0
values wide: on the index path (no host view; moves carried out by ``take`` / ``put`` / ``zero``) a
zero-width tensor is moved as the others are, and every state byte matches numpy's.
"""

from __future__ import annotations

import pytest

from recurrent_cache.storage import NumpyStorage

from test_storage import ENGINE_PARAMS, STORAGE_PARAMS, STORAGES, run


@pytest.mark.parametrize("layers", [None, (0, 2)], ids=["all-layers", "filtered"])
@pytest.mark.parametrize("n_rollback", [0, 3])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("storage", STORAGE_PARAMS)
def test_every_storage_holds_what_numpy_holds(storage, dtype, n_rollback, layers):
    for seed in range(3):
        lock = run([STORAGES[storage]()], dtype, n_rollback, layers, seed, n_embd_s=0)
        assert lock.steps >= 40
        assert all(tensor.shape[2] == 0 for cache in lock.caches for tensor in cache.tensors[1:])


@pytest.mark.parametrize(("storage", "engine"), ENGINE_PARAMS)
def test_histories_read_only_at_the_end_match_too(storage, engine):
    for seed in range(3):
        made = NumpyStorage() if storage == "numpy" else STORAGES[storage]()
        lock = run([made], "f32", 3, None, seed, engine=engine, history_every_step=False, n_embd_s=0)
        lock.check(history=True)
        assert lock.steps >= 40
