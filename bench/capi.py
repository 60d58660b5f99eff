"""The cimport-API kernel: examples/capi/continuous_batching.pyx, built once and cached.

The built extension is kept under ``build/bench/`` in a directory named by a
hash of everything it depends on (the example's source, the package's
``.pxd`` files, the Python ABI and Cython's version), so a run rebuilds it
only after one of those changed.  Building takes a few seconds and needs Cython,
setuptools and a C compiler (the ``[test]`` extra).
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
EXAMPLE = REPO / "examples" / "capi"
CACHE_ROOT = REPO / "build" / "bench"
MODULE = "continuous_batching"


def load_module(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_key() -> str:
    """A hash of the inputs of the build: the example and every .pxd it can cimport."""
    import Cython

    digest = hashlib.sha256()
    package_dir = Path(recurrent_cache.get_include()) / "recurrent_cache"
    for path in [EXAMPLE / f"{MODULE}.pyx", EXAMPLE / "build.py", *sorted(package_dir.glob("*.pxd"))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(f"{sysconfig.get_config_var('EXT_SUFFIX')} {Cython.__version__}".encode())
    return digest.hexdigest()[:16]


def built_extension(directory: Path) -> Path | None:
    found = sorted(directory.glob(f"{MODULE}*{sysconfig.get_config_var('EXT_SUFFIX')}"))
    return found[0] if found else None


def decode_kernel() -> ModuleType:
    """The example module (``decode_steps`` is the kernel), from the cache or freshly built."""
    target = CACHE_ROOT / f"capi-{build_key()}"
    if built_extension(target) is not None:
        return load_module(MODULE, built_extension(target))
    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    staging = CACHE_ROOT / f"{target.name}.tmp-{os.getpid()}"
    module = load_module("capi_build", EXAMPLE / "build.py").build(staging)
    try:
        os.replace(staging, target)      # atomic: a concurrent run sees all or nothing
    except OSError:                      # another run got there first
        shutil.rmtree(staging, ignore_errors=True)
    module.__file__ = str(built_extension(target))
    return module                        # loaded once: an extension cannot be loaded twice
