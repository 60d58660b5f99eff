"""PNG plots of a run, with matplotlib (the optional ``[bench]`` extra).

- ``decode_step.png``: time per decode step vs cache size, log-log, one line
  per (API, active sequences), min–max as error bars;
- ``throughput.png``: GB/s vs bytes per operation, row moves of the copy
  plan (left) and state I/O (right), each next to its numpy baseline.
"""

from __future__ import annotations

from pathlib import Path

from .bandwidth import BandwidthRow
from .measure import Stats
from .report import DECODE_STEP, TARGET_CIMPORT_STEP_US, LatencyRow

PANEL_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
API_STYLES = {"Python API": ("-", "o"), "read as a model": ("-.", "d"), "cimport API": ("--", "s"),
              "reference": (":", "^")}


def matplotlib_pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def error_bars(stats: list[Stats]) -> list[list[float]]:
    """Asymmetric bars from the median down to the fastest and up to the slowest repeat."""
    return [[s.median - s.low for s in stats], [s.high - s.median for s in stats]]


def label_ticks(ax, values: list, fmt: str) -> None:
    """Ticks at the measured x values, labelled plainly (not 2^k)."""
    ax.set_xticks(values, [fmt.format(v) for v in values])
    ax.minorticks_off()


def api_stats(row: LatencyRow, api: str) -> Stats | None:
    return {"Python API": row.python, "read as a model": row.model, "cimport API": row.cimport,
            "reference": row.reference}[api]


def plot_decode_steps(plt, rows: list[LatencyRow], path: Path) -> None:
    steps = [row for row in rows if row.workload == DECODE_STEP]
    actives = sorted({row.active for row in steps})
    colors = dict(zip(actives, plt.get_cmap("tab10").colors))
    fig, ax = plt.subplots(figsize=(9, 6))
    for api, (linestyle, marker) in API_STYLES.items():
        for active in actives:
            points = [(row.size, api_stats(row, api)) for row in steps
                      if row.active == active and api_stats(row, api) is not None]
            if not points:
                continue
            sizes, stats = zip(*sorted(points, key=lambda point: point[0]))
            ax.errorbar(sizes, [s.median for s in stats], yerr=error_bars(list(stats)), capsize=3,
                        linestyle=linestyle, marker=marker, color=colors[active],
                        label=f"{api}, {active} seq{'s' if active > 1 else ''}")
    if any(row.cimport is not None and row.active == 64 for row in steps):   # no line for what was not run
        ax.axhline(TARGET_CIMPORT_STEP_US, color="grey", linewidth=0.8,
                   label=f"target: cimport API, 64 seqs <= {TARGET_CIMPORT_STEP_US:.0f} µs")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    label_ticks(ax, sorted({row.size for row in steps}), "{:d}")
    ax.set_xlabel("cache size (cells)")
    ax.set_ylabel("time per decode step (µs, median; bars: min–max)")
    ax.set_title("Decode step: one token for each active sequence")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, ncol=3, loc="upper left", bbox_to_anchor=(0, -0.12))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def throughput_panel(ax, rows: list[BandwidthRow], title: str) -> None:
    """GB/s vs MiB per operation: each workload (solid) and its numpy baseline (dashed)."""
    for workload, color in zip(dict.fromkeys(row.workload for row in rows), PANEL_COLORS):
        mine = sorted((row for row in rows if row.workload == workload), key=lambda row: row.bytes_per_op)
        mib = [row.bytes_per_op / 2**20 for row in mine]
        for stats, linestyle, label in ((lambda r: r.core, "-", f"core: {workload}"),
                                        (lambda r: r.numpy, "--", f"{mine[0].baseline}, same bytes")):
            ax.plot(mib, [row.bytes_per_op / (stats(row).median * 1e3) for row in mine],
                    linestyle=linestyle, marker="o", color=color, label=label)
    ax.set_xscale("log", base=2)
    label_ticks(ax, sorted({row.bytes_per_op / 2**20 for row in rows}), "{:.3g}")
    ax.set_xlabel("MiB written per operation")
    ax.set_ylabel("GB/s (median)")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0, -0.14))


def plot_throughput(plt, rows: list[BandwidthRow], path: Path) -> None:
    copies = [row for row in rows if row.rows_moved is not None]
    state_io = [row for row in rows if row.rows_moved is None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5))
    throughput_panel(left, copies, "Copy plan (row moves + zeroed rows) vs numpy fancy indexing")
    throughput_panel(right, state_io, "State I/O vs numpy copy")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_all(latency: list[LatencyRow], bandwidth: list[BandwidthRow], out_dir: Path) -> list[str]:
    """Write the PNGs; returns notes for the report (the files, or why there are none)."""
    plt = matplotlib_pyplot()
    if plt is None:
        return ["plots skipped: matplotlib is not installed (pip install -e '.[bench]')"]
    paths = [out_dir / "decode_step.png", out_dir / "throughput.png"]
    plot_decode_steps(plt, latency, paths[0])
    plot_throughput(plt, bandwidth, paths[1])
    return [f"plots: {', '.join(str(path) for path in paths)}"]
