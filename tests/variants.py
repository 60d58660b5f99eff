"""The engines and storages every ``rc`` test runs on (tests/conftest.py's ``rc`` fixture), for the
test modules that build the package on a variant themselves (state machines, parametrized helpers)."""

from __future__ import annotations

import types
from typing import Any

import recurrent_cache
from recurrent_cache.storage import TorchStorage

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
