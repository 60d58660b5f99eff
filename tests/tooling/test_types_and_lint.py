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
    # mypy --strict reads torch's types where torch is installed: ~60 s on an idle 2-core machine, past
    # 300 s at a load of 8-15 (CI's second stage runs it beside the other worker's tests)
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=ROOT, timeout=900)


PROGRAM = ROOT / "tests" / "typing" / "readme_user_program.py"


@pytest.fixture(scope="module")
def strict_mypy(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One ``mypy --strict`` run over the package, the README user program and a copy of that program
    that reveals two types: the probe's path and mypy's result (each test below reads its part)."""
    pytest.importorskip("mypy")
    probe = tmp_path_factory.mktemp("typing") / "reveal_probe.py"
    probe.write_text(PROGRAM.read_text() + "\nreveal_type(cache.cell_table)\nreveal_type(rc.RecurrentCache)\n")
    return probe, run("mypy", "--strict", "--no-incremental", str(ROOT / "src" / "recurrent_cache"), str(PROGRAM),
                      str(probe))


def errors_in(result: subprocess.CompletedProcess, path: Path) -> list[str]:
    """mypy's error lines about ``path`` (or about files under it)."""
    where = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    return [line for line in result.stdout.splitlines() if line.startswith(where) and ": error:" in line]


def test_a_readme_user_program_type_checks_strictly(strict_mypy):
    _, result = strict_mypy
    assert not errors_in(result, PROGRAM), result.stdout + result.stderr


def test_the_whole_package_type_checks_strictly(strict_mypy):
    """Facade, engines, formats, stores, models and command line: ``mypy --strict`` believes every type."""
    _, result = strict_mypy
    assert result.returncode == 0, result.stdout + result.stderr
    assert not errors_in(result, ROOT / "src" / "recurrent_cache"), result.stdout


def test_a_type_checker_sees_the_compiled_cache(strict_mypy):
    probe, result = strict_mypy
    revealed = [line for line in result.stdout.splitlines() if line.startswith(str(probe)) and "Revealed type" in line]
    assert any("recurrent_cache.cache.RecurrentCache" in line for line in revealed), result.stdout


def test_stubs_of_the_compiled_modules_match_them():
    pytest.importorskip("mypy")
    result = run("mypy.stubtest", "--allowlist", str(ROOT / "tests" / "stubtest_allowlist.txt"),
                 "recurrent_cache._cells", "recurrent_cache._core", "recurrent_cache._placement",
                 "recurrent_cache._state_io", "recurrent_cache._capi", "recurrent_cache._kv_cells",
                 "recurrent_cache._hybrid_step", "recurrent_cache._hybrid_rule", "recurrent_cache.models._scan")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_finds_nothing():
    pytest.importorskip("ruff")
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "src", "tests", "bench", "examples", "tools"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
