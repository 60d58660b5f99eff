"""Build the C API examples with their own setup.py, or any one ``.pyx`` against recurrent_cache.

    python examples/capi/build.py cython|c|cpp [TARGET_DIR]

``build_example`` copies an example's directory to a scratch directory and runs its
``setup.py build_ext`` there (exactly the configuration a user copies), so the source
tree stays clean.  ``build`` compiles a single ``.pyx`` (the tests' probes).  Needs
setuptools and a C/C++ compiler; Cython for ``cython``, pybind11 for ``cpp``.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
MODULES = {"cython": "continuous_batching", "c": "continuous_batching_c", "cpp": "continuous_batching_cpp",
           "hybrid": "hybrid_decode_c"}


def built_path(target_dir: Path, kind: str) -> Path:
    return Path(target_dir) / (MODULES[kind] + sysconfig.get_config_var("EXT_SUFFIX"))


def load(path: Path) -> ModuleType:
    """Import an extension module from a file (an extension is loaded once per process)."""
    name = path.name.split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_example(kind: str, target_dir: Path) -> Path:
    """Compile example ``kind`` (``cython``, ``c`` or ``cpp``) into target_dir; returns the extension's path."""
    target_dir = Path(target_dir)
    target_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        source = Path(work) / kind
        shutil.copytree(HERE / kind, source)
        result = subprocess.run([sys.executable, "setup.py", "--quiet", "build_ext", "--build-lib", str(target_dir),
                                 "--build-temp", str(Path(work) / "temp")],
                                cwd=source, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"building the {kind} example failed:\n{result.stdout}\n{result.stderr}")
    return built_path(target_dir, kind)


def build(target_dir: Path, source_file: Path) -> ModuleType:
    """Compile one ``.pyx`` that cimports recurrent_cache into target_dir and import it."""
    from Cython.Build import cythonize
    from setuptools import Distribution, Extension

    import recurrent_cache

    source_file = Path(source_file)
    with tempfile.TemporaryDirectory() as work:
        source = Path(work) / source_file.name
        shutil.copy(source_file, source)
        extension = Extension(source_file.stem, [str(source)], include_dirs=[recurrent_cache.get_include()],
                              extra_compile_args=["-O3"])
        modules = cythonize([extension], include_path=[recurrent_cache.get_include()], build_dir=work, quiet=True)
        distribution = Distribution({"ext_modules": modules, "script_args": ["--quiet", "build_ext"]})
        distribution.parse_command_line()
        command = distribution.get_command_obj("build_ext")
        command.build_lib = str(target_dir)
        command.build_temp = work
        distribution.run_commands()
        built = command.get_ext_fullpath(source_file.stem)
    return load(Path(built))


if __name__ == "__main__":
    kind = sys.argv[1] if len(sys.argv) > 1 else "c"
    print(build_example(kind, Path(sys.argv[2]) if len(sys.argv) > 2 else HERE / kind))
