"""``bench/kv_step.py --quick`` runs and names every figure it measured: the decode step through
each way in (place_arrays, place, prepare) and its take-back, at every quick table size, and the
mask's bandwidth beside numpy's.

No time is checked (the machine may be busy), only that the benchmark cannot rot.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "kv_step.py"
FIGURE = r"\d[\d,]*\.\d+"


def rows(section: str) -> list[str]:
    return [line for line in section.splitlines() if re.match(r"^\| [\d,]+ \| ", line)]


def test_quick_run_names_and_measures_every_row(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH), "--quick"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    step, mask = done.stdout.split("## Mask", 1)
    assert "| cells | tokens per sequence | place_arrays | place (lists) | seq_rm x 64 (take back) | prepare |" in step
    assert [row.split("|")[1].strip() for row in rows(step)] == ["64", "1,024", "4,096"]
    assert all(re.fullmatch(rf"\| [\d,]+ \| [\d,]+ (\| {FIGURE} ){{4}}\|", row) for row in rows(step)), step
    assert "| n_kv | sequences | mask | out.fill(-inf) | np.copyto | mask / fill |" in mask
    assert [row.split("|")[2].strip() for row in rows(mask)] == ["1", "64"]
    assert all(re.fullmatch(rf"\| 4,096 \| \d+ (\| {FIGURE} ){{3}}\| {FIGURE}x \|", row) for row in rows(mask)), mask
    assert list(tmp_path.iterdir()) == []   # a quick run writes no results file
