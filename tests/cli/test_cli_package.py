"""The command line as a package: every subcommand's --help shows examples that parse, the
modules import alone and without a cycle, and one module builds batches.  Its types and lint
(mypy --strict, ruff with the private-name rule) are checked with the whole tree's, in
tests/tooling/test_types_and_lint.py."""

from __future__ import annotations

import ast
import importlib
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from recurrent_cache import cli

PACKAGE = Path(cli.__file__).parent
MODULES = sorted(path.stem for path in PACKAGE.glob("*.py") if path.stem != "__init__")
ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)


def example_arguments(examples: str, command: str) -> list[list[str]]:
    """The arguments after ``python -m recurrent_cache COMMAND`` of each example line (comments and
    redirections cut off)."""
    lines = []
    for line in examples.splitlines()[1:]:
        words = shlex.split(line, comments=True)
        words = words[:words.index(">")] if ">" in words else words
        assert words[:4] == ["python", "-m", "recurrent_cache", command], line
        lines.append(words[4:])
    return lines


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_help_ends_with_examples_that_parse(command):
    result = run("-m", "recurrent_cache", command, "--help")
    assert result.returncode == 0 and result.stderr == ""
    module = importlib.import_module(cli.COMMANDS[command][0])
    assert result.stdout.rstrip().endswith(module.EXAMPLES.rstrip())
    examples = example_arguments(module.EXAMPLES, command)
    assert len(examples) >= 2
    for arguments in examples:
        module.parse_args(arguments)   # a refused or unknown option exits: SystemExit fails the test


def test_top_level_help_lists_the_subcommands_and_examples():
    result = run("-m", "recurrent_cache", "--help")
    assert result.returncode == 0
    for command in cli.COMMANDS:
        assert f"{command}:" in result.stdout
        assert f"python -m recurrent_cache {command}" in result.stdout


def imports_within_the_package(module: str) -> set[str]:
    """The cli modules ``module`` imports (relative imports and absolute ones of recurrent_cache.cli)."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                found |= {node.module} if node.module else {alias.name for alias in node.names}
            elif node.level == 0 and (node.module or "").startswith("recurrent_cache.cli"):
                found.add((node.module or "").removeprefix("recurrent_cache.cli").lstrip(".") or "__init__")
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("recurrent_cache.cli.") for a in node.names
                      if a.name.startswith("recurrent_cache.cli.")}
    return {name for name in found if name in MODULES}


def test_no_import_cycle_between_the_cli_modules():
    graph = {module: imports_within_the_package(module) for module in MODULES}
    assert graph["demo"] >= {"demo_prefix", "demo_speculative", "serving"}   # the walk sees imports
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        if state.get(module) == "open":
            raise AssertionError("import cycle: " + " -> ".join(path + [module]))
        if state.get(module) == "done":
            return
        state[module] = "open"
        for imported in sorted(graph[module]):
            visit(imported, path + [module])
        state[module] = "done"

    for module in MODULES:
        visit(module, [])


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_alone_in_a_fresh_interpreter(module):
    result = run("-c", f"import recurrent_cache.cli.{module}")
    assert result.returncode == 0, result.stderr


def test_no_command_builds_batches_the_generation_loop_does():
    builders = sorted(module for module in MODULES
                      if "Batch(" in (PACKAGE / f"{module}.py").read_text(encoding="utf-8"))
    assert builders == []
    assert "Batch(" in (PACKAGE.parent / "generation.py").read_text(encoding="utf-8")
