"""``python -m recurrent_cache inspect FILE``: describe a state blob or file in any framing.

The parsing is ``blob_report.describe_file``'s; this module is the command:
its options, the report as text or JSON, and the one-line errors.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..blob_report import describe_file
from ..errors import RecurrentCacheError
from ..formats.layouts import MAX_INFERRED_LAYERS, MAX_TOKENS
from .options import OneLineParser, int_in

__all__ = ["EXAMPLES", "main", "parse_args"]

EXAMPLES = """\
examples:
  python -m recurrent_cache inspect state.bin              # cells, layers, types, row sizes, min/max/mean, sha256
  python -m recurrent_cache inspect seq1.ggsq --json       # the full report as JSON
  python -m recurrent_cache inspect big.bin --max-cells 0  # list every cell
  python -m recurrent_cache inspect jamba.ggsq --kv-section --layers 0-3,5,7  # a hybrid's recurrent layers
"""


def _number(value: float | None) -> str:
    """A statistic as the report shows it ("-": no values)."""
    return "-" if value is None else f"{value:.6g}"


def _print_report(path: str, report: dict[str, Any], max_cells: int) -> None:
    """``describe_file``'s report as text, at most ``max_cells`` cells listed (0: all)."""
    print(f"{path}: {report['format']}")
    if report["arch"] is not None:
        print(f"architecture: {report['arch']}")
    if report["outputs"] is not None:
        outputs = report["outputs"]
        print(f"output block: {len(outputs['positions'])} outputs, {outputs['n_logits']} logits, "
              f"{outputs['n_embd']} embedding values (skipped)")
    if report["source_seq_id"] is not None:
        print(f"written from seq id: {report['source_seq_id']}")
    if report["tokens"] is not None:
        tokens = report["tokens"]
        shown = ", ".join(map(str, tokens[:16])) + (", ..." if len(tokens) > 16 else "")
        print(f"tokens: {len(tokens)} [{shown}]")
    if report["kv_section"] is not None:   # after the tokens, as in the bytes
        _print_kv_section(report, max_cells)
    section = "recurrent section" if report["kv_section"] is not None else "blob"
    print(f"{section}: {report['blob_bytes']} bytes at byte {report['blob_offset']}, {report['kind']}"
          f"{' (0 cells: either kind)' if report['kind'] == 'empty' else ''}")
    cells = report["cells"]
    print(f"cells: {len(cells)}")
    for i, cell in enumerate(cells if max_cells <= 0 else cells[:max_cells]):
        ids = " ".join(map(str, cell["seq_ids"])) or "- (a sequence blob's cell)"
        print(f"  cell {i:>5}  pos {cell['pos']:>10}  seq ids {ids}")
    if 0 < max_cells < len(cells):
        print(f"  ... {len(cells) - max_cells} more (--max-cells 0 lists all)")
    print(f"reads into: {_fits(report['reads_into'])}")
    if report["layers"] is None:
        print(f"layers: {report['n_layer']} (v_trans 0)")
    else:
        named = ",".join(map(str, report["layers"])) or "none"
        print(f"layers: {report['n_layer']}, with recurrent state: {named} (v_trans 0)")
    print(f"  {'tensor':<12} {'type':<6} {'row bytes':>10} {'n_embd':>7} {'min':>12} {'max':>12} "
          f"{'mean':>12}  sha256")
    for t in report["tensors"]:
        extra = f"  ({t['non_finite']} non-finite values)" if t["non_finite"] else ""
        print(f"  {t['tensor']:<12} {t['type']:<6} {t['row_bytes']:>10} "
              f"{t['n_embd']:>7} {_number(t['min']):>12} "
              f"{_number(t['max']):>12} {_number(t['mean']):>12}  {t['sha256'][:16]}{extra}")


def _print_kv_section(report: dict[str, Any], max_cells: int) -> None:
    """A hybrid's attention KV section: its streams' cells (at most ``max_cells`` each, 0: all),
    V layout and layers (numbered among the attention layers: the bytes do not say which of the
    model's layers they are)."""
    start, end = report["kv_section"]
    streams = report["kv_streams"]
    ext = ", cells with the extended position" if report["kv_cell_ext"] else ""
    print(f"attention KV section: {end - start} bytes at byte {start}, {len(streams)} "
          f"stream{'s' if len(streams) != 1 else ''}{ext}")
    for index, stream in enumerate(streams):
        if not stream["cell_count"]:
            print(f"  stream {index}: 0 cells")
            continue
        layout = ("V transposed (v_trans 1: flash attention off)" if stream["v_trans"]
                  else "V by cell (v_trans 0: flash attention on)")
        print(f"  stream {index}: {stream['cell_count']} cells, {stream['n_layer']} attention "
              f"layer{'s' if stream['n_layer'] != 1 else ''}, {layout}")
        cells = stream["cells"]
        for i, cell in enumerate(cells if max_cells <= 0 else cells[:max_cells]):
            extra = "  ext (x, y, token) {}, {}, {}".format(*cell["ext"]) if "ext" in cell else ""
            print(f"    cell {i:>5}  pos {cell['pos']:>10}  seq ids {' '.join(map(str, cell['seq_ids']))}{extra}")
        if 0 < max_cells < len(cells):
            print(f"    ... {len(cells) - max_cells} more (--max-cells 0 lists all)")
        for which in ("k", "v"):
            for il, tensor in enumerate(stream[which]):
                width = "-" if tensor["n_embd"] is None else tensor["n_embd"]
                rows = (f"{width} runs of {tensor['row_bytes']}-byte elements, one per cell" if tensor["transposed"]
                        else f"row bytes {tensor['row_bytes']}, n_embd {width}")
                print(f"    attention layer {il} {which.upper()}  {tensor['type']:<6} {rows}")


def _fits(fits: dict[str, Any]) -> str:
    """The smallest cache that reads the blob, as a constructor call."""
    shape = ", ".join(f"{key}={fits[key]!r}" for key in ("n_layer", "n_embd_r", "n_embd_s", "dtype_r", "dtype_s")
                      if fits[key] is not None)
    if fits.get("layers") is not None:
        shape += f", layers={tuple(fits['layers'])!r}"
    how = "seq_id -1" if fits["seq_id"] == -1 else "any seq_id"
    return f"RecurrentCache({shape}, size >= {fits['size']}), state_read with {how}"




def layer_list(text: str) -> tuple[int, ...]:
    """An argparse ``type``: layer indices as "0,2,4-7" (ranges inclusive), each once, in any
    order; "" or "none" is no layer."""
    if text.strip() in ("", "none"):
        return ()
    layers: list[int] = []
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high) if dash else int(low)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part.strip()!r} is not a layer or a range like 4-7") from None
        if not 0 <= first <= last < MAX_INFERRED_LAYERS:
            raise argparse.ArgumentTypeError(f"{part.strip()!r} is not a layer or an increasing range of "
                                             f"layers in [0, {MAX_INFERRED_LAYERS})")
        layers.extend(range(first, last + 1))
    seen: set[int] = set()
    for layer in layers:
        if layer in seen:
            raise argparse.ArgumentTypeError(f"layer {layer} is named twice")
        seen.add(layer)
    return tuple(sorted(layers))


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options, checked: a bad value exits with one line."""
    parser = OneLineParser(prog="python -m recurrent_cache inspect",
                           description="Describe a state blob (state_write, llama_state_seq_get_data, "
                                       "llama_state_get_data) or a 'ggsq' / 'ggsn' file "
                                       "(llama_state_seq_save_file, llama_state_save_file); exit status 1 "
                                       "unless a cache's state_read accepts it.",
                           epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", help="the blob or sequence file")
    parser.add_argument("--json", action="store_true", help="print the full report as JSON")
    parser.add_argument("--kv-section", action="store_true",
                        help="a hybrid model's state: an attention KV section precedes the recurrent one")
    parser.add_argument("--layers", type=layer_list, default=None, metavar="LIST",
                        help="a hybrid's layers with recurrent state, e.g. 0,2,4-7 ('none': no layer); "
                             "default: every layer, or none when the blob holds no tensor section")
    parser.add_argument("--max-cells", type=int_in(0, 2**63 - 1), default=32, metavar="N",
                        help="list at most N cells (default 32; 0 lists all)")
    parser.add_argument("--max-tokens", type=int_in(0, 2**63 - 1), default=MAX_TOKENS, metavar="N",
                        help=f"refuse a sequence file of more than N tokens (default {MAX_TOKENS})")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Describe the file; 0, or 1 after one line on stderr when no cache would read it."""
    options = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        with open(options.file, "rb") as file:
            report = describe_file(file, options.max_tokens, options.kv_section, options.layers)
    except RecurrentCacheError as exc:   # before ValueError: StateError and ArgumentError are ValueErrors
        print(f"inspect: {options.file}: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:   # ValueError: a path with a NUL character
        print(f"inspect: cannot read {options.file!r}: {getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        return 1
    except MemoryError:
        print(f"inspect: {options.file}: not enough memory to read it", file=sys.stderr)
        return 1
    if options.json:
        print(json.dumps({"file": options.file, **report}, indent=1))
    else:
        _print_report(options.file, report, options.max_cells)
    return 0
