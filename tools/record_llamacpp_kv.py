"""Record llama.cpp's KV cell placement, cell by cell, after every step of scripted sequence operations.

A development tool beside ``tools/record_llamacpp.py`` (whose models and llama.cpp wrappers it
uses), run under a Python with ``llama-cpp-python`` 0.3.36, ``gguf`` and this package::

    python tools/record_llamacpp_kv.py [--record DIR]      # default tests/data/llamacpp_kv

For each scenario it opens one llama.cpp context with a unified KV cache (one stream) and runs
the scenario's steps through the low-level API: decodes of batches of several sequences,
``llama_memory_seq_rm`` / ``_cp`` / ``_keep`` / ``_add`` / ``_div`` and ``llama_memory_clear``.
What llama.cpp did is read from its own debug output, captured with ``llama_log_set``:

* ``LLAMA_KV_CACHE_DEBUG=3``: at every ``find_slot`` (src/llama-kv-cache.cpp), the cache's head,
  each cell's sequence ('M' for several) and position, and each sequence's min/max position.

``find_slot`` runs before each ubatch is placed, so a decode's prints give the cells after each
ubatch but the last.  After every step the recorder probes: it decodes a batch for a sequence
that is always empty (the last seq id), one token longer than the free cells, which llama.cpp
refuses after printing the cells at its first ``find_slot``; the refused batch changes nothing.
The sequences of the cells printed 'M' are taken from ``llama_state_get_data`` of the whole
context (its KV section lists every used cell's seq ids, in cell order; parsed by
``recurrent_cache.formats.kv``), and within a decode from the ubatch token that filled the cell.

A model with sliding-window layers has a second cache that no probe reaches (see
``run_swa_steps``): its scenario is decodes only, each read at the next decode's first print.

Writes ``DIR/placement.json`` (the schema is in ``DIR/README.md``) and the GGUFs of the tiny
attention-only models (``DIR/tiny_llama.gguf``, ``DIR/tiny_granite_swa.gguf``); the hybrid is
``tests/data/llamacpp_current``'s ``tiny_jamba.gguf``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp as lc
import numpy as np

# the debug levels are read when a context is created
os.environ["LLAMA_KV_CACHE_DEBUG"] = "3"

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record_llamacpp as recorder  # noqa: E402  (the sibling script: models, llama.cpp wrappers)

from recurrent_cache.formats.blob import MemoryReader  # noqa: E402
from recurrent_cache.formats.kv import read_kv_section  # noqa: E402

REPO = recorder.REPO
DEFAULT_DIR = REPO / "tests" / "data" / "llamacpp_kv"
PLACEMENT = "placement.json"
KV_SIZE = 256   # llama.cpp pads n_ctx to a multiple of 256 (llama_context's constructor): the smallest cache


# -- a tiny attention-only model ----------------------------------------------------------

@dataclass(frozen=True)
class LlamaShape:
    """A tiny Llama (attention with RoPE in every layer), seeded random f32 weights; with
    ``swa_layers`` a Granite-SWA (the same, plus attention sinks, those layers attending to the last
    ``n_swa`` positions only: llama.cpp gives them a KV cache of their own)."""

    n_vocab: int = 64
    n_embd: int = 16
    n_ff: int = 32
    n_head: int = 2
    n_head_kv: int = 1
    n_layer: int = 2
    rms_eps: float = 1e-5
    seed: int = 26
    swa_layers: tuple[int, ...] = ()     # with some: Granite's SWA architecture, these layers windowed
    n_swa: int = 0

    @property
    def arch(self) -> str:
        return "granite_swa" if self.swa_layers else "llama"

    @property
    def gguf_name(self) -> str:
        return f"tiny_{self.arch}.gguf"

    def write_gguf(self, path: Path) -> None:
        import gguf

        rng = np.random.default_rng(self.seed)

        def normal(*numpy_shape: int, scale: float = 0.3) -> np.ndarray:
            return (rng.standard_normal(numpy_shape) * scale).astype(np.float32)

        e, head = self.n_embd, self.n_embd // self.n_head
        arch = self.arch
        writer: Any = gguf.GGUFWriter(str(path), arch)
        writer.add_name(f"recurrent-cache-tiny-{arch}")
        writer.add_uint32(f"{arch}.context_length", 4096)
        writer.add_uint32(f"{arch}.embedding_length", e)
        writer.add_uint32(f"{arch}.feed_forward_length", self.n_ff)
        writer.add_uint32(f"{arch}.block_count", self.n_layer)
        writer.add_uint32(f"{arch}.attention.head_count", self.n_head)
        writer.add_uint32(f"{arch}.attention.head_count_kv", self.n_head_kv)
        writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", self.rms_eps)
        writer.add_uint32(f"{arch}.rope.dimension_count", head)
        writer.add_uint32(f"{arch}.vocab_size", self.n_vocab)
        if self.swa_layers:
            writer.add_float32(f"{arch}.logit_scale", 1.0)
            writer.add_uint32(f"{arch}.attention.sliding_window", self.n_swa)
            writer.add_array(f"{arch}.attention.sliding_window_pattern",
                             [int(il in self.swa_layers) for il in range(self.n_layer)])
        recorder.add_vocab_and_output(writer, self.n_vocab, e, normal)
        for il in range(self.n_layer):
            blk = f"blk.{il}."
            writer.add_tensor(blk + "attn_norm.weight", np.ones(e, dtype=np.float32))
            recorder.add_attention_tensors(writer, blk, e, self.n_head_kv * head, normal)
            if self.swa_layers:
                writer.add_tensor(blk + "attn_sinks.weight", normal(self.n_head))
            recorder.add_gated_ffn(writer, blk, e, self.n_ff, normal)
        recorder.finish_gguf(writer)


# -- the log tap ----------------------------------------------------------------------------

class LogTap:
    """llama.cpp's log (every level) appended to ``text`` while tapping; warnings to stderr."""

    def __init__(self) -> None:
        self.text: list[str] = []

        def log(level: int, message: bytes, _user: Any) -> None:
            piece = message.decode(errors="replace")
            self.text.append(piece)
            if level == 4:   # GGML_LOG_LEVEL_ERROR
                sys.stderr.write(piece)

        self.callback = lc.llama_log_callback(log)   # kept alive: llama.cpp calls it later
        lc.llama_log_set(self.callback, ctypes.c_void_p())

    def take(self) -> str:
        text = "".join(self.text)
        self.text.clear()
        return text


_HEADER = re.compile(r"find_slot: stream\[(\d+)\], n = *(\d+), used = *(\d+), head = *(\d+), size = *(\d+), "
                     r"n_swa = *(\d+)[^\n]*")
_MINMAX = re.compile(r"find_slot: stream\[\d+\] min\[(\d+)\] = *(-?\d+), max\[\d+\] = *(-?\d+)")


@dataclass
class Print:
    """One find_slot print: the head, per cell (None or (pos, seq digit or 'M')), seq_pos min/max,
    and the printing cache's window (0: not sliding; a model with SWA layers has a cache of each)."""

    head: int
    cells: list[tuple[int, str] | None]
    seq_pos: dict[int, tuple[int, int]]
    n_swa: int = 0


def parse_prints(text: str) -> list[Print]:
    prints = []
    headers = list(_HEADER.finditer(text))
    for n, header in enumerate(headers):
        size = int(header.group(5))
        block = text[header.end():headers[n + 1].start() if n + 1 < len(headers) else len(text)]
        symbols: list[str] = []
        positions: list[str] = []
        for line in block.splitlines():
            if ":" in line or not line.strip():
                continue
            tokens = [token for token in line.replace("*", " ").split()]
            if len(symbols) < size:
                symbols.extend("".join(tokens))
            else:
                positions.extend(tokens)
        if len(symbols) != size or len(positions) < size:
            raise RuntimeError(f"a find_slot print of {len(symbols)} cells and {len(positions)} positions")
        cells: list[tuple[int, str] | None] = []
        for symbol, position in zip(symbols, positions[:size], strict=True):
            cells.append(None if symbol == "." else (int(position), symbol))
        seq_pos = {int(m.group(1)): (int(m.group(2)), int(m.group(3))) for m in _MINMAX.finditer(block)}
        prints.append(Print(int(header.group(4)), cells, seq_pos, int(header.group(6))))
    return prints


def one_per_find_slot(prints: list[Print]) -> list[Print]:
    """find_slot prints the cells once per sequence of its ubatch (one stream: the same cells each
    time); two find_slot calls in a row never print the same cells (a ubatch places a token)."""
    firsts: list[Print] = []
    for printed in prints:
        if not firsts or printed != firsts[-1]:
            firsts.append(printed)
    return firsts


def placed_ubatch(before: Print, after: list[Any], batch: list[list[Any]]) -> list[list[Any]]:
    """The ubatch find_slot placed between two prints, in its order: the cells filled (empty ones, and
    with sliding-window attention cells whose token left the window), in the order find_slot's search
    visits them (from the head before, wrapping), are its tokens in order."""
    size = len(after)

    def same(printed: tuple[int, str] | None, cell: list[Any] | None) -> bool:
        if printed is None or cell is None:
            return printed is None and cell is None
        return printed[0] == cell[0] and (printed[1] == "M") == (len(cell[1]) > 1) and (
            printed[1] == "M" or cell[1] == [int(printed[1])])

    filled = [index for index in range(size) if not same(before.cells[index], after[index])]
    filled.sort(key=lambda index: (index - before.head) % size)
    ubatch = []
    for index in filled:
        pos, seqs = after[index]
        entries = [entry for entry in batch if entry[1] == pos and sorted(entry[2]) == seqs]
        if len(entries) != 1:
            raise RuntimeError(f"cell {index} ({pos}, {seqs}): {len(entries)} batch tokens match it")
        ubatch.append(entries[0])
    return ubatch


# -- scenarios --------------------------------------------------------------------------------

@dataclass(frozen=True)
class KvScenario:
    name: str
    model: str            # "llama" (written here) or "jamba" (tests/data/llamacpp_current)
    n_seq_max: int        # the last seq id is the probe's, always empty
    n_ubatch: int
    steps: tuple[dict[str, Any], ...]
    flash_attn: bool = False
    n_swa: int = 0        # > 0: the model's SWA layers' cache is recorded (decodes only, see run_swa_scenario)
    n_ctx: int = KV_SIZE  # with SWA the other layers' cache must hold every token: larger

    @property
    def probe_seq(self) -> int:
        return self.n_seq_max - 1


def decode(*parts: tuple[list[int], int]) -> dict[str, Any]:
    """A batch of ``(seq ids, n)`` parts: n tokens each, from the position after the sequences'
    last (taken when the step runs; a part of several sequences needs them at the same position),
    the last token of each part wanting logits."""
    return {"op": "decode", "parts": [[list(seqs), n] for seqs, n in parts]}


def batch_of(parts: list[list[Any]], seq_pos: dict[str, list[int]]) -> list[list[Any]]:
    entries = []
    for seqs, n in parts:
        starts = {seq_pos[str(seq)][1] + 1 if str(seq) in seq_pos else 0 for seq in seqs}
        if len(starts) != 1:
            raise ValueError(f"a part of sequences {seqs} at different positions {starts}")
        start = starts.pop()
        entries += [[(7 * seqs[0] + 3 * (start + i) + 1) % 64, start + i, list(seqs), i == n - 1] for i in range(n)]
    return entries


def _llama_steps() -> tuple[dict[str, Any], ...]:
    return (
        decode(([0], 5), ([1], 11), ([2], 3), ([3], 7)),       # 26 tokens in ubatches of 8
        decode(([0], 1), ([1], 1), ([2], 1), ([3], 1)),
        {"op": "seq_rm", "seq": 1, "p0": 4, "p1": 8},          # a hole in the middle of seq 1
        decode(([1], 2), ([2], 1)),                             # fills the hole first
        {"op": "seq_cp", "src": 0, "dst": 4, "p0": -1, "p1": -1},
        decode(([0, 4], 2)),                                    # tokens of two sequences: one cell each
        decode(([4], 2), ([0], 1)),
        {"op": "seq_add", "seq": 1, "p0": 8, "p1": -1, "delta": 3},
        {"op": "seq_div", "seq": 3, "p0": 2, "p1": -1, "d": 2},
        decode(([3], 2), ([1], 1)),
        {"op": "seq_add", "seq": 2, "p0": 0, "p1": -1, "delta": -2},   # positions below 0: cells freed
        {"op": "seq_rm", "seq": 2, "p0": -1, "p1": -1},
        {"op": "seq_rm", "seq": 0, "p0": 3, "p1": -1},
        decode(([2], 4), ([0], 2)),
        {"op": "seq_keep", "seq": 4},
        decode(([4], 3), ([1], 2)),
        {"op": "clear"},
        decode(([2], 6)),
    )


def _fill_steps(hybrid: bool) -> tuple[dict[str, Any], ...]:
    """Fill the cache to its last cell (a removed sequence's cells refilled in between), then a
    batch larger than the free cells is refused (nothing changes), then a removal makes room."""
    return (
        decode(([0], 100)),
        decode(([1], 90)),
        decode(([2], 50)),
        {"op": "seq_rm", "seq": 1, "p0": -1, "p1": -1},
        decode(([0], 30)),
        decode(([2], 40), ([0], 10)),
        decode(([1], 26)),                                       # the last free cells, up to cell 255
        decode(([1], 1)),                                        # refused: no free cell
        {"op": "seq_rm", "seq": 0, "p0": 20, "p1": 60},          # the recurrent half refuses a partial removal
        *(({"op": "seq_rm", "seq": 0, "p0": -1, "p1": -1},) if hybrid else ()),
        decode(([1], 30), ([2], 10)),
    )


def _jamba_steps() -> tuple[dict[str, Any], ...]:
    return (
        decode(([0], 5), ([1], 11), ([2], 3)),
        decode(([0], 1), ([1], 1), ([2], 1)),
        {"op": "seq_rm", "seq": 1, "p0": 4, "p1": 8},
        {"op": "seq_rm", "seq": 1, "p0": 11, "p1": -1},
        decode(([1], 2)),
        {"op": "seq_cp", "src": 0, "dst": 3, "p0": -1, "p1": -1},
        decode(([0], 2), ([3], 1)),
        {"op": "seq_add", "seq": 2, "p0": 0, "p1": -1, "delta": 5},
        {"op": "seq_div", "seq": 1, "p0": 0, "p1": -1, "d": 2},
        decode(([2], 2), ([1], 1)),
        {"op": "seq_keep", "seq": 1},
        decode(([0], 4), ([1], 2)),
        {"op": "seq_rm", "seq": 0, "p0": -1, "p1": -1},
        decode(([2], 3)),
        {"op": "clear"},
        decode(([3], 2)),
    )


def _swa_steps() -> tuple[dict[str, Any], ...]:
    """Two sequences past the SWA cache's 256 cells: find_slot wraps to cell 0 and reuses the cells
    whose tokens left the window of 8."""
    return (
        decode(([0], 40), ([1], 20)),
        decode(([0], 1), ([1], 1)),
        decode(([0], 100)),
        decode(([1], 90)),
        decode(([0], 30), ([1], 30)),
        decode(([0], 1), ([1], 1)),
        decode(([0], 50)),
    )


def _scattered_steps() -> tuple[dict[str, Any], ...]:
    """A batch of several ubatches whose free cells are scattered: each ubatch's slot (prepare's)
    takes the holes from the head on, the next ubatch after the cells the one before took."""
    return (
        decode(([0], 6), ([1], 6), ([2], 6)),                   # 18 tokens, ubatches of 6: cells 0-17
        {"op": "seq_rm", "seq": 1, "p0": 1, "p1": 4},           # holes at cells 7-9 (head 7)
        {"op": "seq_rm", "seq": 0, "p0": 2, "p1": 4},           # and at cells 2-3 (head 2)
        decode(([2], 3), ([3], 5)),                             # 6 tokens into 2, 3, 7, 8, 9, 18; then 19, 20
    )


SWA = LlamaShape(swa_layers=(0,), n_swa=8, seed=27)
SCENARIOS = (
    KvScenario("llama_sequence_ops", "llama", n_seq_max=6, n_ubatch=8, steps=_llama_steps()),
    KvScenario("llama_fill", "llama", n_seq_max=4, n_ubatch=48, steps=_fill_steps(hybrid=False)),
    KvScenario("llama_scattered_ubatches", "llama", n_seq_max=5, n_ubatch=6, steps=_scattered_steps()),
    KvScenario("jamba_sequence_ops", "jamba", n_seq_max=5, n_ubatch=8, steps=_jamba_steps()),
    KvScenario("jamba_fill", "jamba", n_seq_max=4, n_ubatch=48, steps=_fill_steps(hybrid=True)),
    KvScenario("granite_swa_window", "granite_swa", n_seq_max=3, n_ubatch=32, steps=_swa_steps(), n_swa=SWA.n_swa,
               n_ctx=2 * KV_SIZE),
)


# -- running a scenario ----------------------------------------------------------------------

class KvContext:
    """One llama.cpp context of a scenario: unified KV of KV_SIZE cells, flash attention as said, 1 thread."""

    def __init__(self, model: recorder.Model, scenario: KvScenario) -> None:
        params = lc.llama_context_default_params()
        params.n_ctx = params.n_batch = scenario.n_ctx
        params.swa_full = False   # the SWA layers' cache as small as their window allows (KV_SIZE here)
        params.n_ubatch = scenario.n_ubatch
        params.n_seq_max = scenario.n_seq_max
        params.n_outputs_max_per_seq = 0
        params.n_threads = params.n_threads_batch = 1
        params.flash_attn_type = (lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if scenario.flash_attn
                                  else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.kv_unified = True
        self.handle = lc.llama_init_from_model(model.handle, params)
        if not self.handle:
            raise RuntimeError("llama.cpp could not create a context")
        self.memory = lc.llama_get_memory(self.handle)
        self.n_ctx = lc.llama_n_ctx(self.handle)

    def close(self) -> None:
        lc.llama_free(self.handle)

    def decode(self, entries: list[list[Any]]) -> int:
        n_seq = max(len(entry[2]) for entry in entries)
        batch = lc.llama_batch_init(len(entries), 0, n_seq)
        try:
            for i, (token, pos, seqs, wants) in enumerate(entries):
                batch.token[i] = token
                batch.pos[i] = pos
                batch.n_seq_id[i] = len(seqs)
                for j, seq in enumerate(seqs):
                    batch.seq_id[i][j] = seq
                batch.logits[i] = wants
            batch.n_tokens = len(entries)
            return int(lc.llama_decode(self.handle, batch))
        finally:
            lc.llama_batch_free(batch)

    def kv_cells(self) -> list[tuple[int, tuple[int, ...]]]:
        """Every used cell's (pos, seq ids), in cell order, from the whole-context state blob."""
        size = lc.llama_state_get_size(self.handle)
        buffer = (ctypes.c_uint8 * size)()
        if lc.llama_state_get_data(self.handle, buffer, size) != size:
            raise RuntimeError("llama_state_get_data wrote less than its size")
        data = memoryview(bytes(buffer))
        (arch_length,) = np.frombuffer(data[:4], dtype="<u4")
        reader = MemoryReader(data[4 + int(arch_length):])
        section = read_kv_section(reader, -1, False, keep=True)
        assert section is not None and len(section.streams) == 1
        return [(cell.pos, cell.seq_ids) for cell in section.streams[0].cells]


def _resolve(printed: Print, known: list[Any], placed: list[list[Any]]) -> list[Any]:
    """A print's cells with their seq sets: a digit is one sequence; 'M' is the set the same cell
    had before (a decode fills empty cells only), or that of the token just placed at that pos."""
    cells: list[Any] = []
    for index, cell in enumerate(printed.cells):
        if cell is None:
            cells.append(None)
            continue
        pos, symbol = cell
        if symbol != "M":
            cells.append([pos, [int(symbol)]])
            continue
        before = known[index]
        if before is not None and before[0] == pos and len(before[1]) > 1:
            cells.append([pos, list(before[1])])
            continue
        tokens = [entry for entry in placed if entry[1] == pos and len(entry[2]) > 1]
        if len(tokens) != 1:
            raise RuntimeError(f"cell {index} 'M' at pos {pos}: {len(tokens)} tokens of several sequences there")
        cells.append([pos, list(tokens[0][2])])
    return cells


def _probe(ctx: KvContext, scenario: KvScenario, tap: LogTap) -> tuple[Print, list[Any]]:
    """The cells now: a batch for the always-empty probe sequence one token longer than the free
    cells makes find_slot print them, then is refused; the seq sets come from the state blob."""
    blob_cells = ctx.kv_cells()
    n_probe = KV_SIZE - len(blob_cells) + 1
    if n_probe > KV_SIZE:   # an empty cache: nothing to print but the head, which the next print has
        return Print(-1, [None] * KV_SIZE, {}), [None] * KV_SIZE
    tap.take()
    entries = [[1, i, [scenario.probe_seq], i == n_probe - 1] for i in range(n_probe)]
    if ctx.decode(entries) != 1:
        raise RuntimeError("the probe batch was not refused")
    printed = parse_prints(tap.take())[0]   # the first ubatch's find_slot: the cells before the probe
    used = [cell for cell in printed.cells if cell is not None]
    if len(used) != len(blob_cells):
        raise RuntimeError(f"the print shows {len(used)} cells, the state blob {len(blob_cells)}")
    cells: list[Any] = [None] * KV_SIZE
    blob_iter = iter(blob_cells)
    for index, cell in enumerate(printed.cells):
        if cell is None:
            continue
        pos, seqs = next(blob_iter)
        if pos != cell[0] or (cell[1] != "M" and seqs != (int(cell[1]),)) or (cell[1] == "M") != (len(seqs) > 1):
            raise RuntimeError(f"cell {index}: printed {cell}, the state blob says {(pos, seqs)}")
        cells[index] = [pos, list(seqs)]
    return printed, cells


def run_scenario(scenario: KvScenario, data_dir: Path, tap: LogTap) -> dict[str, Any]:
    path = {"llama": data_dir / LlamaShape().gguf_name, "granite_swa": data_dir / SWA.gguf_name,
            "jamba": recorder.DEFAULT_DIR / recorder.HYBRIDS["jamba"].gguf_name}[scenario.model]
    model = recorder.Model(path)
    ctx = KvContext(model, scenario)
    steps: list[dict[str, Any]] = []
    try:
        if scenario.n_swa:
            steps = run_swa_steps(ctx, scenario, tap)
            return _scenario_record(scenario, steps)
        if ctx.n_ctx != KV_SIZE:
            raise RuntimeError(f"llama.cpp made a context of {ctx.n_ctx} cells, not {KV_SIZE}")
        known: list[Any] = [None] * KV_SIZE
        seq_pos: dict[str, list[int]] = {}
        pending_head: list[dict[str, Any]] = []   # steps after which the cache was empty: head from the next print
        for spec in scenario.steps:
            step = {key: value for key, value in spec.items() if key != "parts"}
            op = step["op"]
            tap.take()
            if op == "decode":
                step["batch"] = batch_of(spec["parts"], seq_pos)
                step["rc"] = ctx.decode(step["batch"])
                if step["rc"] not in (0, 1):   # the batch itself was wrong: a script to fix, not a placement
                    raise RuntimeError(f"{scenario.name}: llama_decode returned {step['rc']} for {spec}")
                step["ok"] = step["rc"] == 0
                text = tap.take()
                prints = one_per_find_slot(parse_prints(text))
                if prints:
                    for waiting in pending_head:
                        waiting["head"] = prints[0].head
                    pending_head.clear()
            elif op == "seq_rm":
                step["ok"] = bool(lc.llama_memory_seq_rm(ctx.memory, step["seq"], step["p0"], step["p1"]))
            elif op == "seq_cp":
                lc.llama_memory_seq_cp(ctx.memory, step["src"], step["dst"], step["p0"], step["p1"])
            elif op == "seq_keep":
                lc.llama_memory_seq_keep(ctx.memory, step["seq"])
            elif op == "seq_add":
                lc.llama_memory_seq_add(ctx.memory, step["seq"], step["p0"], step["p1"], step["delta"])
            elif op == "seq_div":
                lc.llama_memory_seq_div(ctx.memory, step["seq"], step["p0"], step["p1"], step["d"])
            elif op == "clear":
                lc.llama_memory_clear(ctx.memory, True)
            else:
                raise ValueError(f"unknown op {op!r}")
            printed, cells = _probe(ctx, scenario, tap)
            if op == "decode":
                step["ubatches"], step["cells_per_ubatch"], step["heads_per_ubatch"] = [], [], []
                if step["ok"]:
                    state = known
                    # the print before ubatch i + 1 holds the cells after ubatch i; the probe's the last
                    for before, after in zip(prints, [*prints[1:], printed], strict=True):
                        state = cells if after is printed else _resolve(after, state, step["batch"])
                        step["ubatches"].append(placed_ubatch(before, state, step["batch"]))
                        step["cells_per_ubatch"].append(state)
                        step["heads_per_ubatch"].append(after.head)
            step["cells"] = cells
            step["head"] = printed.head
            step["seq_pos"] = {str(s): list(bounds) for s, bounds in sorted(printed.seq_pos.items())}
            if printed.head < 0:
                pending_head.append(step)
            known, seq_pos = cells, step["seq_pos"]
            steps.append(step)
        if pending_head:
            raise RuntimeError(f"{scenario.name} ends with an empty cache: its head would be unknown")
    finally:
        ctx.close()
        model.close()
    return _scenario_record(scenario, steps)


def _scenario_record(scenario: KvScenario, steps: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": scenario.name, "model": scenario.model, "kv_size": KV_SIZE, "n_seq_max": scenario.n_seq_max,
            "n_ubatch": scenario.n_ubatch, "n_swa": scenario.n_swa,
            "swa_type": "standard" if scenario.n_swa else "none", "unified": True,
            "flash_attn": scenario.flash_attn, "probe_seq": scenario.probe_seq, "steps": steps}


def _single_sequence_cells(printed: Print) -> list[Any]:
    if any(cell is not None and cell[1] == "M" for cell in printed.cells):
        raise RuntimeError("a cell of several sequences in a script without forks")
    return [None if cell is None else [cell[0], [int(cell[1])]] for cell in printed.cells]


def run_swa_steps(ctx: KvContext, scenario: KvScenario, tap: LogTap) -> list[dict[str, Any]]:
    """The decodes of a scenario recorded in the cache of the model's SWA layers.

    No probe reaches that cache (the other layers' cache, which holds every token, is prepared
    first and refuses a batch first), so the cells after a decode are those the next decode's
    first find_slot prints; after the last step one more decode (of the probe sequence, not a
    step) prints them.  The scripts fork nothing: every cell holds one sequence."""
    steps: list[dict[str, Any]] = []
    decoded: list[tuple[dict[str, Any], list[Print]]] = []
    decoded_pos: dict[str, list[int]] = {}   # each sequence's positions so far (decodes only: from the batches)
    for spec in [*scenario.steps, None]:
        batch = (batch_of(spec["parts"], decoded_pos) if spec is not None
                 else [[1, 0, [scenario.probe_seq], True]])
        for _, pos, seqs, _ in batch:
            for seq in seqs:
                decoded_pos[str(seq)] = [0, max(pos, decoded_pos.get(str(seq), [0, -1])[1])]
        tap.take()
        rc = ctx.decode(batch)
        if rc != 0:
            raise RuntimeError(f"{scenario.name}: llama_decode returned {rc} for {spec}")
        prints = one_per_find_slot([p for p in parse_prints(tap.take()) if p.n_swa == scenario.n_swa])
        if decoded:   # the first print of this decode: the cells after the one before it
            step, its_prints = decoded[-1]
            state: list[Any] = []
            for before, after in zip(its_prints, [*its_prints[1:], prints[0]], strict=True):
                state = _single_sequence_cells(after)
                step["ubatches"].append(placed_ubatch(before, state, step["batch"]))
                step["cells_per_ubatch"].append(state)
                step["heads_per_ubatch"].append(after.head)
            step.update(cells=state, head=prints[0].head,
                        seq_pos={str(s): list(bounds) for s, bounds in sorted(prints[0].seq_pos.items())})
        if spec is None:
            break
        step = {"op": "decode", "batch": batch, "rc": rc, "ok": True, "ubatches": [], "cells_per_ubatch": [],
                "heads_per_ubatch": []}
        steps.append(step)
        decoded.append((step, prints))
    return steps


def record(out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    for shape in (LlamaShape(), SWA):
        shape.write_gguf(out / shape.gguf_name)
    tap = LogTap()
    version = recorder.llama_version()
    scenarios = []
    for scenario in SCENARIOS:
        print(f"recording {scenario.name}", file=sys.stderr)
        scenarios.append(run_scenario(scenario, out, tap))
    result = {"llama_cpp": version["llama_cpp_python"], "llama_cpp_commit": version["llama_cpp_commit"],
              "command": "python " + " ".join(shlex.quote(a) for a in sys.argv), "scenarios": scenarios}
    (out / PLACEMENT).write_text(_compact_json(result) + "\n")
    return result


def _compact_json(value: Any) -> str:
    """JSON with one step per line: small, and a diff of two recordings reads step by step."""
    steps_text = []
    head = {key: value[key] for key in value if key != "scenarios"}
    lines = ["{" + json.dumps(head, separators=(",", ":"))[1:-1] + ',"scenarios":[']
    for n, scenario in enumerate(value["scenarios"]):
        fields = {key: scenario[key] for key in scenario if key != "steps"}
        steps_text = [json.dumps(step, separators=(",", ":")) for step in scenario["steps"]]
        lines.append("{" + json.dumps(fields, separators=(",", ":"))[1:-1] + ',"steps":[')
        lines.append(",\n".join(steps_text))
        lines.append("]}" + ("," if n + 1 < len(value["scenarios"]) else ""))
    lines.append("]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", type=Path, metavar="DIR", default=DEFAULT_DIR,
                        help="write DIR/placement.json (default %(default)s)")
    args = parser.parse_args(argv)
    result = record(args.record)
    print(json.dumps({s["name"]: len(s["steps"]) for s in result["scenarios"]}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
