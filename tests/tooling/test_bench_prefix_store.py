"""``bench/prefix_store.py --rounds 1`` runs (a real redis-server) and prints every row."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "prefix_store.py"


def test_one_round_prints_every_row():
    done = subprocess.run([sys.executable, str(BENCH), "--rounds", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "| save (a new prefix) |" in done.stdout and "| restore 4,096 tokens |" in done.stdout
    for label in ("directory", "Redis, unix socket"):
        assert f"{label}: a write-through save costs" in done.stdout
