"""A state file given to the loader of the other kind says which function loads it.

'ggsq' files hold one sequence (``load_seq_file``), 'ggsn' files the whole cache
(``load_session_file``); each refuses the other's files with a ``StateError`` naming the right
function, and the cache stays as it was.
"""

from __future__ import annotations

import pytest

from recurrent_cache import load_seq_file, load_session_file, save_seq_file, save_session_file
from recurrent_cache.errors import StateError


def filled(rc):
    cache = rc.RecurrentCache(2, 3, 4, n_seq_max=2)
    for _ in cache.init_batch(rc.Batch(token=[1, 2, 3], seq_id=[0, 0, 1], pos=[0, 1, 0])):
        pass
    for k, array in enumerate(cache.r + cache.s):
        array[...] = k + 0.5
    return cache


def snapshot(cache):
    return [cache.cell(i) for i in range(cache.size)], cache.state_write()


@pytest.mark.parametrize("version", [3, 2])
def test_load_session_file_of_a_sequence_file_names_load_seq_file(rc, tmp_path, version):
    cache = filled(rc)
    path = tmp_path / "seq.ggsq"
    save_seq_file(path, cache, 0, [1, 2], version=version)
    before = snapshot(cache)
    with pytest.raises(StateError, match=f"'ggsq' version {version} file holds one sequence: .*"
                                         f"load_seq_file loads it, not load_session_file"):
        load_session_file(path, cache)
    assert snapshot(cache) == before
    assert list(load_seq_file(path, cache, 1)) == [1, 2]


def test_load_seq_file_of_a_session_file_names_load_session_file(rc, tmp_path):
    cache = filled(rc)
    path = tmp_path / "session.ggsn"
    save_session_file(path, cache, [1, 2, 3], "mamba")
    before = snapshot(cache)
    with pytest.raises(StateError, match="'ggsn' version 10 file holds the whole cache: .*"
                                         "load_session_file loads it, not load_seq_file"):
        load_seq_file(path, cache, 0)
    assert snapshot(cache) == before
    assert list(load_session_file(path, cache, arch="mamba")) == [1, 2, 3]
