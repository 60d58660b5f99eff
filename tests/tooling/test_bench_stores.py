"""``bench/stores.py --quick`` runs and prints a row for every operation of every store.

No time is checked (the machine may be busy), only that the benchmark cannot rot
and that its own sanity checks (every restored state equals the original) pass.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "stores.py"


def test_quick_run_prints_every_row(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--rounds", "1", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 64 KiB |")]
    operations = [row.split("|")[2].strip() for row in rows]
    stores = ["DirectoryStore", "Redis, unix socket", "Redis, TCP loopback"]
    assert operations == ["numpy copy (out and back)", "encode", "decode+restore"] + \
        [f"{store}: {op}" for store in stores for op in ("put", "hit", "miss")] + ["recompute (per token)"]
    assert all(re.search(r"\d+\.\d{3} \(", row) for row in rows)
    assert "break-even" in done.stdout
    assert list(tmp_path.iterdir()) == []   # the store directory and the server's socket are removed
