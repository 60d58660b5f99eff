"""Record state blobs and files from a real, current llama.cpp; load files written by others into it.

A development tool, not part of the package's runtime.  It runs under a
Python that has ``llama-cpp-python`` (it compiles llama.cpp) and ``gguf``,
for instance a separate venv::

    python3 -m venv /work/llama-venv
    /work/llama-venv/bin/pip install llama-cpp-python==0.3.36 numpy gguf

Four modes:

``--record DIR`` (default ``tests/data/llamacpp_current``)
    For each scenario (the package's shipped Mamba-1 GGUF; small random
    hybrids that this script writes with ``gguf``: a Jamba (Mamba-1 and
    attention layers) with two context settings and a Nemotron-H (Mamba-2,
    attention and FFN-only layers)), decode three sequences in one context
    (prompts of 3, 5 and 7 tokens in one batch, then 2 steps of one token
    each), fork one with ``seq_cp`` where the scenario says so, then take from
    llama.cpp: ``llama_state_seq_get_data`` of every sequence id (and of an
    unused one), for hybrids also with ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``,
    ``llama_state_get_data`` of the whole context, ``llama_state_seq_save_file``
    of every sequence (``ggsq``) and ``llama_state_save_file`` (``ggsn``).
    Each sequence is then continued by 2 tokens in the context that wrote
    them; those logits are the reference.  Every blob and file is restored
    into a fresh context and continued the same way, and the largest logit
    difference is kept under ``checks``: llama.cpp restores its own state.
    Writes ``DIR/<scenario>/*.blob|*.ggsq|*.ggsn``, ``DIR/records.jsonl.gz``
    (one JSON object per scenario) and the hybrid GGUFs.

``--check DIR``
    Load every state blob and file found in ``DIR/<scenario>/`` under the
    names a recording uses (``seq<i>.blob``, ``context.blob``,
    ``seq<i>.ggsq``, ``session.ggsn``; written by someone else, say the
    package) into a fresh llama.cpp context of the recorded scenario, continue
    as the recording did, and print JSON: per file whether llama.cpp accepted
    it, the logits, and the largest difference from the recorded reference.
    Exits 1 when a file is refused or a difference exceeds ``--tolerance``
    times the largest recorded logit.  ``--check`` on a recording checks
    llama.cpp against itself.

``--record-exchange [DIR]`` (default ``tests/data/llamacpp_exchange``)
    One sequence of the shipped model, for ``docs/llamacpp-exchange.md``: a
    59-byte prompt decoded in one batch, saved with
    ``llama_state_seq_save_file`` (``DIR/f16.ggsq``), then continued one token
    per step for 54 steps; the same again for the shipped weights widened to
    f32 (``DIR/f32.ggsq``; the package writes that GGUF, so it must be
    importable).  The logits are in ``DIR/logits.npz``, the rest in
    ``DIR/exchange.json``.

``--describe FILE``
    Print the byte layout of a blob or file of a recording (see
    ``docs/llamacpp_formats.md``), as this script's own parser reads it.

Every blob and file recorded is also split into its sections by that
parser, which must end exactly at the last byte: the layout in
``records.jsonl.gz`` is checked, not assumed.
"""

from __future__ import annotations

import argparse
import ctypes
import gzip
import hashlib
import json
import shlex
import struct
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO / "tests" / "data" / "llamacpp_current"
MAMBA_GGUF = REPO / "src" / "recurrent_cache" / "models" / "data" / "byte_mamba.gguf"
RECORDS_NAME = "records.jsonl.gz"

SEQ_BLOB_MAGIC = 0xAF143CD8          # llama_state_seq_get_data's header (llama-context.cpp io_magic)
SEQ_FILE_MAGIC = 0x67677371          # 'ggsq'
SESSION_FILE_MAGIC = 0x6767736E      # 'ggsn'
PARTIAL_ONLY = 1                     # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
GGML_TYPE_SIZES = {0: 4, 1: 2, 30: 2}   # f32, f16, bf16: the state and KV types recorded here
CELL_EXT_BYTES = 12                  # llama_kv_cell_ext {i32 x, i32 y, i32 tok}, only for M-RoPE/PLE models


# -- the hybrid model ------------------------------------------------------------------

class HeadCountKvLayers:
    """The layers of a hybrid whose recurrent layers are those of head_count_kv 0 (Jamba,
    Granite-4), with llama.cpp's expansion factor 2 (``d_inner == 2 * n_embd``)."""

    head_count_kv: tuple[int, ...]
    n_embd: int
    n_head: int

    @property
    def n_layer(self) -> int:
        return len(self.head_count_kv)

    @property
    def d_inner(self) -> int:
        return 2 * self.n_embd

    @property
    def recurrent_layers(self) -> list[int]:
        return [il for il, n_kv in enumerate(self.head_count_kv) if n_kv == 0]

    @property
    def attention_layers(self) -> list[int]:
        return [il for il, n_kv in enumerate(self.head_count_kv) if n_kv > 0]

    def layer_record(self) -> dict[str, Any]:
        """The fields of a recording's shape every such hybrid states."""
        head = self.n_embd // self.n_head
        return {"n_layer": self.n_layer, "recurrent_layers": self.recurrent_layers,
                "attention_layers": self.attention_layers, "head_count_kv": list(self.head_count_kv),
                "n_embd_k_gqa": [n_kv * head for n_kv in self.head_count_kv],
                "n_embd_v_gqa": [n_kv * head for n_kv in self.head_count_kv], "kv_cell_ext": False}


@dataclass(frozen=True)
class JambaShape(HeadCountKvLayers):
    """A tiny Jamba: Mamba-1 layers where head_count_kv is 0, attention (no RoPE) elsewhere."""

    n_vocab: int = 64
    n_embd: int = 16             # Jamba requires d_inner == 2 * n_embd
    n_ff: int = 32
    n_head: int = 2
    head_count_kv: tuple[int, ...] = (0, 1, 0, 0, 1)   # per layer: 0 = recurrent
    d_conv: int = 4
    d_state: int = 4
    dt_rank: int = 2
    rms_eps: float = 1e-6
    seed: int = 18

    gguf_name = "tiny_jamba.gguf"

    def record(self) -> dict[str, Any]:
        """The shape as a recording states it."""
        return {**self.layer_record(), "recurrent_kind": "mamba1", "n_embd_r": (self.d_conv - 1) * self.d_inner,
                "n_embd_s": self.d_state * self.d_inner, "dtype_r": "f32", "dtype_s": "f32", "d_conv": self.d_conv,
                "d_inner": self.d_inner, "d_state": self.d_state, "dt_rank": self.dt_rank, "n_embd": self.n_embd,
                "n_head": self.n_head, "n_ff": self.n_ff, "n_vocab": self.n_vocab, "rms_eps": self.rms_eps,
                "seed": self.seed}

    def write_gguf(self, path: Path) -> None:
        write_jamba_gguf(path, self)


@dataclass(frozen=True)
class NemotronHShape:
    """A tiny Nemotron-H: Mamba-2 layers (head_count_kv 0 and feed_forward_length 0), attention
    layers (head_count_kv > 0), and FFN-only layers (feed_forward_length > 0), which hold neither
    recurrent nor KV state."""

    n_vocab: int = 64
    n_embd: int = 16
    n_head: int = 2
    head_count_kv: tuple[int, ...] = (0, 1, 0, 0)    # per layer
    feed_forward: tuple[int, ...] = (0, 0, 32, 0)    # per layer: > 0 = an FFN-only layer
    d_conv: int = 4
    d_inner: int = 32
    d_state: int = 8
    n_ssm_head: int = 4          # ssm.time_step_rank: Mamba-2 heads of d_inner / n_ssm_head
    n_group: int = 2
    norm_eps: float = 1e-5
    seed: int = 19
    gguf_name = "tiny_nemotron_h.gguf"

    @property
    def n_layer(self) -> int:
        return len(self.head_count_kv)

    @property
    def recurrent_layers(self) -> list[int]:
        return [il for il in range(self.n_layer) if self.head_count_kv[il] == 0 and self.feed_forward[il] == 0]

    @property
    def attention_layers(self) -> list[int]:
        return [il for il in range(self.n_layer) if self.head_count_kv[il] > 0 and self.feed_forward[il] == 0]

    @property
    def conv_channels(self) -> int:
        return self.d_inner + 2 * self.n_group * self.d_state

    def record(self) -> dict[str, Any]:
        head = self.n_embd // self.n_head
        return {"n_layer": self.n_layer, "recurrent_layers": self.recurrent_layers,
                "attention_layers": self.attention_layers, "head_count_kv": list(self.head_count_kv),
                "feed_forward_length": list(self.feed_forward), "recurrent_kind": "mamba2",
                "n_embd_r": (self.d_conv - 1) * self.conv_channels, "n_embd_s": self.d_state * self.d_inner,
                "dtype_r": "f32", "dtype_s": "f32", "d_conv": self.d_conv, "d_inner": self.d_inner,
                "d_state": self.d_state, "n_ssm_head": self.n_ssm_head, "n_group": self.n_group,
                "n_embd": self.n_embd, "n_head": self.n_head, "n_vocab": self.n_vocab, "norm_eps": self.norm_eps,
                "seed": self.seed, "n_embd_k_gqa": [n_kv * head for n_kv in self.head_count_kv],
                "n_embd_v_gqa": [n_kv * head for n_kv in self.head_count_kv], "kv_cell_ext": False}

    def write_gguf(self, path: Path) -> None:
        """Seeded random f32 weights, every tensor llama.cpp's nemotron_h loader requires."""
        import gguf

        normal = seeded_normal(self.seed)
        e = self.n_embd
        head = e // self.n_head
        writer: Any = gguf.GGUFWriter(str(path), "nemotron_h")
        writer.add_name("recurrent-cache-tiny-nemotron-h")
        writer.add_uint32("nemotron_h.context_length", 4096)
        writer.add_uint32("nemotron_h.embedding_length", e)
        writer.add_uint32("nemotron_h.block_count", self.n_layer)
        writer.add_array("nemotron_h.feed_forward_length", list(self.feed_forward))
        writer.add_uint32("nemotron_h.attention.head_count", self.n_head)
        writer.add_array("nemotron_h.attention.head_count_kv", list(self.head_count_kv))
        writer.add_float32("nemotron_h.attention.layer_norm_epsilon", self.norm_eps)
        writer.add_float32("nemotron_h.attention.layer_norm_rms_epsilon", self.norm_eps)
        add_mamba2_keys(writer, "nemotron_h", self)
        writer.add_uint32("nemotron_h.vocab_size", self.n_vocab)
        add_vocab_and_output(writer, self.n_vocab, e, normal)
        for il in range(self.n_layer):
            blk = f"blk.{il}."
            writer.add_tensor(blk + "attn_norm.weight", np.ones(e, dtype=np.float32))
            if il in self.recurrent_layers:
                add_mamba2_tensors(writer, blk, self, normal)
            elif il in self.attention_layers:
                add_attention_tensors(writer, blk, e, self.head_count_kv[il] * head, normal)
            else:
                writer.add_tensor(blk + "ffn_up.weight", normal(self.feed_forward[il], e))
                writer.add_tensor(blk + "ffn_down.weight", normal(e, self.feed_forward[il]))
        finish_gguf(writer)


def add_vocab_and_output(writer: Any, n_vocab: int, n_embd: int, normal: Any) -> None:
    """The GGUF fields every tiny model here shares, in this order: f32 weights, no tokenizer, the
    token embeddings, the output norm (ones) and the output projection (``normal`` draws weights)."""
    writer.add_uint32("general.file_type", 0)
    writer.add_string("tokenizer.ggml.model", "no_vocab")
    writer.add_tensor("token_embd.weight", normal(n_vocab, n_embd, scale=1.0))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", normal(n_vocab, n_embd))


def add_attention_tensors(writer: Any, blk: str, n_embd: int, kv_width: int, normal: Any) -> None:
    """One attention layer's projections without bias: q and output ``n_embd`` wide, k and v ``kv_width``."""
    writer.add_tensor(blk + "attn_q.weight", normal(n_embd, n_embd))
    writer.add_tensor(blk + "attn_k.weight", normal(kv_width, n_embd))
    writer.add_tensor(blk + "attn_v.weight", normal(kv_width, n_embd))
    writer.add_tensor(blk + "attn_output.weight", normal(n_embd, n_embd))


def seeded_normal(seed: int) -> Any:
    """``normal(*numpy_shape, scale=0.3)``: f32 weights drawn in call order from ``seed``."""
    rng = np.random.default_rng(seed)

    def normal(*numpy_shape: int, scale: float = 0.3) -> np.ndarray:
        return (rng.standard_normal(numpy_shape) * scale).astype(np.float32)

    return normal


def add_mamba2_keys(writer: Any, arch: str, shape: Any) -> None:
    """A Mamba-2 hybrid's ``ssm.*`` keys (``shape`` as for ``add_mamba2_tensors``)."""
    writer.add_uint32(f"{arch}.ssm.conv_kernel", shape.d_conv)
    writer.add_uint32(f"{arch}.ssm.inner_size", shape.d_inner)
    writer.add_uint32(f"{arch}.ssm.state_size", shape.d_state)
    writer.add_uint32(f"{arch}.ssm.time_step_rank", shape.n_ssm_head)
    writer.add_uint32(f"{arch}.ssm.group_count", shape.n_group)


def add_mamba2_tensors(writer: Any, blk: str, shape: Any, normal: Any) -> None:
    """One Mamba-2 layer's tensors (llama.cpp's loader for nemotron_h and granitehybrid): ``shape``
    gives ``n_embd``, ``d_inner``, ``d_state``, ``d_conv``, ``n_ssm_head``, ``n_group`` and
    ``conv_channels``; ``normal`` draws weights."""
    e, di, ds, nh, dc = shape.n_embd, shape.d_inner, shape.d_state, shape.n_ssm_head, shape.d_conv
    writer.add_tensor(blk + "ssm_in.weight", normal(2 * di + 2 * shape.n_group * ds + nh, e))
    writer.add_tensor(blk + "ssm_conv1d.weight", normal(shape.conv_channels, dc))
    writer.add_tensor(blk + "ssm_conv1d.bias", normal(shape.conv_channels, scale=0.1))
    writer.add_tensor(blk + "ssm_dt.bias", normal(nh, scale=0.1) - 2.0)
    writer.add_tensor(blk + "ssm_a", -np.exp(normal(nh, 1, scale=0.5)))
    writer.add_tensor(blk + "ssm_d", np.ones((nh, 1), dtype=np.float32))
    writer.add_tensor(blk + "ssm_norm.weight", np.ones((shape.n_group, di // shape.n_group), dtype=np.float32))
    writer.add_tensor(blk + "ssm_out.weight", normal(e, di))


def add_gated_ffn(writer: Any, blk: str, n_embd: int, n_ff: int, normal: Any) -> None:
    """A layer's FFN norm (ones) and gated FFN (gate, up, down) of width ``n_ff``."""
    writer.add_tensor(blk + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor(blk + "ffn_gate.weight", normal(n_ff, n_embd))
    writer.add_tensor(blk + "ffn_up.weight", normal(n_ff, n_embd))
    writer.add_tensor(blk + "ffn_down.weight", normal(n_embd, n_ff))


def finish_gguf(writer: Any) -> None:
    """Write the GGUF's header, key-values and tensors, and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


HYBRIDS: dict[str, Any] = {"jamba": JambaShape(), "nemotron_h": NemotronHShape()}


def write_jamba_gguf(path: Path, shape: JambaShape) -> None:
    """A Jamba GGUF with seeded random f32 weights, every tensor llama.cpp's loader requires."""
    import gguf

    rng = np.random.default_rng(shape.seed)

    def normal(*numpy_shape: int, scale: float = 0.3) -> np.ndarray:
        return (rng.standard_normal(numpy_shape) * scale).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    e, di, ds, dr, dc = shape.n_embd, shape.d_inner, shape.d_state, shape.dt_rank, shape.d_conv
    head = e // shape.n_head
    writer: Any = gguf.GGUFWriter(str(path), "jamba")
    writer.add_name("recurrent-cache-tiny-jamba")
    writer.add_uint32("jamba.context_length", 4096)
    writer.add_uint32("jamba.embedding_length", e)
    writer.add_uint32("jamba.feed_forward_length", shape.n_ff)
    writer.add_uint32("jamba.block_count", shape.n_layer)
    writer.add_uint32("jamba.attention.head_count", shape.n_head)
    writer.add_array("jamba.attention.head_count_kv", list(shape.head_count_kv))
    writer.add_float32("jamba.attention.layer_norm_rms_epsilon", shape.rms_eps)
    writer.add_uint32("jamba.ssm.conv_kernel", dc)
    writer.add_uint32("jamba.ssm.inner_size", di)
    writer.add_uint32("jamba.ssm.state_size", ds)
    writer.add_uint32("jamba.ssm.time_step_rank", dr)
    writer.add_uint32("jamba.vocab_size", shape.n_vocab)
    # numpy shapes are ggml's {ne0, ne1} reversed
    add_vocab_and_output(writer, shape.n_vocab, e, normal)
    for il, n_kv in enumerate(shape.head_count_kv):
        blk = f"blk.{il}."
        writer.add_tensor(blk + "attn_norm.weight", ones(e))
        if n_kv == 0:
            writer.add_tensor(blk + "ssm_in.weight", normal(2 * di, e))
            writer.add_tensor(blk + "ssm_conv1d.weight", normal(di, dc))
            writer.add_tensor(blk + "ssm_conv1d.bias", normal(di, scale=0.1))
            writer.add_tensor(blk + "ssm_x.weight", normal(dr + 2 * ds, di))
            writer.add_tensor(blk + "ssm_dt_norm.weight", ones(dr))
            writer.add_tensor(blk + "ssm_dt.weight", normal(di, dr))
            writer.add_tensor(blk + "ssm_dt.bias", normal(di, scale=0.1) - 2.0)
            writer.add_tensor(blk + "ssm_b_norm.weight", ones(ds))
            writer.add_tensor(blk + "ssm_c_norm.weight", ones(ds))
            writer.add_tensor(blk + "ssm_a", -np.exp(normal(di, ds, scale=0.5)))
            writer.add_tensor(blk + "ssm_d", ones(di))
            writer.add_tensor(blk + "ssm_out.weight", normal(e, di))
        else:
            add_attention_tensors(writer, blk, e, n_kv * head, normal)
        add_gated_ffn(writer, blk, e, shape.n_ff, normal)
    finish_gguf(writer)


# -- scenarios ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Scenario:
    """A model, the context settings, and what is decoded.

    Sequences 0..len(prompts)-1 decode their prompts in one batch, then
    ``steps``; then ``llama_memory_seq_cp`` forks ``fork[0]`` into
    ``fork[1]`` (the two share one recurrent cell: whole-context blobs list a
    cell with two seq ids); the last sequence id stays empty.  No fork with
    one KV stream per sequence: llama.cpp copies a KV stream's rows to
    another only at the next decode, so a state written right after such a
    ``seq_cp`` holds the destination stream's old rows, not the fork's.
    """

    name: str
    model: str                        # "mamba" (the package's GGUF) or "jamba" (written here)
    arch: str
    flash_attn: bool = False          # off: the KV cache stores V transposed (v_trans 1)
    kv_unified: bool = False          # off: one KV stream per sequence (n_stream = n_seq_max)
    prompts: tuple[tuple[int, ...], ...] = ()
    steps: tuple[tuple[int, ...], ...] = ()          # per step, one token per decoded sequence
    continuation: tuple[tuple[int, ...], ...] = ()   # per sequence (the fork's too), continued after the blobs
    fork: tuple[int, int] | None = (0, 3)

    @property
    def n_seq_max(self) -> int:
        return len(self.prompts) + (2 if self.fork else 1)   # the fork and one empty sequence

    @property
    def n_ctx(self) -> int:
        return 256 * self.n_seq_max    # llama.cpp pads each sequence's KV stream to 256 cells

    @property
    def sequences(self) -> list[int]:
        """The sequence ids that hold a state after the fork."""
        decoded = list(range(len(self.prompts)))
        return [*decoded, self.fork[1]] if self.fork else decoded

    @property
    def empty_seq(self) -> int:
        return self.n_seq_max - 1


def _text_tokens(text: str) -> tuple[int, ...]:
    return tuple(text.encode())


MAMBA_PROMPTS = (_text_tokens("def"), _text_tokens("class"), _text_tokens("import "))
MAMBA_STEPS = (_text_tokens("(e "), _text_tokens("):o"))
MAMBA_CONTINUATION = (_text_tokens("f("), _text_tokens("\n "), _text_tokens("ys"), _text_tokens("in"))
HYBRID_PROMPTS = ((5, 17, 42), (1, 2, 3, 60, 33), (63, 0, 9, 9, 12, 50, 7))
HYBRID_STEPS = ((11, 22, 33), (44, 55, 6))
HYBRID_CONTINUATION = ((8, 16), (24, 32), (40, 48), (56, 1))

SCENARIOS = (
    Scenario("mamba", "mamba", "mamba", prompts=MAMBA_PROMPTS, steps=MAMBA_STEPS,
             continuation=MAMBA_CONTINUATION),
    Scenario("jamba", "jamba", "jamba", flash_attn=False, kv_unified=False, prompts=HYBRID_PROMPTS,
             steps=HYBRID_STEPS, continuation=HYBRID_CONTINUATION[:3], fork=None),
    Scenario("jamba_fa_unified", "jamba", "jamba", flash_attn=True, kv_unified=True, prompts=HYBRID_PROMPTS,
             steps=HYBRID_STEPS, continuation=HYBRID_CONTINUATION),
    Scenario("nemotron_h_unified", "nemotron_h", "nemotron_h", flash_attn=False, kv_unified=True,
             prompts=HYBRID_PROMPTS, steps=HYBRID_STEPS, continuation=HYBRID_CONTINUATION),
)


def model_path(scenario: Scenario | dict[str, Any], data_dir: Path) -> Path:
    model = scenario.model if isinstance(scenario, Scenario) else scenario["model"]
    return MAMBA_GGUF if model == "mamba" else data_dir / HYBRIDS[model].gguf_name


# -- llama.cpp through llama-cpp-python ----------------------------------------------------

def _llama() -> Any:
    import llama_cpp

    return llama_cpp


_LOG_CALLBACK: Any = None
LOGGED_ERRORS: list[str] = []   # llama.cpp's error lines since quiet_logs(); --check reports them per file


def quiet_logs() -> None:
    """Drop llama.cpp's info and debug lines; warnings go to stderr, errors to stderr and LOGGED_ERRORS."""
    global _LOG_CALLBACK
    lc = _llama()

    def log(level: int, text: bytes, _user: Any) -> None:
        if level in (3, 4):   # GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR
            sys.stderr.write(text.decode(errors="replace"))
        if level == 4:
            LOGGED_ERRORS.append(text.decode(errors="replace").strip())

    _LOG_CALLBACK = lc.llama_log_callback(log)   # kept alive: llama.cpp calls it later
    lc.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p())


class Model:
    """A loaded GGUF."""

    def __init__(self, path: Path) -> None:
        lc = _llama()
        params = lc.llama_model_default_params()
        params.n_gpu_layers = 0
        self.path = path
        self.handle = lc.llama_model_load_from_file(str(path).encode(), params)
        if not self.handle:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.handle))

    def close(self) -> None:
        _llama().llama_model_free(self.handle)


class Context:
    """One llama_context on the CPU with one thread, so runs are reproducible."""

    def __init__(self, model: Model, scenario: Scenario) -> None:
        lc = _llama()
        params = lc.llama_context_default_params()
        params.n_ctx = scenario.n_ctx
        params.n_batch = params.n_ubatch = 64
        params.n_seq_max = scenario.n_seq_max
        params.n_outputs_max_per_seq = 0          # no limit on outputs per sequence in a batch
        params.n_threads = params.n_threads_batch = 1
        params.flash_attn_type = (lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if scenario.flash_attn
                                  else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.kv_unified = scenario.kv_unified
        self.model = model
        self.handle = lc.llama_init_from_model(model.handle, params)
        if not self.handle:
            raise RuntimeError(f"llama.cpp could not create a context for {model.path}")

    def close(self) -> None:
        _llama().llama_free(self.handle)

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> list[list[float]]:
        """Decode one batch of (token, pos, seq id, wants logits); the logits of the outputs, in batch order."""
        lc = _llama()
        batch = lc.llama_batch_init(len(entries), 0, 1)
        try:
            for i, (token, pos, seq, wants) in enumerate(entries):
                batch.token[i] = token
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = wants
            batch.n_tokens = len(entries)
            rc = lc.llama_decode(self.handle, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
        finally:
            lc.llama_batch_free(batch)
        logits = []
        for i, (_, _, _, wants) in enumerate(entries):
            if wants:
                row = lc.llama_get_logits_ith(self.handle, i)
                logits.append([float(row[j]) for j in range(self.model.n_vocab)])
        return logits

    def seq_cp(self, src: int, dst: int) -> None:
        lc = _llama()
        lc.llama_memory_seq_cp(lc.llama_get_memory(self.handle), src, dst, -1, -1)

    # the state API: every call returns what llama.cpp returned, with the bytes where there are some
    def state_seq_get_data(self, seq: int, flags: int = 0) -> bytes:
        lc = _llama()
        size = lc.llama_state_seq_get_size_ext(self.handle, seq, flags)
        buffer = (ctypes.c_uint8 * size)()
        written = lc.llama_state_seq_get_data_ext(self.handle, buffer, size, seq, flags)
        if written != size:
            raise RuntimeError(f"llama_state_seq_get_data_ext wrote {written} of {size} bytes")
        return bytes(buffer)

    def state_seq_set_data(self, blob: bytes, dest_seq: int, flags: int = 0) -> int:
        lc = _llama()
        buffer = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        return int(lc.llama_state_seq_set_data_ext(self.handle, buffer, len(blob), dest_seq, flags))

    def state_get_data(self) -> bytes:
        lc = _llama()
        size = lc.llama_state_get_size(self.handle)
        buffer = (ctypes.c_uint8 * size)()
        written = lc.llama_state_get_data(self.handle, buffer, size)
        if written != size:
            raise RuntimeError(f"llama_state_get_data wrote {written} of {size} bytes")
        return bytes(buffer)

    def state_set_data(self, blob: bytes) -> int:
        lc = _llama()
        buffer = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        return int(lc.llama_state_set_data(self.handle, buffer, len(blob)))

    def state_seq_save_file(self, path: Path, seq: int, tokens: list[int]) -> int:
        lc = _llama()
        array = (lc.llama_token * len(tokens))(*tokens)
        return int(lc.llama_state_seq_save_file(self.handle, str(path).encode(), seq, array, len(tokens)))

    def state_seq_load_file(self, path: Path, dest_seq: int, capacity: int = 4096) -> tuple[int, list[int]]:
        lc = _llama()
        array = (lc.llama_token * capacity)()
        count = ctypes.c_size_t(0)
        read = lc.llama_state_seq_load_file(self.handle, str(path).encode(), dest_seq, array, capacity,
                                            ctypes.byref(count))
        return int(read), list(array[:count.value])

    def state_save_file(self, path: Path, tokens: list[int]) -> bool:
        lc = _llama()
        array = (lc.llama_token * len(tokens))(*tokens)
        return bool(lc.llama_state_save_file(self.handle, str(path).encode(), array, len(tokens)))

    def state_load_file(self, path: Path, capacity: int = 4096) -> tuple[bool, list[int]]:
        lc = _llama()
        array = (lc.llama_token * capacity)()
        count = ctypes.c_size_t(0)
        ok = lc.llama_state_load_file(self.handle, str(path).encode(), array, capacity, ctypes.byref(count))
        return bool(ok), list(array[:count.value])


# -- the layout, read back by this script's own parser -------------------------------------

@dataclass(frozen=True)
class MemoryShape:
    """What the bytes of a memory section do not say themselves and a reader must know.

    ``recurrent_layers``: how many r (and s) sections follow the recurrent
    header; llama.cpp writes the model's n_layer there but skips the layers
    its layer filter leaves out.  ``has_kv``: a hybrid's attention KV section
    comes first.  ``kv_cell_ext``: KV cells carry 12 more bytes (M-RoPE / PLE
    models only; not the ones recorded here).
    """

    recurrent_layers: int
    has_kv: bool = False
    kv_cell_ext: bool = False


class LayoutError(ValueError):
    pass


@dataclass
class _Cursor:
    data: bytes
    offset: int = 0
    sections: list[list[Any]] = field(default_factory=list)

    def unpack(self, fmt: str, name: str) -> tuple[Any, ...]:
        size = struct.calcsize(fmt)
        if self.offset + size > len(self.data):
            raise LayoutError(f"{name} at byte {self.offset} needs {size} bytes, {len(self.data) - self.offset} left")
        values = struct.unpack_from(fmt, self.data, self.offset)
        self.sections.append([name, self.offset, size, list(values) if len(values) > 1 else values[0]])
        self.offset += size
        return values

    def skip(self, size: int, name: str) -> None:
        if self.offset + size > len(self.data):
            raise LayoutError(f"{name} at byte {self.offset} needs {size} bytes, {len(self.data) - self.offset} left")
        self.sections.append([name, self.offset, size, None])
        self.offset += size


def _parse_rows(cur: _Cursor, prefix: str, count: int, cell_count: int) -> None:
    """``count`` sections {i32 type, u64 row bytes, cell_count rows}."""
    for k in range(count):
        type_id, row_bytes = cur.unpack("<iQ", f"{prefix}[{k}] type, row bytes")
        if type_id in GGML_TYPE_SIZES and row_bytes % GGML_TYPE_SIZES[type_id]:
            raise LayoutError(f"{prefix}[{k}] row bytes {row_bytes} not a multiple of type {type_id}'s size")
        cur.skip(row_bytes * cell_count, f"{prefix}[{k}] rows")


def _parse_cells(cur: _Cursor, prefix: str, cell_count: int, ext: bool) -> None:
    for i in range(cell_count):
        _, n_seq_id = cur.unpack("<iI", f"{prefix} cell {i} pos, n_seq_id")
        if ext:
            cur.skip(CELL_EXT_BYTES, f"{prefix} cell {i} ext")
        if n_seq_id:
            cur.unpack(f"<{n_seq_id}i", f"{prefix} cell {i} seq ids")


def _parse_kv(cur: _Cursor, ext: bool) -> None:
    """The attention KV cache's section (llama_kv_cache::state_write)."""
    (n_stream,) = cur.unpack("<I", "kv n_stream")
    for s in range(n_stream):
        (cell_count,) = cur.unpack("<I", f"kv stream {s} cell_count")
        if cell_count == 0:
            continue
        _parse_cells(cur, f"kv stream {s}", cell_count, ext)
        v_trans, n_layer = cur.unpack("<II", f"kv stream {s} v_trans, n_layer")
        _parse_rows(cur, f"kv stream {s} k", n_layer, cell_count)
        if not v_trans:
            _parse_rows(cur, f"kv stream {s} v", n_layer, cell_count)
            continue
        for k in range(n_layer):
            _, element, n_embd_v = cur.unpack("<iII", f"kv stream {s} v[{k}] type, element bytes, n_embd_v_gqa")
            cur.skip(element * n_embd_v * cell_count, f"kv stream {s} v[{k}] transposed rows")


def _parse_recurrent(cur: _Cursor, recurrent_layers: int) -> None:
    """The recurrent memory's section (llama_memory_recurrent::state_write)."""
    (cell_count,) = cur.unpack("<I", "rs cell_count")
    _parse_cells(cur, "rs", cell_count, False)
    s_trans, _ = cur.unpack("<II", "rs s_trans, n_layer")
    if s_trans:
        raise LayoutError("rs s_trans is set: llama.cpp writes 0")
    _parse_rows(cur, "rs r", recurrent_layers, cell_count)
    _parse_rows(cur, "rs s", recurrent_layers, cell_count)


def _parse_memory(cur: _Cursor, shape: MemoryShape, partial: bool = False) -> None:
    if shape.has_kv and not partial:
        _parse_kv(cur, shape.kv_cell_ext)
    _parse_recurrent(cur, shape.recurrent_layers)


def _parse_file_header(cur: _Cursor, magic: int, version: int, what: str) -> None:
    got_magic, got_version, n_tokens = cur.unpack("<III", f"{what} magic, version, n_token_count")
    if (got_magic, got_version) != (magic, version):
        raise LayoutError(f"{what}: magic 0x{got_magic:08x} version {got_version}")
    if n_tokens:
        cur.unpack(f"<{n_tokens}i", f"{what} tokens")


def _parse_arch(cur: _Cursor) -> None:
    (length,) = cur.unpack("<I", "arch name length")
    cur.skip(length, "arch name")


def parse_layout(kind: str, data: bytes, shape: MemoryShape) -> list[list[Any]]:
    """Split a blob or file into [name, offset, size, value] sections; raises LayoutError unless it
    ends exactly at the last byte.  kind: seq_blob, seq_blob_partial, context_blob, seq_file, session_file."""
    cur = _Cursor(data)
    if kind in ("seq_blob", "seq_blob_partial"):
        (magic, _) = cur.unpack("<Ii", "seq blob magic, source seq id")
        if magic != SEQ_BLOB_MAGIC:
            raise LayoutError(f"sequence blob magic 0x{magic:08x}")
        _parse_memory(cur, shape, partial=kind == "seq_blob_partial")
    elif kind == "context_blob":
        _parse_arch(cur)
        _parse_memory(cur, shape)
    elif kind == "seq_file":
        _parse_file_header(cur, SEQ_FILE_MAGIC, 3, "ggsq")
        _parse_memory(cur, shape)
    elif kind == "session_file":
        _parse_file_header(cur, SESSION_FILE_MAGIC, 10, "ggsn")
        _parse_arch(cur)
        _parse_memory(cur, shape)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    if cur.offset != len(data):
        raise LayoutError(f"{kind}: the layout ends at byte {cur.offset}, the data at {len(data)}")
    return cur.sections


def memory_shape(scenario: Scenario | dict[str, Any]) -> MemoryShape:
    model = scenario.model if isinstance(scenario, Scenario) else scenario["model"]
    if model == "mamba":
        return MemoryShape(recurrent_layers=4)
    return MemoryShape(recurrent_layers=len(HYBRIDS[model].recurrent_layers), has_kv=True)


# -- recording ----------------------------------------------------------------------------

def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


def _continue_one(ctx: Context, seq: int, start_pos: int, tokens: tuple[int, ...]) -> list[list[float]]:
    """Decode ``tokens`` one at a time on ``seq`` from ``start_pos``; the logits of each step."""
    return [ctx.decode([(token, start_pos + k, seq, True)])[0] for k, token in enumerate(tokens)]


def _continue_all(ctx: Context, scenario: Scenario, next_pos: list[int]) -> list[list[list[float]]]:
    """Continue every sequence in one batch per step; per sequence, the logits of each step."""
    seqs = scenario.sequences
    per_seq: list[list[list[float]]] = [[] for _ in seqs]
    for k in range(len(scenario.continuation[0])):
        entries = [(scenario.continuation[i][k], next_pos[i] + k, seq, True) for i, seq in enumerate(seqs)]
        for i, logits in enumerate(ctx.decode(entries)):
            per_seq[i].append(logits)
    return per_seq


def _artifact(out: Path, scenario: Scenario, name: str, kind: str, data: bytes, **extra: Any) -> dict[str, Any]:
    """Write ``data`` as ``out/<scenario>/name`` and describe it, its layout checked by ``parse_layout``."""
    (out / scenario.name / name).write_bytes(data)
    layout = parse_layout(kind, data, memory_shape(scenario))
    return {"file": f"{scenario.name}/{name}", "kind": kind, "n_bytes": len(data), "sha256": _sha256(data),
            **extra, "layout": layout}


def record_scenario(scenario: Scenario, out: Path) -> dict[str, Any]:
    """Decode, take every blob and file, continue, restore each into a fresh context; the record."""
    path = model_path(scenario, out)
    model = Model(path)
    (out / scenario.name).mkdir(parents=True, exist_ok=True)
    decoded = range(len(scenario.prompts))
    seqs = scenario.sequences
    try:
        record: dict[str, Any] = {
            "scenario": scenario.name, "model": scenario.model, "model_file": _repo_relative(path),
            "model_sha256": _sha256(path.read_bytes()), "arch": scenario.arch, "n_vocab": model.n_vocab,
            "context": {"n_ctx": scenario.n_ctx, "n_batch": 64, "n_ubatch": 64, "n_seq_max": scenario.n_seq_max,
                        "n_threads": 1, "flash_attn": scenario.flash_attn, "kv_unified": scenario.kv_unified,
                        "type_k": "f16", "type_v": "f16"},
            "shape": _shape_record(scenario),
        }
        tokens: dict[int, list[int]] = {s: list(scenario.prompts[s]) for s in decoded}
        ops: list[dict[str, Any]] = []
        with Context(model, scenario) as ctx:
            entries = [(token, pos, s, pos == len(prompt) - 1)
                       for s, prompt in enumerate(scenario.prompts) for pos, token in enumerate(prompt)]
            ops.append({"op": "decode", "tokens": [list(e) for e in entries], "logits": ctx.decode(entries)})
            for step in scenario.steps:
                entries = [(step[s], len(tokens[s]), s, True) for s in decoded]
                ops.append({"op": "decode", "tokens": [list(e) for e in entries], "logits": ctx.decode(entries)})
                for s in decoded:
                    tokens[s].append(step[s])
            if scenario.fork:
                src, dst = scenario.fork
                ctx.seq_cp(src, dst)
                ops.append({"op": "seq_cp", "src": src, "dst": dst, "p0": -1, "p1": -1})
                tokens[dst] = list(tokens[src])
            next_pos = [len(tokens[s]) for s in seqs]

            seq_blobs = [_artifact(out, scenario, f"seq{s}.blob", "seq_blob", ctx.state_seq_get_data(s),
                                   seq_id=s, flags=0) for s in [*seqs, scenario.empty_seq]]
            if memory_shape(scenario).has_kv:
                seq_blobs += [_artifact(out, scenario, f"seq{s}.partial.blob", "seq_blob_partial",
                                        ctx.state_seq_get_data(s, PARTIAL_ONLY), seq_id=s, flags=PARTIAL_ONLY)
                              for s in seqs]
            context_blob = _artifact(out, scenario, "context.blob", "context_blob", ctx.state_get_data())
            seq_files = []
            for s in seqs:
                file = out / scenario.name / f"seq{s}.ggsq"
                size = ctx.state_seq_save_file(file, s, tokens[s])
                if size != file.stat().st_size:
                    raise RuntimeError(f"llama_state_seq_save_file returned {size}, wrote {file.stat().st_size}")
                seq_files.append(_artifact(out, scenario, file.name, "seq_file", file.read_bytes(), seq_id=s,
                                           tokens=tokens[s]))
            session_path = out / scenario.name / "session.ggsn"
            if not ctx.state_save_file(session_path, tokens[0]):
                raise RuntimeError("llama_state_save_file failed")
            session = _artifact(out, scenario, session_path.name, "session_file", session_path.read_bytes(),
                                tokens=tokens[0])
            reference = [_continue_one(ctx, s, next_pos[i], scenario.continuation[i]) for i, s in enumerate(seqs)]

        record.update(sequences=[{"seq_id": s, "tokens": tokens[s], "next_pos": next_pos[i],
                                  "continuation": list(scenario.continuation[i]),
                                  "continuation_logits": reference[i]} for i, s in enumerate(seqs)],
                      empty_seq_id=scenario.empty_seq, ops=ops, seq_blobs=seq_blobs, context_blob=context_blob,
                      seq_files=seq_files, session_file=session)
        record["checks"] = _restore_checks(model, scenario, out, record)
    finally:
        model.close()
    return record


def _restore_checks(model: Model, scenario: Scenario, out: Path, record: dict[str, Any]) -> list[dict[str, Any]]:
    """Every blob and file back into a fresh context, continued; the largest difference from the reference."""
    checks = []
    for what, result in check_directory_scenario(model, scenario, out / scenario.name, record).items():
        checks.append({"what": what, "accepted": result["accepted"], "max_abs_diff": result.get("max_abs_diff")})
        if not result["accepted"]:
            raise RuntimeError(f"{scenario.name}: llama.cpp refused its own {what}: {result}")
    # a sequence restored into another sequence id (the blob's header names the source; llama.cpp ignores it)
    for seq in record["sequences"]:
        with Context(model, scenario) as ctx:
            blob = (out / scenario.name / f"seq{seq['seq_id']}.blob").read_bytes()
            accepted = ctx.state_seq_set_data(blob, scenario.empty_seq) == len(blob)
            logits = (_continue_one(ctx, scenario.empty_seq, seq["next_pos"], tuple(seq["continuation"]))
                      if accepted else None)
        checks.append({"what": f"seq{seq['seq_id']}.blob into seq {scenario.empty_seq}", "accepted": accepted,
                       "max_abs_diff": _max_diff(logits, seq["continuation_logits"]) if logits else None})
        if not accepted:
            raise RuntimeError(f"{scenario.name}: llama.cpp refused its own {checks[-1]['what']}")
    return checks


def _shape_record(scenario: Scenario) -> dict[str, Any]:
    if scenario.model == "mamba":
        d_conv, d_inner, d_state, n_layer = 4, 256, 16, 4
        return {"n_layer": n_layer, "recurrent_layers": list(range(n_layer)), "attention_layers": [],
                "n_embd_r": (d_conv - 1) * d_inner, "n_embd_s": d_state * d_inner, "dtype_r": "f32", "dtype_s": "f32",
                "d_conv": d_conv, "d_inner": d_inner, "d_state": d_state}
    return HYBRIDS[scenario.model].record()  # type: ignore[no-any-return]


def _repo_relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return path.name


def llama_version() -> dict[str, Any]:
    lc = _llama()
    return {"llama_cpp_python": lc.__version__,
            "llama_cpp_commit": "0c1e57098 (ggml-org/llama.cpp, per llama-cpp-python 0.3.36's CHANGELOG)",
            "session_version": lc.LLAMA_SESSION_VERSION, "state_seq_version": lc.LLAMA_STATE_SEQ_VERSION,
            "system_info": lc.llama_print_system_info().decode(errors="replace").strip()}


def record(out: Path) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    for hybrid in HYBRIDS.values():
        hybrid.write_gguf(out / hybrid.gguf_name)
    version = llama_version()
    records = []
    for scenario in SCENARIOS:
        print(f"recording {scenario.name}", file=sys.stderr)
        records.append({"llama_cpp": version, "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
                        **record_scenario(scenario, out)})
    text = "".join(json.dumps(item, separators=(",", ":")) + "\n" for item in records)
    # mtime 0: recording again with the same llama.cpp gives the same bytes
    (out / RECORDS_NAME).write_bytes(gzip.compress(text.encode(), mtime=0))
    return records


def load_records(data_dir: Path) -> dict[str, dict[str, Any]]:
    with gzip.open(data_dir / RECORDS_NAME, "rt", encoding="utf-8") as file:
        return {item["scenario"]: item for item in map(json.loads, file)}


# -- an exchange: one sequence handed over, then continued for many steps ------------------

EXCHANGE_DIR = REPO / "tests" / "data" / "llamacpp_exchange"
EXCHANGE_RECORD = "exchange.json"
EXCHANGE_LOGITS = "logits.npz"
# One sequence of Python source: the prompt decoded in one batch, its state saved, then the
# continuation decoded one token per step (the logits a restored state must reproduce).
EXCHANGE = Scenario("exchange", "mamba", "mamba",
                    prompts=(_text_tokens("def mean(values):\n    total = 0.0\n    for value in values:\n"),),
                    continuation=(_text_tokens("        total += value\n    return total / len(values)\n"),),
                    fork=None)
# "f16": the shipped GGUF; "f32": the same weights widened to f32 (the same values, so the
# package computes the same model from either), which llama.cpp multiplies without rounding
# activations to f16.
EXCHANGE_WEIGHTS = ("f16", "f32")


def write_f32_copy(path: Path) -> None:
    """The shipped model with its f16 weights widened to f32, by the package's own GGUF writer
    (so ``--record-exchange`` needs the package importable as well)."""
    from recurrent_cache.models import trained_model, write_gguf

    write_gguf(trained_model(np.float32), path, "f32", name="byte-mamba-f32")


def record_exchange(out: Path, scratch: Path) -> dict[str, Any]:
    """``--record-exchange``: per weights variant, llama.cpp decodes the prompt, saves the sequence
    ('ggsq', ``out/<weights>.ggsq``), continues it one token per step, and restores its own file into
    a fresh context to continue again.  Writes ``out/exchange.json`` and the logits (float32) in
    ``out/logits.npz``; ``scratch`` takes the f32 GGUF, which is not kept."""
    out.mkdir(parents=True, exist_ok=True)
    prompt, continuation = list(EXCHANGE.prompts[0]), EXCHANGE.continuation[0]
    paths = {"f16": MAMBA_GGUF, "f32": scratch / "byte_mamba_f32.gguf"}
    write_f32_copy(paths["f32"])
    variants, logits = [], {}
    for weights in EXCHANGE_WEIGHTS:
        model = Model(paths[weights])
        file = out / f"{weights}.ggsq"
        try:
            with Context(model, EXCHANGE) as ctx:
                ctx.decode([(token, pos, 0, pos == len(prompt) - 1) for pos, token in enumerate(prompt)])
                ctx.state_seq_save_file(file, 0, prompt)
                continued = _continue_one(ctx, 0, len(prompt), continuation)
            with Context(model, EXCHANGE) as ctx:
                read, tokens = ctx.state_seq_load_file(file, 0)
                if read != file.stat().st_size or tokens != prompt:
                    raise RuntimeError(f"llama.cpp refused its own {file.name}")
                restored = _continue_one(ctx, 0, len(prompt), continuation)
        finally:
            model.close()
        logits[weights] = np.asarray(continued, dtype=np.float32)
        variants.append({"weights": weights, "model_sha256": _sha256(paths[weights].read_bytes()),
                         "file": file.name, "n_bytes": file.stat().st_size, "sha256": _sha256(file.read_bytes()),
                         "restored_max_abs_diff": _max_diff(restored, continued)})
    record = {"llama_cpp": llama_version(), "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
              "model_file": _repo_relative(MAMBA_GGUF), "context": {"n_ctx": EXCHANGE.n_ctx, "n_batch": 64,
                                                                    "n_ubatch": 64, "n_threads": 1},
              "prompt": prompt, "continuation": list(continuation), "variants": variants}
    (out / EXCHANGE_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    np.savez_compressed(out / EXCHANGE_LOGITS, **logits)
    return record


# -- checking files written by someone else ------------------------------------------------

def check_directory_scenario(model: Model, scenario: Scenario, directory: Path,
                             record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each recognised blob or file in ``directory`` into a fresh context, continued as recorded."""
    sequences = record["sequences"]
    next_pos = [seq["next_pos"] for seq in sequences]
    reference = [seq["continuation_logits"] for seq in sequences]
    results: dict[str, dict[str, Any]] = {}
    LOGGED_ERRORS.clear()

    def finish(name: str, accepted: bool, detail: dict[str, Any], logits: Any, ref: Any) -> None:
        result = {"accepted": accepted, **detail, "llama_errors": LOGGED_ERRORS[:]}
        LOGGED_ERRORS.clear()
        if accepted:
            result["logits"] = logits
            result["max_abs_diff"] = _max_diff(logits, ref)
            result["max_abs_reference"] = float(np.max(np.abs(np.asarray(ref))))
        results[name] = result

    for i, seq in enumerate(sequences):
        s, continuation = seq["seq_id"], tuple(seq["continuation"])
        blob_path = directory / f"seq{s}.blob"
        if blob_path.exists():
            blob = blob_path.read_bytes()
            with Context(model, scenario) as ctx:
                read = ctx.state_seq_set_data(blob, s)
                accepted = read == len(blob)
                logits = _continue_one(ctx, s, next_pos[i], continuation) if accepted else None
            finish(blob_path.name, accepted, {"bytes_read": read, "n_bytes": len(blob)}, logits, reference[i])
        file_path = directory / f"seq{s}.ggsq"
        if file_path.exists():
            with Context(model, scenario) as ctx:
                read, file_tokens = ctx.state_seq_load_file(file_path, s)
                accepted = read == file_path.stat().st_size
                logits = _continue_one(ctx, s, next_pos[i], continuation) if accepted else None
            finish(file_path.name, accepted, {"bytes_read": read, "tokens": file_tokens}, logits, reference[i])
    for name, loader in (("context.blob", "blob"), ("session.ggsn", "file")):
        path = directory / name
        if not path.exists():
            continue
        with Context(model, scenario) as ctx:
            detail: dict[str, Any]
            if loader == "blob":
                data = path.read_bytes()
                read = ctx.state_set_data(data)
                accepted, detail = read == len(data), {"bytes_read": read, "n_bytes": len(data)}
            else:
                accepted, file_tokens = ctx.state_load_file(path)
                detail = {"tokens": file_tokens}
            every_logits = _continue_all(ctx, scenario, next_pos) if accepted else None
        finish(name, accepted, detail, every_logits, reference)
    return results


def check(directory: Path, reference_dir: Path, tolerance: float) -> tuple[dict[str, Any], bool]:
    """``--check``: the results per scenario, and whether every file loaded and continued within tolerance."""
    records = load_records(reference_dir)
    report: dict[str, Any] = {"llama_cpp": llama_version(), "tolerance": tolerance, "scenarios": {}}
    ok = True
    for scenario in SCENARIOS:
        sub = directory / scenario.name
        if not sub.is_dir():
            continue
        model = Model(model_path(scenario, reference_dir))
        try:
            results = check_directory_scenario(model, scenario, sub, records[scenario.name])
        finally:
            model.close()
        for result in results.values():
            result["within_tolerance"] = bool(result["accepted"] and result["max_abs_diff"]
                                              <= tolerance * max(1.0, result["max_abs_reference"]))
            ok = ok and result["within_tolerance"]
        report["scenarios"][scenario.name] = results
    if not report["scenarios"]:
        ok = False
        report["error"] = f"no scenario directory ({', '.join(s.name for s in SCENARIOS)}) under {directory}"
    return report, ok


def describe(path: Path) -> list[list[Any]]:
    """``--describe``: the layout of a recorded blob or file, from its scenario directory and name."""
    scenario = next((s for s in SCENARIOS if s.name == path.parent.name), None)
    if scenario is None:
        raise SystemExit(f"{path}: not in a scenario directory ({', '.join(s.name for s in SCENARIOS)})")
    name = path.name
    kind = ("seq_blob_partial" if name.endswith(".partial.blob") else "context_blob" if name == "context.blob"
            else "seq_blob" if name.endswith(".blob") else "seq_file" if name.endswith(".ggsq")
            else "session_file" if name.endswith(".ggsn") else None)
    if kind is None:
        raise SystemExit(f"{path}: not a recorded blob or file name")
    return parse_layout(kind, path.read_bytes(), memory_shape(scenario))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--record", type=Path, metavar="DIR", help=f"record into DIR (default {DEFAULT_DIR})")
    mode.add_argument("--check", type=Path, metavar="DIR", help="load DIR/<scenario>/ files into llama.cpp")
    mode.add_argument("--describe", type=Path, metavar="FILE", help="print the layout of a recorded blob or file")
    mode.add_argument("--record-exchange", type=Path, metavar="DIR", nargs="?", const=EXCHANGE_DIR,
                      help=f"record one sequence continued for many steps (default {EXCHANGE_DIR})")
    parser.add_argument("--reference", type=Path, default=DEFAULT_DIR,
                        help="the recording --check continues as and compares with (default %(default)s)")
    parser.add_argument("--tolerance", type=float, default=1e-3,
                        help="--check: largest logit difference allowed, relative to the largest recorded "
                             "logit (default %(default)s: the package's float64 forward of the f16 byte model "
                             "lands within 5e-4 of llama.cpp's)")
    parser.add_argument("--verbose", action="store_true", help="keep llama.cpp's log")
    args = parser.parse_args(argv)
    if args.describe:
        for name, offset, size, value in describe(args.describe):
            print(f"{offset:8d} {size:8d}  {name}" + ("" if value is None else f" = {value}"))
        return 0
    if not args.verbose:
        quiet_logs()
    if args.record_exchange:
        with tempfile.TemporaryDirectory() as scratch:
            exchange = record_exchange(args.record_exchange, Path(scratch))
        print(json.dumps(exchange["variants"]), file=sys.stderr)
        return 0
    if args.check:
        report, ok = check(args.check, args.reference, args.tolerance)
        json.dump(report, sys.stdout, indent=1)
        print()
        return 0 if ok else 1
    out = args.record or DEFAULT_DIR
    for item in record(out):
        print(json.dumps({"scenario": item["scenario"], "checks": item["checks"]}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
