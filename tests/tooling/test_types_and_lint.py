"""The types tell the truth and the code is lint-clean: mypy --strict on the whole package and
on a user program written from the README, mypy's stubtest on the compiled modules' stubs, ruff
(its SLF rule included: no module reaches into another's private names) on the tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_a_readme_user_program_type_checks_strictly():
    pytest.importorskip("mypy")
    result = run("mypy", "--strict", "--no-incremental", str(ROOT / "tests" / "typing" / "readme_user_program.py"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_whole_package_type_checks_strictly():
    """Facade, engines, formats, stores, models and command line: ``mypy --strict`` believes every type."""
    pytest.importorskip("mypy")
    result = run("mypy", "--strict", "--no-incremental", str(ROOT / "src" / "recurrent_cache"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_type_checker_sees_the_compiled_cache():
    pytest.importorskip("mypy")
    probe = ROOT / "tests" / "typing" / "readme_user_program.py"
    result = run("mypy", "--strict", "--no-incremental", "-c",
                 probe.read_text() + "\nreveal_type(cache.cell_table)\nreveal_type(rc.RecurrentCache)\n")
    assert "recurrent_cache.cache.RecurrentCache" in result.stdout, result.stdout


def test_stubs_of_the_compiled_modules_match_them():
    pytest.importorskip("mypy")
    result = run("mypy.stubtest", "--allowlist", str(ROOT / "tests" / "stubtest_allowlist.txt"),
                 "recurrent_cache._cells", "recurrent_cache._core", "recurrent_cache._placement",
                 "recurrent_cache._state_io", "recurrent_cache._capi")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_finds_nothing():
    pytest.importorskip("ruff")
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "src", "tests", "bench", "examples", "tools"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
