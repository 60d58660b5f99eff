"""Build the C-API example extension in place, or into a given directory.

    python examples/capi/build.py [TARGET_DIR]

Needs Cython, setuptools and a C compiler.  The only thing a downstream build
needs from recurrent_cache is ``recurrent_cache.get_include()`` on Cython's
include path.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODULE = "continuous_batching"


def build(target_dir: Path | None = None, source_file: Path | None = None):
    """Compile the example (or another ``.pyx`` using the C-level API) and return the imported module."""
    from Cython.Build import cythonize
    from setuptools import Distribution, Extension

    import recurrent_cache

    target_dir = Path(target_dir or HERE)
    source_file = Path(source_file or HERE / f"{MODULE}.pyx")
    name = source_file.stem
    with tempfile.TemporaryDirectory() as work:
        source = Path(work) / source_file.name
        shutil.copy(source_file, source)
        extension = Extension(name, [str(source)], extra_compile_args=["-O3"])
        modules = cythonize([extension], include_path=[recurrent_cache.get_include()],
                            build_dir=work, quiet=True)
        distribution = Distribution({"ext_modules": modules, "script_args": ["--quiet", "build_ext"]})
        distribution.parse_command_line()
        command = distribution.get_command_obj("build_ext")
        command.build_lib = str(target_dir)
        command.build_temp = work
        distribution.run_commands()
        built = command.get_ext_fullpath(name)
    spec = importlib.util.spec_from_file_location(name, built)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else None).__file__)
