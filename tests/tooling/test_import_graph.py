"""The package's import graph (tools/import_graph.py) has no circle, and its ground floors stay
on the ground: the dtype table imports nothing of the package, ``errors`` no format module."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "import_graph.py"
PACKAGE = ROOT / "src" / "recurrent_cache"

@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def graph(tool):
    return tool.import_graph(PACKAGE)


def test_no_import_circle(tool, graph):
    assert tool.circles(graph) == []


def test_the_dtype_table_imports_nothing_of_the_package(graph):
    assert graph["recurrent_cache.formats.dtypes"] == set()


def test_errors_imports_no_format_module(graph):
    assert not {module for module in graph["recurrent_cache.errors"] if module.startswith("recurrent_cache.formats")}


def test_storage_takes_only_the_dtype_table_of_the_formats(graph):
    formats = {module for module in graph["recurrent_cache.storage"] if module.startswith("recurrent_cache.formats")}
    assert formats == {"recurrent_cache.formats.dtypes"}


def test_the_formats_package_imports_none_of_its_modules(graph):
    """Importing one format module (storage's dtypes) loads only what that module needs."""
    assert graph["recurrent_cache.formats"] == set()


def test_no_format_module_is_over_800_lines():
    for path in (PACKAGE / "formats").glob("*.py"):
        assert len(path.read_text().splitlines()) < 800, path.name


# -- the tool itself -------------------------------------------------------------------------

def write(root: Path, files: dict[str, str]) -> Path:
    package = root / "recurrent_cache"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return package


def test_a_late_import_a_type_checking_import_and_a_cimport_each_close_a_circle(tool, tmp_path):
    package = write(tmp_path, {
        "__init__.py": "from . import cache\n",
        "errors.py": "def word():\n    from .formats import messages\n",
        "formats/__init__.py": "",
        "formats/messages.py": "from ..errors import word\n",
        "cache.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .state import State\n",
        "state.py": "from . import cache\n",
        "_core.pyx": "from ._cells cimport (Cells,\n    cells_clear)\nfrom . import errors\n",
        "_cells.pxd": "from ._core cimport Core\n",
    })
    assert tool.circles(tool.import_graph(package)) == [
        ["recurrent_cache._cells", "recurrent_cache._core"], ["recurrent_cache.cache", "recurrent_cache.state"],
        ["recurrent_cache.errors", "recurrent_cache.formats.messages"]]


def test_floors_count_up_from_the_modules_that_import_nothing(tool, tmp_path):
    package = write(tmp_path, {
        "__init__.py": "from . import cache\n",
        "errors.py": "import numpy\n",
        "_args.py": "from .errors import ArgumentError\n",
        "cache.py": "import recurrent_cache.errors\nfrom recurrent_cache import _args\n",
    })
    assert tool.floors(tool.import_graph(package)) == {"recurrent_cache.errors": 0, "recurrent_cache._args": 1,
                                                       "recurrent_cache.cache": 2, "recurrent_cache": 3}


def test_the_command_names_a_circle_and_fails(tmp_path):
    package = write(tmp_path, {"__init__.py": "", "a.py": "from . import b\n", "b.py": "from .a import x\n"})
    result = subprocess.run([sys.executable, str(SCRIPT), "--check", "--root", str(package)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "circle: a <-> b" in result.stderr
    (package / "b.py").write_text("")
    result = subprocess.run([sys.executable, str(SCRIPT), "--root", str(package)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and "floor 1:\n  a  <- b" in result.stdout, result.stdout + result.stderr


def test_the_architecture_page_names_every_module(graph):
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    names = {module.removeprefix("recurrent_cache.") for module in graph}
    assert sorted(name for name in names if f"`{name}`" not in page) == []
