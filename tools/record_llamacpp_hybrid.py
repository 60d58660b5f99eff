"""Record a hybrid model's state bytes from llama.cpp, with the logits each one continues to.

A development tool beside ``tools/record_llamacpp.py`` (whose model writer and llama.cpp wrappers
it uses), run under a Python with ``llama-cpp-python`` 0.3.36, ``gguf`` and this package::

    python tools/record_llamacpp_hybrid.py [--out DIR]      # default tests/data/llamacpp_hybrid

It writes a tiny random Jamba (``DIR/tiny_jamba4.gguf``: Mamba-1 layers 0, 1, 3 and an attention
layer 2) and runs one script in a context of 3 sequences and one KV stream of 256 cells, once
with flash attention off (V stored transposed) and once on (``DIR/fa_off/``, ``DIR/fa_on/``):
prompts for sequences 0 and 1 in one batch, a step of both, a ``seq_cp`` fork of 0 into 2 (the
KV cells of 0 then list both), a step of all three and a last step of sequence 2.  Then it takes
from llama.cpp ``llama_state_get_data`` (``context.blob``), ``llama_state_seq_get_data`` of each
sequence with flags 0 and ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`` (``seq<i>.blob``,
``seq<i>.partial.blob``), ``llama_state_seq_save_file`` (``seq<i>.ggsq``) and
``llama_state_save_file`` (``session.ggsn``).

Each blob and file is restored into a fresh context and the next token decoded; its logits are
recorded (``DIR/<recording>/record.json``), beside those of the context that wrote them: the
package's writer of the same bytes must give llama.cpp the same continuation.  A PARTIAL_ONLY
blob holds the recurrent half only: it is read over a context that already holds the sequence's
KV cells (restored from the full blob; the logits are the reference's), and into an empty one
(``alone_*``): llama.cpp accepts it and decodes the next token with no attention past, to other
logits (see ``DIR/README.md``).

The cells are recorded from the whole-context blob's KV section (read with
``recurrent_cache.formats.kv``) and, independently, each sequence's smallest and largest position
as llama.cpp's memory reports them (``llama_memory_seq_pos_min`` / ``_max``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp as lc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record_llamacpp as recorder  # noqa: E402  (the sibling script: the Jamba writer, llama.cpp wrappers)

from recurrent_cache.formats.blob import MemoryReader  # noqa: E402
from recurrent_cache.formats.kv import read_kv_section  # noqa: E402

REPO = recorder.REPO
DEFAULT_DIR = REPO / "tests" / "data" / "llamacpp_hybrid"
RECORD = "record.json"
GGUF_NAME = "tiny_jamba4.gguf"
SHAPE = recorder.JambaShape(head_count_kv=(0, 0, 1, 0), seed=29)
N_SEQ_MAX = 3
PARTIAL_ONLY = recorder.PARTIAL_ONLY

# the script: (token, seq) per decoded token, one batch per step; the fork between steps 2 and 3
PROMPTS = {0: (5, 17, 42), 1: (1, 2, 3, 60, 33)}
STEPS = ({0: 11, 1: 22}, {0: 44, 1: 55, 2: 6}, {2: 9})
FORK = (0, 2)                       # seq_cp(0 -> 2, every position) after the first step
NEXT_TOKEN = {0: 8, 1: 24, 2: 40}   # the continuation decoded after each restore


@dataclass(frozen=True)
class Recording:
    """One context setting: what ``recorder.Context`` reads of a scenario."""

    name: str
    flash_attn: bool
    kv_unified: bool = True      # one KV stream: a fork's cells list both sequences at once
    n_seq_max: int = N_SEQ_MAX
    n_ctx: int = 256             # llama.cpp's smallest KV cache (n_ctx is padded to 256)


RECORDINGS = (Recording("fa_off", flash_attn=False), Recording("fa_on", flash_attn=True))


def _floats(logits: list[float]) -> list[float]:
    """The logits as float32 values written exactly (JSON floats of the float32 numbers)."""
    return [float(x) for x in np.asarray(logits, dtype=np.float32)]


class Script:
    """The decoded script's tokens per sequence (a fork inherits its source's), replayed on a context."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}

    def run(self, ctx: Any) -> None:
        entries = [(token, pos, seq, pos == len(prompt) - 1) for seq, prompt in PROMPTS.items()
                   for pos, token in enumerate(prompt)]
        ctx.decode(entries)
        self.tokens = {seq: list(prompt) for seq, prompt in PROMPTS.items()}
        for n, step in enumerate(STEPS):
            if n == 1:
                ctx.seq_cp(*FORK)
                self.tokens[FORK[1]] = list(self.tokens[FORK[0]])
            self.decode_step(ctx, step)

    def decode_step(self, ctx: Any, step: dict[int, int]) -> list[list[float]]:
        """Decode one token per sequence of ``step`` at its next position; their logits, in seq order."""
        entries = [(token, len(self.tokens[seq]), seq, True) for seq, token in sorted(step.items())]
        logits = ctx.decode(entries)
        for seq, token in sorted(step.items()):
            self.tokens[seq].append(token)
        return logits

    def next_pos(self, seq: int) -> int:
        return len(self.tokens[seq])


def _continue(ctx: Any, script: Script, seqs: list[int]) -> dict[str, list[float]] | str:
    """Decode NEXT_TOKEN of each of ``seqs`` in one batch at its next position: the logits by seq,
    or llama.cpp's refusal."""
    entries = [(NEXT_TOKEN[seq], script.next_pos(seq), seq, True) for seq in seqs]
    try:
        logits = ctx.decode(entries)
    except RuntimeError as exc:
        return str(exc)
    return {str(seq): _floats(row) for seq, row in zip(seqs, logits, strict=True)}


def _kv_cells(context_blob: bytes) -> list[list[Any]]:
    """The whole blob's KV cells in cell order, [pos, [seq ids]] (one stream: unified)."""
    reader = MemoryReader(memoryview(context_blob))
    (length,) = np.frombuffer(context_blob[:4], dtype="<u4")
    reader.offset = 4 + int(length)
    section = read_kv_section(reader, -1, False, keep=True)
    assert section is not None and len(section.streams) == 1
    return [[cell.pos, list(cell.seq_ids)] for cell in section.streams[0].cells]


def _seq_positions(ctx: Any) -> dict[str, list[int]]:
    memory = lc.llama_get_memory(ctx.handle)
    return {str(seq): [int(lc.llama_memory_seq_pos_min(memory, seq)), int(lc.llama_memory_seq_pos_max(memory, seq))]
            for seq in range(N_SEQ_MAX)}


def record_one(model: Any, setting: Recording, out: Path) -> dict[str, Any]:
    """Run the script under ``setting``, write its blobs and files to ``out``; what was recorded."""
    out.mkdir(parents=True, exist_ok=True)
    script = Script()
    seqs = list(range(N_SEQ_MAX))
    files: dict[str, dict[str, Any]] = {}

    def keep(name: str, kind: str, data: bytes, **extra: Any) -> None:
        (out / name).write_bytes(data)
        files[name] = {"kind": kind, "size": len(data), **extra}

    with recorder.Context(model, setting) as ctx:
        script.run(ctx)
        context_blob = ctx.state_get_data()
        keep("context.blob", "context_blob", context_blob)
        for seq in seqs:
            keep(f"seq{seq}.blob", "seq_blob", ctx.state_seq_get_data(seq), seq_id=seq, flags=0)
            keep(f"seq{seq}.partial.blob", "seq_blob", ctx.state_seq_get_data(seq, PARTIAL_ONLY), seq_id=seq,
                 flags=PARTIAL_ONLY)
            path = out / f"seq{seq}.ggsq"
            if not ctx.state_seq_save_file(path, seq, script.tokens[seq]):
                raise RuntimeError(f"llama_state_seq_save_file of seq {seq} failed")
            keep(path.name, "seq_file", path.read_bytes(), seq_id=seq, tokens=script.tokens[seq])
        if not ctx.state_save_file(out / "session.ggsn", script.tokens[0]):
            raise RuntimeError("llama_state_save_file failed")
        keep("session.ggsn", "session_file", (out / "session.ggsn").read_bytes(), tokens=script.tokens[0])
        positions = _seq_positions(ctx)
        reference = _continue(ctx, script, seqs)

    def fresh() -> Any:
        return recorder.Context(model, setting)

    for name, item in files.items():
        data = (out / name).read_bytes()
        with fresh() as ctx:
            if item["kind"] == "context_blob":
                accepted = ctx.state_set_data(data) == len(data)
                targets = seqs
            elif item["kind"] == "session_file":
                accepted = ctx.state_load_file(out / name) == (True, item["tokens"])
                targets = seqs
            elif item["kind"] == "seq_file":
                read, tokens = ctx.state_seq_load_file(out / name, item["seq_id"])
                accepted = read > 0 and tokens == item["tokens"]
                targets = [item["seq_id"]]
            elif item["flags"] == 0:
                accepted = ctx.state_seq_set_data(data, item["seq_id"]) == len(data)
                targets = [item["seq_id"]]
            else:   # the recurrent half over the KV half the full blob put there
                full = (out / f"seq{item['seq_id']}.blob").read_bytes()
                accepted = (ctx.state_seq_set_data(full, item["seq_id"]) == len(full)
                            and ctx.state_seq_set_data(data, item["seq_id"], PARTIAL_ONLY) == len(data))
                targets = [item["seq_id"]]
            item["accepted"] = accepted
            item["logits"] = _continue(ctx, script, targets)
        if item["kind"] == "seq_blob" and item["flags"] == PARTIAL_ONLY:
            with fresh() as ctx:   # alone: the attention half holds nothing of the sequence
                item["alone_accepted"] = ctx.state_seq_set_data(data, item["seq_id"], PARTIAL_ONLY) == len(data)
                item["alone_positions"] = _seq_positions(ctx)[str(item["seq_id"])]
                item["alone_logits"] = _continue(ctx, script, [item["seq_id"]])
    return {"recording": setting.name, "flash_attn": setting.flash_attn, "kv_unified": setting.kv_unified,
            "n_seq_max": setting.n_seq_max, "n_ctx": setting.n_ctx, "tokens": {str(s): t for s, t in
                                                                                script.tokens.items()},
            "next_token": {str(s): t for s, t in NEXT_TOKEN.items()}, "seq_positions": positions,
            "kv_cells": _kv_cells(context_blob), "reference_logits": reference, "files": files}


def record(out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    gguf_path = out / GGUF_NAME
    SHAPE.write_gguf(gguf_path)
    recorder.quiet_logs()
    model = recorder.Model(gguf_path)
    try:
        shape = {**SHAPE.record(), "kv_type": "f16"}
        common = {"llama_cpp": recorder.llama_version(), "arch": "jamba", "model": GGUF_NAME, "shape": shape,
                  "command": "python " + " ".join(shlex.quote(arg) for arg in sys.argv)}
        records = {}
        for setting in RECORDINGS:
            print(f"recording {setting.name}", file=sys.stderr)
            item = {**common, **record_one(model, setting, out / setting.name)}
            (out / setting.name / RECORD).write_text(json.dumps(item, indent=1) + "\n")
            records[setting.name] = item
    finally:
        model.close()
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR, help="the directory to write (default: %(default)s)")
    args = parser.parse_args(argv)
    for name, item in record(args.out).items():
        refused = [file for file, entry in item["files"].items() if not entry["accepted"]]
        print(f"{name}: {len(item['files'])} blobs and files, {len(item['kv_cells'])} KV cells, refused by "
              f"llama.cpp: {refused or 'none'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
