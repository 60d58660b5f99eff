"""Every benchmark runs: ``python bench/run.py --quick`` into a temporary directory, and every
other script in bench/ with ``--quick``.

Checks that results.md has a row for every workload the quick settings ask
for, with numbers where numbers belong, and the plots when matplotlib is
installed; that every other script exits 0 and says its figures are not for
quoting.  Times are not checked (the machine may be busy); only that the
benchmarks cannot rot.  Takes ~40 s (~50 s when the cimport kernel must be built).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the suite's settings: bench.run.QUICK

NUMBER = re.compile(r"^[\d,.]+ \([\d,.]+–[\d,.]+\)$")   # "median (min–max)"
BENCH_FILES = sorted((ROOT / "bench").glob("*.py"))


def is_script(path: Path) -> bool:
    """Whether the file runs as ``python bench/NAME.py``: it has an ``if __name__ == "__main__"`` block."""
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
               for node in ast.parse(path.read_text(encoding="utf-8")).body)


SCRIPTS = [path.name for path in BENCH_FILES if is_script(path)]


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def table_rows(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| ") and not line.startswith("| workload")]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    if os.environ.get("RECURRENT_CACHE_IMPL") == "reference":
        pytest.skip("the suite compares the compiled core with the reference; this run selects the reference")
    out_dir = tmp_path_factory.mktemp("bench")
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--out-dir", str(out_dir)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out_dir, done.stdout


def test_results_file_is_the_printed_report(quick_run):
    from bench.quick import NOTE

    out_dir, stdout = quick_run
    assert (out_dir / "results.md").read_text(encoding="utf-8").strip() == stdout.strip()
    assert NOTE in stdout


def test_every_file_in_bench_is_a_script_run_here_or_a_module_a_script_imports():
    """A new script is run by test_every_script_runs_quick; a file that is neither fails here."""
    imported = set()
    for path in BENCH_FILES:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.removeprefix("bench.").split(".")[0])
                if node.module == "bench":
                    imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.Import):
                imported.update(alias.name.removeprefix("bench.") for alias in node.names)
    for path in BENCH_FILES:
        if path.stem not in ("__init__", "__main__"):
            assert path.name in SCRIPTS or path.stem in imported, f"bench/{path.name}: neither run nor imported"
    assert "run.py" in SCRIPTS and "prefix_store.py" in SCRIPTS and "measure.py" not in SCRIPTS


@pytest.mark.parametrize("script", [name for name in SCRIPTS if name != "run.py"])   # run.py: quick_run above
def test_every_script_runs_quick(script, tmp_path):
    from bench.quick import NOTE

    if os.environ.get("RECURRENT_CACHE_IMPL") == "reference":
        pytest.skip("the benchmarks measure the compiled core; this run selects the reference")
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--quick"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(NOTE), done.stdout[:300]
    assert re.search(r"\d\.\d", done.stdout.split(NOTE, 1)[1]), done.stdout   # figures follow
    assert list(tmp_path.iterdir()) == []   # nothing left in the directory it ran from


def test_every_decode_step_row_is_measured(quick_run):
    from bench.run import QUICK

    rows = {(row[0], row[1], row[2]): row for row in table_rows((quick_run[0] / "results.md").read_text())}
    cimport_built = has("Cython") and has("setuptools")
    for size in QUICK.decode_sizes:
        for active in (a for a in QUICK.decode_active if a <= size):
            row = rows[("decode step", str(size), str(active))]
            assert NUMBER.match(row[3]), row                       # Python API
            assert bool(NUMBER.match(row[4])) == (active in QUICK.model_read_active), row   # read as a model
            assert bool(NUMBER.match(row[6])) or not cimport_built, row   # cimport API
            assert bool(NUMBER.match(row[7])) == (size * active <= QUICK.reference_cells), row


def test_ingestion_churn_and_batch_rows(quick_run):
    from bench import churn
    from bench.run import QUICK

    rows = {(row[0], row[1], row[2]): row for row in table_rows((quick_run[0] / "results.md").read_text())}
    expected = [("Batch() for a decode step", "–", "64")]
    expected += [("prompt ingestion (4096 tokens)", "256", str(n)) for n in QUICK.ingest_seqs]
    expected += [(f"churn: {kind}", str(size), str(churn.SLOTS))
                 for size in QUICK.churn_sizes for kind in (churn.ALL_OPS, *churn.KINDS)]
    for key in expected:
        assert NUMBER.match(rows[key][3]), rows[key]
    for kind in (churn.ALL_OPS, "seq_rm", "decode batch"):
        assert NUMBER.match(rows[(f"churn: {kind}", "64", str(churn.SLOTS))][7])  # the reference ran


def test_bandwidth_rows_compare_with_numpy(quick_run):
    from bench.run import QUICK

    rows = [row for row in table_rows((quick_run[0] / "results.md").read_text()) if len(row) == 10]
    names = [row[0] for row in rows]
    assert names.count("copy plan: fork + decode step") == len(QUICK.copy_moves)
    assert names.count("copy plan: gather after seq_rm") == len(QUICK.copy_moves)
    for name in ("state_write_into(buffer)", "state_read(blob)", "state_write() -> bytes"):
        assert names.count(name) == len(QUICK.state_io_mib)
    for row in rows:
        assert NUMBER.match(row[3]) and re.match(r"^[\d.,]+x$", row[7]), row   # core time, core / numpy


def test_summary_and_plots(quick_run):
    out_dir, stdout = quick_run
    summary = stdout.split("## Summary", 1)[1]
    # a quick run decides no target: figures only, and it says why
    assert "quick run: figures only" in summary
    assert not re.findall(r"^- (PASS|FAIL|n/a): ", summary, re.M)
    from bench.run import QUICK
    pairs = [(size, active) for size in QUICK.decode_sizes for active in QUICK.model_read_active if active <= size]
    assert len(re.findall(r"decode step read as a model reads it / bare", summary)) == len(pairs)
    plots = [out_dir / "decode_step.png", out_dir / "throughput.png"]
    if has("matplotlib"):
        assert all(path.stat().st_size > 10_000 for path in plots)
    else:
        assert "plots skipped" in stdout and not any(path.exists() for path in plots)
