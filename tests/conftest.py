"""Every test that takes ``rc`` runs once per engine: the compiled core and the pure-Python
reference, both behind the one facade.  ``rc`` is used like ``import recurrent_cache as rc``;
its ``RecurrentCache`` builds caches on the engine under test."""

from __future__ import annotations

import functools
import sys
import types
from pathlib import Path

import pytest

import recurrent_cache

sys.path.insert(0, str(Path(__file__).parent))  # tests/golden.py and friends

ENGINES = ("compiled", "reference")


def package_on(engine: str) -> types.SimpleNamespace:
    """The package's public names, with ``RecurrentCache`` building caches on ``engine``."""
    names = {name: getattr(recurrent_cache, name) for name in recurrent_cache.__all__}
    names["RecurrentCache"] = functools.partial(recurrent_cache.RecurrentCache, engine=engine)
    names["ENGINE"] = engine
    return types.SimpleNamespace(**names)


@pytest.fixture(params=ENGINES, scope="module")
def rc(request):
    """The package on the engine under test."""
    return package_on(request.param)
