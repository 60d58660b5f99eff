"""Record a hybrid model's state bytes from llama.cpp, with the logits each one continues to.

A development tool beside ``tools/record_llamacpp.py`` (whose model writer and llama.cpp wrappers
it uses), run under a Python with ``llama-cpp-python`` 0.3.36, ``gguf`` and this package::

    python tools/record_llamacpp_hybrid.py [--out DIR]      # default tests/data/llamacpp_hybrid

It writes two tiny random hybrids with ``gguf``: a Jamba (``DIR/tiny_jamba4.gguf``: Mamba-1 layers
0, 1, 3 and an attention layer 2) and a Granite-4 hybrid (``DIR/tiny_granitehybrid.gguf``: Mamba-2
layers 0, 2, 3 and an attention layer 1 with RoPE).  For each it runs one script in a context of
3 sequences and one KV stream of 256 cells, once with flash attention off (V stored transposed)
and once on (``DIR/<model>_fa_off/``, ``DIR/<model>_fa_on/``): prompts for sequences 0 and 1 in
one batch, a step of both, a ``seq_cp`` fork of 0 into 2 (the KV cells of 0 then list both), a
step of all three and a last step of sequence 2.  Then it takes from llama.cpp
``llama_state_get_data`` (``context.blob``), ``llama_state_seq_get_data`` of each sequence with
flags 0 and ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`` (``seq<i>.blob``, ``seq<i>.partial.blob``),
``llama_state_seq_save_file`` (``seq<i>.ggsq``) and ``llama_state_save_file`` (``session.ggsn``).

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
N_SEQ_MAX = 3
PARTIAL_ONLY = recorder.PARTIAL_ONLY

# the script: (token, seq) per decoded token, one batch per step; the fork between steps 2 and 3
PROMPTS = {0: (5, 17, 42), 1: (1, 2, 3, 60, 33)}
STEPS = ({0: 11, 1: 22}, {0: 44, 1: 55, 2: 6}, {2: 9})
FORK = (0, 2)                       # seq_cp(0 -> 2, every position) after the first step
NEXT_TOKEN = {0: 8, 1: 24, 2: 40}   # the continuation decoded after each restore


@dataclass(frozen=True)
class GraniteHybridShape(recorder.HeadCountKvLayers):
    """A tiny Granite-4 hybrid (``granitehybrid``): Mamba-2 layers where head_count_kv is 0,
    attention with RoPE elsewhere, a gated FFN in every layer; seeded random f32 weights."""

    n_vocab: int = 64
    n_embd: int = 16             # llama.cpp requires d_inner == 2 * n_embd
    n_ff: int = 32
    n_head: int = 2
    head_count_kv: tuple[int, ...] = (0, 1, 0, 0)   # per layer: 0 = recurrent
    d_conv: int = 4
    d_state: int = 8
    n_ssm_head: int = 4          # ssm.time_step_rank: Mamba-2 heads of d_inner / n_ssm_head
    n_group: int = 2
    rms_eps: float = 1e-5
    seed: int = 31

    @property
    def conv_channels(self) -> int:
        return self.d_inner + 2 * self.n_group * self.d_state

    def record(self) -> dict[str, Any]:
        """The shape as a recording states it."""
        return {**self.layer_record(), "recurrent_kind": "mamba2", "n_embd_r": (self.d_conv - 1) * self.conv_channels,
                "n_embd_s": self.d_state * self.d_inner, "dtype_r": "f32", "dtype_s": "f32", "d_conv": self.d_conv,
                "d_inner": self.d_inner, "d_state": self.d_state, "n_ssm_head": self.n_ssm_head,
                "n_group": self.n_group, "n_embd": self.n_embd, "n_head": self.n_head, "n_ff": self.n_ff,
                "n_vocab": self.n_vocab, "rms_eps": self.rms_eps, "seed": self.seed}

    def write_gguf(self, path: Path) -> None:
        """Every tensor llama.cpp's granitehybrid loader requires (no MoE, no scales: their defaults)."""
        import gguf

        normal = recorder.seeded_normal(self.seed)
        e = self.n_embd
        head = e // self.n_head
        arch = "granitehybrid"
        writer: Any = gguf.GGUFWriter(str(path), arch)
        writer.add_name("recurrent-cache-tiny-granitehybrid")
        writer.add_uint32(f"{arch}.context_length", 4096)
        writer.add_uint32(f"{arch}.embedding_length", e)
        writer.add_uint32(f"{arch}.feed_forward_length", self.n_ff)
        writer.add_uint32(f"{arch}.block_count", self.n_layer)
        writer.add_uint32(f"{arch}.attention.head_count", self.n_head)
        writer.add_array(f"{arch}.attention.head_count_kv", list(self.head_count_kv))
        writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", self.rms_eps)
        writer.add_uint32(f"{arch}.rope.dimension_count", head)
        recorder.add_mamba2_keys(writer, arch, self)
        writer.add_uint32(f"{arch}.vocab_size", self.n_vocab)
        # numpy shapes are ggml's {ne0, ne1} reversed
        recorder.add_vocab_and_output(writer, self.n_vocab, e, normal)
        for il in range(self.n_layer):
            blk = f"blk.{il}."
            writer.add_tensor(blk + "attn_norm.weight", np.ones(e, dtype=np.float32))
            if il in self.recurrent_layers:
                recorder.add_mamba2_tensors(writer, blk, self, normal)
            else:
                recorder.add_attention_tensors(writer, blk, e, self.head_count_kv[il] * head, normal)
            recorder.add_gated_ffn(writer, blk, e, self.n_ff, normal)
        recorder.finish_gguf(writer)


@dataclass(frozen=True)
class HybridModel:
    """A tiny hybrid GGUF written here: its architecture name, file name and shape."""

    arch: str
    gguf_name: str
    shape: Any       # recorder.JambaShape or GraniteHybridShape: record() and write_gguf(path)


MODELS = {
    "jamba": HybridModel("jamba", "tiny_jamba4.gguf", recorder.JambaShape(head_count_kv=(0, 0, 1, 0), seed=29)),
    "granitehybrid": HybridModel("granitehybrid", "tiny_granitehybrid.gguf", GraniteHybridShape()),
}


@dataclass(frozen=True)
class Recording:
    """One model and context setting: what ``recorder.Context`` reads of a scenario."""

    name: str
    model: str                   # a key of MODELS
    flash_attn: bool
    kv_unified: bool = True      # one KV stream: a fork's cells list both sequences at once
    n_seq_max: int = N_SEQ_MAX
    n_ctx: int = 256             # llama.cpp's smallest KV cache (n_ctx is padded to 256)


RECORDINGS = tuple(Recording(f"{model}_fa_{'on' if flash_attn else 'off'}", model, flash_attn)
                   for model in MODELS for flash_attn in (False, True))


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
    return {"recording": setting.name, "model_key": setting.model, "flash_attn": setting.flash_attn,
            "kv_unified": setting.kv_unified, "n_seq_max": setting.n_seq_max, "n_ctx": setting.n_ctx,
            "tokens": {str(s): t for s, t in script.tokens.items()},
            "next_token": {str(s): t for s, t in NEXT_TOKEN.items()}, "seq_positions": positions,
            "kv_cells": _kv_cells(context_blob), "reference_logits": reference, "files": files}


def record(out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    recorder.quiet_logs()
    version = recorder.llama_version()
    command = "python " + " ".join(shlex.quote(arg) for arg in sys.argv)
    records = {}
    for key, hybrid in MODELS.items():
        gguf_path = out / hybrid.gguf_name
        hybrid.shape.write_gguf(gguf_path)
        model = recorder.Model(gguf_path)
        try:
            common = {"llama_cpp": version, "arch": hybrid.arch, "model": hybrid.gguf_name,
                      "shape": {**hybrid.shape.record(), "kv_type": "f16"}, "command": command}
            for setting in RECORDINGS:
                if setting.model != key:
                    continue
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
