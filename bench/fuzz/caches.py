"""The caches the differential fuzzers read into: one per engine, in the same state."""

from __future__ import annotations

import numpy as np

import recurrent_cache
from recurrent_cache import Batch

ENGINES = ("compiled", "reference")


def populate(engine: str, config: tuple) -> recurrent_cache.RecurrentCache:
    """A cache with forks, a removal and distinct rows (exact in every dtype) on ``engine``.

    ``config`` is ``(n_layer, n_embd_r, n_embd_s, size, dtype_r, dtype_s)``.
    """
    n_layer, n_embd_r, n_embd_s, size, dtype_r, dtype_s = config
    cache = recurrent_cache.RecurrentCache(n_layer, n_embd_r, n_embd_s, n_seq_max=size, dtype_r=dtype_r,
                                           dtype_s=dtype_s, engine=engine)
    for seq in range(size):
        for _ in cache.init_batch(Batch(token=[1, 2], pos=[0, 1], seq_id=[seq, seq])):
            pass
    cache.seq_rm(1 % size, -1, -1)
    cache.seq_cp(size - 1, 0, -1, -1)
    for k, tensor in enumerate(list(cache.r) + list(cache.s)):
        tensor[...] = ((np.arange(tensor.size).reshape(tensor.shape) + 5 * k) % 23 - 11) / 4
    return cache


def snapshot(cache: recurrent_cache.RecurrentCache) -> tuple:
    """Everything a rejected read must leave as it was: cells, head, used, n, every tensor byte."""
    return (cache.head, cache.used, cache.n, [cache.cell(i) for i in range(cache.size)],
            [tensor.view("u1").tobytes() for tensor in list(cache.r) + list(cache.s)])
