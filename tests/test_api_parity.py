"""One facade over two engines: the engines' interfaces match, mechanically.

The public API exists once (``recurrent_cache.cache`` / ``memory_state``), so its
parity holds by construction; what must match is the small engine interface the
facade calls: ``CellTable``, ``Placement`` (made by ``split_batch``) and ``StateIO``.
"""

import numpy as np
import pytest

import recurrent_cache
from recurrent_cache import _engines


def public_names(obj) -> set[str]:
    return {name for name in dir(obj) if not name.startswith("_")}


def engine_objects(name):
    engine = _engines.load(name)
    tensors = [np.zeros((4, 2), np.float32), np.zeros((4, 3), np.float32)]
    table = engine.CellTable(4, tensors)
    batch = recurrent_cache.Batch(token=[1, 2], seq_id=[0, 1], pos=[0, 0])
    placement = engine.split_batch(table, batch.seq_id_flat, batch.seq_id_offset, batch.pos, None,
                                   False, 512, False)
    return {"CellTable": table, "Placement": placement, "StateIO": engine.StateIO(table, [0, 0])}


@pytest.mark.parametrize("kind", ["CellTable", "Placement", "StateIO"])
def test_both_engines_offer_the_same_interface(kind):
    compiled, reference = engine_objects("compiled")[kind], engine_objects("reference")[kind]
    # the compiled table also keeps its C-level fields for cimport users; the reference's
    # fields are its readable lists; what the facade calls is the same on both
    facade_calls = public_names(reference) & public_names(compiled)
    missing = {name for name in public_names(reference) if callable(getattr(reference, name))} - facade_calls
    assert not missing, f"reference {kind} methods missing from the compiled engine: {sorted(missing)}"
    missing = {name for name in public_names(compiled) if callable(getattr(compiled, name))} - facade_calls
    assert not missing, f"compiled {kind} methods missing from the reference engine: {sorted(missing)}"


def test_package_exports_are_listed_once():
    assert sorted(set(recurrent_cache.__all__)) == sorted(recurrent_cache.__all__)
    for name in recurrent_cache.__all__:
        assert hasattr(recurrent_cache, name), name


def test_an_unknown_engine_is_a_config_error():
    with pytest.raises(recurrent_cache.ConfigError, match="unknown engine 'fast'"):
        recurrent_cache.RecurrentCache(1, 1, 1, engine="fast")
