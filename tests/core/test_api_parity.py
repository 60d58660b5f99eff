"""One facade over two engines: the engines implement one interface, mechanically.

The public API exists once (``recurrent_cache.cache`` / ``memory_state``), so its
parity holds by construction; what must match is the engine interface the facade and
the C API call: ``_engines.Core`` (the memory core) and ``_engines.Placement``.
"""

import inspect

import numpy as np

from recurrent_cache.formats.dtypes import STATE_TYPES
from recurrent_cache.storage import NumpyStorage
import pytest

import recurrent_cache
from recurrent_cache import _engines


def protocol_members(protocol: type) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")}


def engine_objects(name):
    f32 = STATE_TYPES["f32"]
    kinds = (np.zeros((1, 4, 2), np.float32), np.zeros((1, 4, 3), np.float32))
    core, split = _engines.load(name).build(4, NumpyStorage(), kinds, (f32, f32), 2, [0, 0], 1, (0,))
    batch = recurrent_cache.Batch(token=[1, 2], seq_id=[0, 1], pos=[0, 0])
    placement = split(batch.seq_id_flat, batch.seq_id_offset, batch.pos, None, False, 512, False)
    return {_engines.Core: core, _engines.Placement: placement}


@pytest.mark.parametrize("engine", _engines.NAMES)
@pytest.mark.parametrize("protocol", [_engines.Core, _engines.Placement], ids=["Core", "Placement"])
def test_each_engine_implements_the_interface(engine, protocol):
    implementation = engine_objects(engine)[protocol]
    for name in protocol_members(protocol):
        assert hasattr(implementation, name), f"{engine} {protocol.__name__} lacks {name}"
        wanted = vars(protocol)[name]
        if inspect.isfunction(wanted):
            got = getattr(implementation, name)
            assert callable(got), f"{engine} {protocol.__name__}.{name} is not callable"
            # the compiled methods carry their signatures (embedsignature): same parameters
            n_params = len(inspect.signature(wanted).parameters) - 1
            assert len(inspect.signature(got).parameters) == n_params, f"{engine} {protocol.__name__}.{name}"


def test_package_exports_are_listed_once():
    assert sorted(set(recurrent_cache.__all__)) == sorted(recurrent_cache.__all__)
    for name in recurrent_cache.__all__:
        assert hasattr(recurrent_cache, name), name


def test_an_unknown_engine_is_a_config_error():
    with pytest.raises(recurrent_cache.ConfigError, match="unknown engine 'fast'"):
        recurrent_cache.RecurrentCache(1, 1, 1, engine="fast")
