"""The KV cell table (issue 26): the 64-sequence decode step from 64 to 1M cells, and the mask's bandwidth.

    python bench/kv_step.py [--repeats 25] [--quick]

- the decode step: 64 sequences each holding ~N/64 tokens in a table of N cells, then one
  token each placed (find_slot + apply of one 64-token ubatch) — through ``place_arrays``
  (tokens already as arrays, what a model loop holds) and through ``place`` (Python lists in);
  the step is taken back with one ``seq_rm`` per sequence (timed apart) so every repeat sees
  the same table.  ``prepare`` of the same ubatch (its slot found and applied, then undone
  through the journal) is timed too.  Flat from 64 to 1M cells is the target: nothing of the
  step scans the table.
- the mask of a 512-token ubatch ([512, n_kv] float32, 0 / -inf) — one sequence's prompt, and
  64 sequences of 8 tokens — as bytes written per second, next to numpy writing the same array
  in place (``out.fill(-inf)``, what ``np.full`` does after allocating, and ``np.copyto`` from a
  ready mask), after the ubatch is placed.
The load average is recorded with the figures; the full run writes bench/results/kv_step.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):   # run as a script: the repository root on the path, for bench.quick
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import numpy as np  # noqa: E402

from bench.quick import NOTE, add_quick_option  # noqa: E402
from recurrent_cache._kv_cells import KVCells  # noqa: E402

N_SEQS = 64
UBATCH = 512
RESULTS = Path(__file__).resolve().parent / "results" / "kv_step.md"


def filled(size: int) -> tuple[KVCells, int]:
    """A table of ``size`` cells whose 64 sequences hold ``size // 64 - 1`` tokens each (64 cells left)."""
    table = KVCells(size, N_SEQS)
    held = size // N_SEQS - 1
    for seq in range(N_SEQS):
        for start in range(0, held, UBATCH):
            n = min(UBATCH, held - start)
            assert table.place(np.arange(start, start + n, dtype=np.int32), np.full(n, seq, np.int32)) is not None
    return table, held


def decode_step(size: int, repeats: int) -> dict[str, float]:
    """Median µs of one step through place_arrays and through place, of taking it back, and of
    prepare of the same ubatch (which leaves the table as it was)."""
    table, held = filled(size)
    pos = np.full(N_SEQS, held, np.int32)
    seqs = np.arange(N_SEQS, dtype=np.int32)
    offsets = np.arange(N_SEQS + 1, dtype=np.int32)
    pos_list, seq_list = pos.tolist(), seqs.tolist()
    samples: dict[str, list[float]] = {"place_arrays": [], "place": [], "seq_rm x 64": [], "prepare": []}

    def take_back() -> None:
        start = time.perf_counter_ns()
        for seq in seq_list:
            table.seq_rm(seq, held, -1)
        samples["seq_rm x 64"].append((time.perf_counter_ns() - start) / 1e3)

    for _ in range(repeats):
        start = time.perf_counter_ns()
        slot = table.place_arrays(pos, seqs, offsets)
        samples["place_arrays"].append((time.perf_counter_ns() - start) / 1e3)
        assert slot is not None
        take_back()
        start = time.perf_counter_ns()
        slot = table.place(pos_list, seq_list)
        samples["place"].append((time.perf_counter_ns() - start) / 1e3)
        assert slot is not None
        take_back()
        start = time.perf_counter_ns()
        slots = table.prepare([(pos, seqs, offsets)])
        samples["prepare"].append((time.perf_counter_ns() - start) / 1e3)
        assert slots is not None
    table.check()
    return {name: statistics.median(values) for name, values in samples.items()}


def mask_bandwidth(n_kv: int, n_seqs: int, repeats: int) -> dict[str, float]:
    """GB/s writing the [512, n_kv] mask: the table's mask, out.fill(-inf), np.copyto(out, a ready mask)."""
    table = KVCells(n_kv, N_SEQS)
    per_seq = UBATCH // n_seqs
    for seq in range(n_seqs):      # each sequence holds its share of the cells before the ubatch
        share = (n_kv - UBATCH) // n_seqs
        for start in range(0, share, UBATCH):
            n = min(UBATCH, share - start)
            table.place(np.arange(start, start + n, dtype=np.int32), np.full(n, seq, np.int32))
    share = (n_kv - UBATCH) // n_seqs
    seqs = np.repeat(np.arange(n_seqs, dtype=np.int32), per_seq)
    pos = np.tile(np.arange(share, share + per_seq, dtype=np.int32), n_seqs)
    assert table.place(pos, seqs) is not None
    out = np.empty((UBATCH, n_kv), np.float32)
    ready = out.copy()
    table.mask(pos, seqs, ready)
    # numpy writes the same array in place (np.full would also allocate and fault in a new one)
    runs = {"mask": lambda: table.mask(pos, seqs, out), "fill": lambda: out.fill(-np.inf),
            "np.copyto": lambda: np.copyto(out, ready)}
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter_ns()
            run()
            samples[name].append(time.perf_counter_ns() - start)
    return {name: out.nbytes / statistics.median(values) for name, values in samples.items()}   # bytes/ns = GB/s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=25)
    add_quick_option(parser, "small tables, 3 repeats, no results file")
    args = parser.parse_args()
    sizes = [64, 1024, 4096] if args.quick else [64, 1024, 65536, 1048576]
    mask_sizes = [4096] if args.quick else [4096, 32768]
    repeats = 3 if args.quick else args.repeats
    lines = []
    if args.quick:
        lines.append(NOTE)
    lines.append("# KV cell table: the 64-sequence decode step and the mask ({})".format(
        "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())))
    lines += ["", f"## Decode step: find_slot + apply of 64 one-token sequences (median µs of {repeats})", "",
              "| cells | tokens per sequence | place_arrays | place (lists) | seq_rm x 64 (take back) | prepare |",
              "| --- | --- | --- | --- | --- | --- |"]
    for size in sizes:
        got = decode_step(size, repeats)
        lines.append(f"| {size:,} | {size // N_SEQS - 1:,} | {got['place_arrays']:.1f} | {got['place']:.1f} "
                     f"| {got['seq_rm x 64']:.1f} | {got['prepare']:.1f} |")
    lines += ["", f"## Mask of a {UBATCH}-token ubatch, float32 [512, n_kv] (GB/s written, median of {repeats})",
              "", "| n_kv | sequences | mask | out.fill(-inf) | np.copyto | mask / fill |",
              "| --- | --- | --- | --- | --- | --- |"]
    for n_kv in mask_sizes:
        for n_seqs in (1, N_SEQS):
            got = mask_bandwidth(n_kv, n_seqs, repeats)
            lines.append(f"| {n_kv:,} | {n_seqs} | {got['mask']:.2f} | {got['fill']:.2f} | {got['np.copyto']:.2f} "
                         f"| {got['mask'] / got['fill']:.2f}x |")
    lines.append("")
    lines.append("load average after: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    report = "\n".join(lines)
    print(report)
    if not args.quick:
        RESULTS.write_text(report + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
