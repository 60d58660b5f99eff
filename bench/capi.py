"""The C API kernels: examples/capi/{cython,c}/ built once each and cached.

``decode_kernel(kind)`` returns the example module whose ``decode_steps(cache, n_seqs,
n_steps)`` runs n decode steps in C: ``cython`` through ``cimport recurrent_cache.capi``,
``c`` through the C header's function table.  A built extension is kept under
``build/bench/`` in a directory named by a hash of everything it depends on (the
example's sources, the package's ``.pxd`` files and ``capi.h``, the Python ABI and
Cython's version), so a run rebuilds it only after one of those changed.  Building
takes a few seconds and needs setuptools and a C compiler (and Cython for ``cython``;
the ``[test]`` extra has them).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sysconfig
from pathlib import Path
from types import ModuleType

import recurrent_cache

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "capi"
CACHE_ROOT = REPO / "build" / "bench"


def load_builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("capi_build", EXAMPLES / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_key(kind: str) -> str:
    """A hash of the inputs of the build: the example and every .pxd / header it can include."""
    import Cython

    digest = hashlib.sha256()
    package_dir = Path(recurrent_cache.get_include()) / "recurrent_cache"
    sources = sorted((EXAMPLES / kind).iterdir()) + [EXAMPLES / "build.py"]
    for path in [*sources, *sorted(package_dir.glob("*.pxd")), package_dir / "capi.h"]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(f"{sysconfig.get_config_var('EXT_SUFFIX')} {Cython.__version__}".encode())
    return digest.hexdigest()[:16]


_loaded: dict[str, ModuleType] = {}


def decode_kernel(kind: str = "cython") -> ModuleType:
    """The example module of ``kind`` (``decode_steps`` is the kernel), from the cache or freshly built."""
    if kind in _loaded:                  # an extension is loaded once per process
        return _loaded[kind]
    builder = load_builder()
    target = CACHE_ROOT / f"capi-{kind}-{build_key(kind)}"
    if not builder.built_path(target, kind).is_file():
        CACHE_ROOT.mkdir(parents=True, exist_ok=True)
        staging = CACHE_ROOT / f"{target.name}.tmp-{os.getpid()}"
        builder.build_example(kind, staging)
        try:
            os.replace(staging, target)  # atomic: a concurrent run sees all or nothing
        except OSError:                  # another run got there first
            shutil.rmtree(staging, ignore_errors=True)
    _loaded[kind] = builder.load(builder.built_path(target, kind))
    return _loaded[kind]
