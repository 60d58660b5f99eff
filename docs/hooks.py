"""MkDocs hook: serve the committed benchmark plots from bench/results/ without copying them into docs/.

The plots are written by ``bench/run.py``; a copy under docs/ would go stale the
next time the benchmarks run, so the site takes them from where they are.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

PLOTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add bench/results/*.png to the site as assets/bench/<name>.png."""
    for plot in sorted(PLOTS.glob("*.png")):
        files.append(File.generated(config, f"assets/bench/{plot.name}", abs_src_path=str(plot)))
    return files
