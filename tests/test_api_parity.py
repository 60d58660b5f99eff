"""The compiled package and the reference expose the same public API, mechanically."""

import inspect

import pytest

import recurrent_cache
import recurrent_cache.cache
import recurrent_cache.reference as reference

# C-level handle, meaningless for the pure-Python implementation
CORE_ONLY = {"cell_table"}


def public_names(obj) -> set[str]:
    return {name for name in dir(obj) if not name.startswith("_")}


def make_state(module):
    cache = module.RecurrentCache(1, 2, 3, n_seq_max=2)
    return cache, cache.init_batch(recurrent_cache.Batch(token=[1, 2], seq_id=[0, 1], pos=[0, 0]))


def test_both_implementations_have_the_same_public_names():
    core_cache, core_state = make_state(recurrent_cache.cache)
    ref_cache, ref_state = make_state(reference)
    assert public_names(core_cache) - CORE_ONLY == public_names(ref_cache)
    assert public_names(core_state) == public_names(ref_state)


@pytest.mark.parametrize("pair", [("RecurrentCache", "RecurrentCache"), ("MemoryState", "MemoryState")])
def test_methods_have_the_same_signatures(pair):
    core_cls = getattr(recurrent_cache.cache, pair[0], None) or getattr(recurrent_cache, pair[0])
    ref_cls = getattr(reference, pair[1])
    for name in sorted(public_names(ref_cls)):
        core_attr, ref_attr = getattr(core_cls, name), getattr(ref_cls, name)
        if callable(ref_attr) and not isinstance(ref_attr, property):
            core_sig, ref_sig = inspect.signature(core_attr), inspect.signature(ref_attr)
            assert list(core_sig.parameters) == list(ref_sig.parameters), name
            assert [p.default for p in core_sig.parameters.values()] == \
                [p.default for p in ref_sig.parameters.values()], name


def test_package_exports_are_listed_once():
    assert sorted(set(recurrent_cache.__all__)) == sorted(recurrent_cache.__all__)
    for name in recurrent_cache.__all__:
        assert hasattr(recurrent_cache, name), name
