"""Every test that takes ``rc`` runs once per implementation: the compiled core
(the package itself) and the pure-Python reference (``recurrent_cache.reference``)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/golden.py and friends

IMPLEMENTATIONS = {
    "core": "recurrent_cache",
    "reference": "recurrent_cache.reference",
}


@pytest.fixture(params=list(IMPLEMENTATIONS), scope="module")
def rc(request):
    """The implementation under test, used like ``import recurrent_cache as rc``."""
    return importlib.import_module(IMPLEMENTATIONS[request.param])
