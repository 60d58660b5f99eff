"""bench/capi_header.py runs (--quick) and reports every column; times are not checked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_capi_header_bench_quick_runs():
    if os.environ.get("RECURRENT_CACHE_IMPL") == "reference":
        pytest.skip("the C API needs the compiled core")
    pytest.importorskip("Cython")
    pytest.importorskip("setuptools")
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "capi_header.py"), "--quick"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["64", "65,536"]
    assert all(row.count("min ") == 3 for row in rows)
    assert "on the min:" in done.stdout and "on the median:" in done.stdout
