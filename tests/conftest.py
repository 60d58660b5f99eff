"""Every test that takes ``rc`` runs once per engine and storage: the compiled core and the
pure-Python reference on numpy storage, and the compiled core on torch storage (``cpu``, moved
through index arrays as on a GPU), all behind the one facade.  ``rc`` is used like
``import recurrent_cache as rc``; its ``RecurrentCache`` builds caches on the engine and storage
under test, ``rc.ENGINE`` names the engine and ``rc.STORAGE`` the storage (``"numpy"`` or
``"torch"``)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

import recurrent_cache
from recurrent_cache.storage import TorchStorage

sys.path.insert(0, str(Path(__file__).parent))  # tests/golden.py and friends

ENGINES = ("compiled", "reference")
# The ``rc`` fixture's parameters: an engine on numpy storage, or "torch" (compiled, torch storage).
VARIANTS = (*ENGINES, "torch")


def torch_storage() -> TorchStorage:
    """Torch storage on ``cpu`` that takes the index-array path a GPU takes (no host view)."""
    return TorchStorage("cpu", host_access=False)


def package_on(variant: str) -> types.SimpleNamespace:
    """The package's public names, with ``RecurrentCache`` building caches on ``variant``
    (an engine on numpy storage, or ``"torch"``: the compiled engine on torch storage)."""
    engine = "compiled" if variant == "torch" else variant
    storage = "torch" if variant == "torch" else "numpy"

    def new_cache(*args: Any, **kwargs: Any) -> recurrent_cache.RecurrentCache:
        kwargs.setdefault("engine", engine)
        # the reference engine moves rows in host memory only: a test that asks for it keeps numpy
        if storage == "torch" and kwargs["engine"] == "compiled" and not {"storage", "device"} & kwargs.keys():
            kwargs["storage"] = torch_storage()
        return recurrent_cache.RecurrentCache(*args, **kwargs)

    names = {name: getattr(recurrent_cache, name) for name in recurrent_cache.__all__}
    names["RecurrentCache"] = new_cache
    names["ENGINE"] = engine
    names["STORAGE"] = storage
    return types.SimpleNamespace(**names)


@pytest.fixture(params=VARIANTS, scope="module")
def rc(request):
    """The package on the engine and storage under test (the torch variant needs the torch extra)."""
    if request.param == "torch":
        pytest.importorskip("torch", reason="the torch variant needs torch: pip install '.[torch]'")
    return package_on(request.param)


def pytest_configure(config):
    config.addinivalue_line("markers", "torch_xfail(reason): a library bug on torch storage; the test's "
                            "torch run is xfail(strict=True) until it is fixed")
    config.addinivalue_line("markers", "torch_skip(reason): the test's torch run is skipped, for the reason "
                            "given (host memory a device storage lacks, or a run that would repeat another)")


def pytest_collection_modifyitems(items):
    """Apply ``torch_xfail`` / ``torch_skip`` to the torch run of a test (``rc`` = "torch") only."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or callspec.params.get("rc") != "torch":
            continue
        for marker in item.iter_markers("torch_xfail"):
            item.add_marker(pytest.mark.xfail(strict=True, reason=marker.args[0]))
        for marker in item.iter_markers("torch_skip"):
            item.add_marker(pytest.mark.skip(reason=marker.args[0]))
