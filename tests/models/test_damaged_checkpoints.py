"""Damaged Hugging Face checkpoint directories: each is one ModelError naming what is wrong, within seconds.

A small valid Mamba-1 and Mamba-2 checkpoint is written with numpy alone (config.json, model.safetensors
or shards with an index, a byte-level tokenizer.json), so this suite runs without torch or transformers.
Each damage of the catalogue is applied to a fresh copy: the file kinds an attacker can put under a
checkpoint file's name (FIFOs, devices, directories), oversized and deeply nested JSON, config values of
the wrong type or out of range, tokenizer ids that are no ids, safetensors headers numpy cannot take,
truncations, missing, extra and misshapen tensors.  ``load_hf`` must raise the package's ModelError
saying where, and ``convert`` (a sample, in a subprocess) one line on stderr and no output file.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from recurrent_cache.errors import ModelError
from recurrent_cache.models import Mamba2Model, MambaModel, convert_hf_to_gguf, load_gguf, load_hf, load_model

from checkpoints import CONFIGS, N_EMBD, N_VOCAB, write_checkpoint, write_safetensors

SECONDS = 10   # "within a few seconds": a damage that blocks or reads forever fails here instead of hanging



@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict[str, Path]:
    """One valid checkpoint per architecture (and a sharded Mamba-1), copied by ``damaged`` for each case."""
    root = tmp_path_factory.mktemp("pristine")
    return {"mamba1": write_checkpoint(root / "mamba1", "mamba1"),
            "mamba2": write_checkpoint(root / "mamba2", "mamba2"),
            "sharded": write_checkpoint(root / "sharded", "mamba1", sharded=True)}


@pytest.fixture
def deadline() -> Iterator[None]:
    """Fail the test (instead of hanging the run) when it takes more than SECONDS."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"load_hf took more than {SECONDS} s")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(SECONDS)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# -- the damages ----------------------------------------------------------------------------------
# Each takes the checkpoint directory, damages it, and the case says which checkpoint it applies to and
# what the ModelError must mention (a regular expression).

def edit_json(name: str, change: Callable[[dict], object]) -> Callable[[Path], None]:
    """Rewrite JSON file ``name`` with ``change`` applied (in place: what it returns is ignored)."""
    def damage(directory: Path) -> None:
        data = json.loads((directory / name).read_text())
        change(data)
        (directory / name).write_text(json.dumps(data))
    return damage


def config_field(key: str, value: object) -> Callable[[Path], None]:
    return edit_json("config.json", lambda config: config.__setitem__(key, value))


def raw_json(name: str, text: str) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        (directory / name).write_text(text)
    return damage


def replace_with(name: str, make: Callable[[Path], None]) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        (directory / name).unlink()
        make(directory / name)
    return damage


def fifo(path: Path) -> None:
    if not hasattr(os, "mkfifo"):
        pytest.skip("this platform has no FIFOs")
    os.mkfifo(path)


def dev_zero(path: Path) -> None:
    if not os.path.exists("/dev/zero"):
        pytest.skip("this platform has no /dev/zero")
    path.symlink_to("/dev/zero")


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def nested_in_config(depth: int) -> Callable[[Path], None]:
    text = json.dumps(CONFIGS["mamba1"])[:-1] + f', "extra": {nested(depth)}}}'
    return raw_json("config.json", text)


def header_of(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def edit_header(change: Callable[[dict], None], name: str = "model.safetensors") -> Callable[[Path], None]:
    """Rewrite the safetensors header of ``name`` with ``change`` applied, the data bytes unchanged."""
    def damage(directory: Path) -> None:
        header, data = header_of(directory / name)
        change(header)
        encoded = json.dumps(header).encode()
        (directory / name).write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
    return damage


def entry(tensor: str, **fields: object) -> Callable[[dict], None]:
    return lambda header: header[tensor].update(fields)


def rewrite_tensors(change: Callable[[dict[str, np.ndarray]], None]) -> Callable[[Path], None]:
    """Rewrite model.safetensors (F32, well formed) with its tensors changed by ``change``."""
    def damage(directory: Path) -> None:
        header, data = header_of(directory / "model.safetensors")
        tensors = {}
        for name, e in header.items():
            if name != "__metadata__":
                begin, end = e["data_offsets"]
                tensors[name] = np.frombuffer(data[begin:end], "<f4").reshape(e["shape"]).copy()
        change(tensors)
        write_safetensors(directory / "model.safetensors", tensors)
    return damage


def truncate(name: str, keep: Callable[[int], int]) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        raw = (directory / name).read_bytes()
        (directory / name).write_bytes(raw[:keep(len(raw))])
    return damage


def tokenizer_edit(change: Callable[[dict], None]) -> Callable[[Path], None]:
    return edit_json("tokenizer.json", change)


def vocab_id(piece: str, value: object) -> Callable[[Path], None]:
    return tokenizer_edit(lambda data: data["model"]["vocab"].__setitem__(piece, value))


def added_token(**fields: object) -> Callable[[Path], None]:
    return tokenizer_edit(lambda data: data["added_tokens"][0].update(fields))


def index_edit(change: Callable[[dict], object]) -> Callable[[Path], None]:
    return edit_json("model.safetensors.index.json", change)


def first_shard_entry(data: dict, value: str) -> None:
    data["weight_map"][next(iter(data["weight_map"]))] = value


def value_error(key: str, value: object) -> str:
    """What the error about config field ``key`` holding ``value`` says: a number beyond 64 bits is refused
    as the file is read, anything else by the field's own check."""
    return rf"config\.json: {key} = 1000.* is out of range" if value is BIG else rf"config\.json: field {key} is"


IN_PROJ = "backbone.layers.0.mixer.in_proj.weight"
EMBEDDINGS = "backbone.embeddings.weight"
BIG = 10**400   # valid JSON, beyond any float
HUGE_FLOAT_TEXT = "1e999"

# each file load_hf reads, and a checkpoint that has it
FILES = [("config.json", "mamba1"), ("model.safetensors", "mamba2"), ("tokenizer.json", "mamba1"),
         ("model.safetensors.index.json", "sharded"), ("model-00002-of-00002.safetensors", "sharded")]

# (case id, checkpoint, damage, what the message must mention)
CASES: list[tuple[str, str, Callable[[Path], None], str]] = [
    # -- file kinds and sizes (the issue: a FIFO blocks, /dev/zero reads until memory runs out) --
    *[(f"{name}-{kind}", checkpoint, replace_with(name, make), rf"{name}.* is {what}")
      for name, checkpoint in FILES
      for kind, make, what in [("fifo", fifo, "a FIFO"), ("dev-zero", dev_zero, "a character device")]],
    *[(f"{name}-directory", checkpoint, replace_with(name, Path.mkdir), rf"{name}: cannot read .*Is a directory")
      for name, checkpoint in FILES],
    ("config-dangling-symlink", "mamba1", replace_with("config.json", lambda p: p.symlink_to(p.parent / "nowhere")),
     r"config\.json: cannot read it"),
    ("config-oversized", "mamba1", raw_json("config.json", json.dumps(CONFIGS["mamba1"]) + " " * (4 * 2**20)),
     r"config\.json: it has .* bytes, more than"),
    ("config-empty", "mamba1", raw_json("config.json", ""), r"config\.json: cannot read it as JSON"),
    ("config-truncated", "mamba2", truncate("config.json", lambda n: n // 2), r"config\.json: cannot read it as JSON"),
    ("config-not-utf8", "mamba1", lambda d: (d / "config.json").write_bytes(b'{"a": "\xff"}'),
     r"config\.json: cannot read it as JSON"),
    ("config-a-list", "mamba1", raw_json("config.json", "[1, 2]"), r"config\.json: not a JSON object"),
    ("config-missing", "mamba1", lambda d: (d / "config.json").unlink(), r"config\.json: missing"),
    ("config-nested-100000", "mamba1", nested_in_config(100_000), r"config\.json: nested more than"),
    ("config-nested-200", "mamba1", nested_in_config(200), r"config\.json: extra.* nested more than 64"),
    ("config-int-beyond-64-bits", "mamba1", config_field("max_position_embeddings", 2**64),
     r"config\.json: max_position_embeddings = 18446744073709551616 is out of range"),
    ("config-int-of-5000-digits", "mamba1", raw_json("config.json", '{"vocab_size": ' + "9" * 5000 + "}"),
     r"config\.json: cannot read it as JSON"),
    # -- config values --
    *[(f"epsilon-{label}-{arch}", arch, config_field("layer_norm_epsilon", value),
       value_error("layer_norm_epsilon", value))
      for arch in ("mamba1", "mamba2")
      for label, value in [("10e400", BIG), ("nan", math.nan), ("infinity", math.inf), ("negative", -1e-5),
                           ("zero", 0), ("string", "1e-5"), ("bool", True), ("list", [1e-5]),
                           ("float-tag-bogus", {"__float__": "1e-5"}),
                           ("float-tag-infinity", {"__float__": "Infinity"})]],
    ("epsilon-literal-1e999", "mamba1",
     raw_json("config.json",
              json.dumps(CONFIGS["mamba1"] | {"layer_norm_epsilon": 0.5}).replace("0.5", HUGE_FLOAT_TEXT)),
     r"field layer_norm_epsilon is inf"),
    *[(f"{key}-{label}-{arch}", arch, config_field(key, value), value_error(key, value))
      for arch, keys in [("mamba1", ("vocab_size", "hidden_size", "num_hidden_layers", "state_size", "conv_kernel",
                                     "intermediate_size", "time_step_rank")),
                         ("mamba2", ("vocab_size", "hidden_size", "num_heads", "head_dim", "n_groups"))]
      for key in keys
      for label, value in [("bool", True), ("float", 2.5), ("zero", 0), ("negative", -4), ("2e31", 2**31),
                           ("10e400", BIG), ("string", "16")]],
    ("num-hidden-layers-missing", "mamba1", edit_json("config.json", lambda c: c.pop("num_hidden_layers")),
     r"field num_hidden_layers is missing"),
    ("conv-kernel-1", "mamba2", config_field("conv_kernel", 1), r"config\.json: .*d_conv"),
    ("expand-1e308", "mamba2", config_field("expand", 1e308), r"field expand is"),
    ("expand-10e400", "mamba2", config_field("expand", BIG), value_error("expand", BIG)),
    ("expand-nan", "mamba2", config_field("expand", math.nan), r"field expand is"),
    ("expand-huge-int", "mamba1", config_field("expand", 2**40), r"field expand is"),
    ("heads-times-head-dim", "mamba2", config_field("num_heads", 3), r"field num_heads"),
    *[(f"time-step-limit-{label}", "mamba2", config_field("time_step_limit", value), r"config\.json: .*time_step_limit")
      for label, value in [("10e400", [0.0, BIG]), ("low-10e400", [BIG, math.inf]), ("nan", [math.nan, 1.0]),
                           ("low-infinite", [math.inf, math.inf]), ("high-nan", [0.0, math.nan]),
                           ("one", [0.1]), ("string", "0,1"), ("bools", [False, True]), ("reversed", [0.5, 0.1]),
                           ("negative", [-1.0, 1.0])]],
    ("eos-outside-vocabulary", "mamba1", config_field("eos_token_id", N_VOCAB), r"field eos_token_id = 260"),
    ("eos-negative", "mamba2", config_field("eos_token_id", -1), r"field eos_token_id = -1"),
    ("tie-word-embeddings-string", "mamba1", config_field("tie_word_embeddings", "yes"),
     r"field tie_word_embeddings is 'yes'"),
    ("use-conv-bias-int", "mamba2", config_field("use_conv_bias", 1), r"field use_conv_bias is 1"),
    ("hidden-act-gelu", "mamba1", config_field("hidden_act", "gelu"), r"field hidden_act = 'gelu'"),
    ("use-bias", "mamba2", config_field("use_bias", True), r"field use_bias"),
    ("architectures-missing", "mamba1", edit_json("config.json", lambda c: c.pop("architectures")), r"architectures"),
    ("architectures-llama", "mamba2", config_field("architectures", ["LlamaForCausalLM"]), r"architectures"),
    ("architectures-nested", "mamba2", config_field("architectures", [["Mamba2ForCausalLM"]]), r"architectures"),
    # -- the index of a sharded checkpoint --
    ("index-not-json", "sharded", raw_json("model.safetensors.index.json", "{"),
     r"index\.json: cannot read it as JSON"),
    ("index-nested-100000", "sharded", raw_json("model.safetensors.index.json", nested(100_000)),
     r"index\.json: nested more than"),
    ("index-weight-map-a-list", "sharded", index_edit(lambda d: d.__setitem__("weight_map", [])), r"weight_map"),
    ("index-a-list", "sharded", raw_json("model.safetensors.index.json", "[]"), r"weight_map"),
    ("index-shard-parent", "sharded", index_edit(lambda d: first_shard_entry(d, "..")), r"weight_map names '\.\.'"),
    ("index-shard-empty-name", "sharded", index_edit(lambda d: first_shard_entry(d, "")), r"weight_map names ''"),
    ("index-shard-outside", "sharded", index_edit(lambda d: first_shard_entry(d, "../model.safetensors")),
     r"weight_map names"),
    ("index-shard-missing", "sharded", index_edit(lambda d: first_shard_entry(d, "model-3.safetensors")),
     r"model-3\.safetensors: cannot read the file"),
    ("index-names-the-wrong-shard", "sharded",
     index_edit(lambda d: d["weight_map"].__setitem__(EMBEDDINGS, "model-00002-of-00002.safetensors")),
     r"embeddings\.weight is missing \(the index names this file"),
    ("index-size-10e400", "sharded", index_edit(lambda d: d.__setitem__("metadata", {"total_size": BIG})),
     r"index\.json: metadata\.total_size = .* is out of range"),
    ("shard-truncated", "sharded", truncate("model-00002-of-00002.safetensors", lambda n: n - 4),
     r"model-00002-of-00002\.safetensors: .*past the end of the file"),
    # -- tokenizer.json --
    ("tokenizer-id-1e999", "mamba1",
     lambda d: (d / "tokenizer.json").write_text((d / "tokenizer.json").read_text().replace('"!": 33', '"!": 1e999')),
     r"tokenizer\.json: .*model\.vocab\['!'\] = inf is not a token id"),
    *[(f"tokenizer-id-{label}-{arch}", arch, vocab_id("!", value),
       r"model\.vocab\['!'\] = " + (r"1000.* is out of range" if value is BIG else r".* is not a token id"))
      for arch in ("mamba1", "mamba2")
      for label, value in [("negative", -1), ("bool", True), ("string", "33"), ("float", 33.0), ("2e31", 2**31),
                           ("10e400", BIG), ("null", None)]],
    ("tokenizer-id-beyond-vocab-size", "mamba1", vocab_id("!", N_VOCAB), r"token id 260 is outside the vocabulary"),
    ("tokenizer-id-far-beyond", "mamba2", vocab_id("!", 10**6), r"token id 1000000 for"),
    ("tokenizer-added-id-1e999", "mamba1", added_token(id=math.inf), r"added_tokens\[0\]\.id = inf is not a token id"),
    ("tokenizer-added-id-string", "mamba2", added_token(id="256"), r"added_tokens\[0\]\.id = '256'"),
    ("tokenizer-added-id-missing", "mamba1", added_token(id=None), r"added_tokens\[0\]\.id = None"),
    ("tokenizer-added-content-int", "mamba1", added_token(content=5), r"added_tokens\[0\] = .* string content"),
    ("tokenizer-added-not-a-list", "mamba2", tokenizer_edit(lambda d: d.__setitem__("added_tokens", {"a": 1})),
     r"added_tokens = \{'a': 1\} is not a list"),
    ("tokenizer-added-entry-a-string", "mamba2", tokenizer_edit(lambda d: d.__setitem__("added_tokens", ["x"])),
     r"added_tokens\[0\] = 'x'"),
    ("tokenizer-merge-ints", "mamba1", tokenizer_edit(lambda d: d["model"].__setitem__("merges", [[1, 2]])),
     r"model\.merges\[0\] = \[1, 2\] is not a merge"),
    ("tokenizer-merges-an-object", "mamba1", tokenizer_edit(lambda d: d["model"].__setitem__("merges", {"a": "b"})),
     r"model\.merges = .* is not a list"),
    ("tokenizer-unigram-entry-int", "mamba2", tokenizer_edit(lambda d: d["model"].__setitem__("vocab", [["a", 0], 7])),
     r"model\.vocab\[1\] = 7 is not \[piece, score\]"),
    ("tokenizer-vocab-a-string", "mamba2", tokenizer_edit(lambda d: d["model"].__setitem__("vocab", "abc")),
     r"model\.vocab is neither"),
    ("tokenizer-no-model", "mamba1", tokenizer_edit(lambda d: d.pop("model")), r"no 'model' object"),
    ("tokenizer-decoders-an-int", "mamba1", tokenizer_edit(lambda d: d.__setitem__("decoder", {"decoders": 5})),
     r"tokenizer\.json"),
    ("tokenizer-nested-100000", "mamba2", raw_json("tokenizer.json", nested(100_000)), r"tokenizer\.json: nested more"),
    ("tokenizer-decoder-nested-100", "mamba1",
     tokenizer_edit(lambda d: d.__setitem__("decoder", json.loads('{"decoders": [' * 100 + "]}" * 100))),
     r"tokenizer\.json: decoder.* nested more than 64"),
    ("tokenizer-empty", "mamba2", raw_json("tokenizer.json", ""), r"tokenizer\.json: cannot read it as JSON"),
    ("tokenizer-truncated", "mamba1", truncate("tokenizer.json", lambda n: n - 3), r"tokenizer\.json: cannot read"),
    ("tokenizer-no-tokens", "mamba1",
     tokenizer_edit(lambda d: (d["model"].__setitem__("vocab", {}), d.__setitem__("added_tokens", []))),
     r"no tokens"),
    # -- safetensors: the file --
    ("weights-missing", "mamba1", lambda d: (d / "model.safetensors").unlink(), r"neither model\.safetensors nor"),
    ("weights-a-torch-pickle", "mamba2",
     lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"), r"torch pickles are not read"),
    ("weights-empty", "mamba1", truncate("model.safetensors", lambda n: 0), r"fewer than the 8"),
    ("weights-header-only-half", "mamba2", truncate("model.safetensors", lambda n: 100), r"header claims"),
    ("weights-truncated", "mamba1", truncate("model.safetensors", lambda n: n - 1), r"past the end of the file"),
    ("weights-header-length-2e64", "mamba1",
     lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 8 + (d / "model.safetensors").read_bytes()[8:]),
     r"header claims"),
    ("weights-header-not-json", "mamba2",
     lambda d: (d / "model.safetensors").write_bytes(struct.pack("<Q", 4) + b"{{{{"), r"header is not JSON"),
    ("weights-header-nested", "mamba1",
     lambda d: (d / "model.safetensors").write_bytes(struct.pack("<Q", 200_000) + nested(100_000).encode()),
     r"nested too deeply"),
    ("weights-header-a-list", "mamba1",
     lambda d: (d / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"[]"), r"not a JSON object"),
    # -- safetensors: the entries (the issue: shape [0, 2**62], 100 unit axes) --
    ("entry-shape-0-by-2e62", "mamba1",
     edit_header(lambda h: h.__setitem__("extra", {"dtype": "F32", "shape": [0, 2**62], "data_offsets": [0, 0]})),
     r"tensor extra: shape \[0, 4611686018427387904\] is not a list of at most 8"),
    ("entry-100-unit-axes", "mamba2", edit_header(entry("backbone.norm_f.weight", shape=[1] * 99 + [N_EMBD])),
     r"norm_f\.weight: shape .* is not a list of at most 8"),
    ("entry-shape-negative", "mamba1", edit_header(entry(IN_PROJ, shape=[-1, N_EMBD])), r"in_proj\.weight: shape"),
    ("entry-shape-floats", "mamba1", edit_header(entry(IN_PROJ, shape=[64.0, 16.0])), r"in_proj\.weight: shape"),
    ("entry-shape-bools", "mamba2", edit_header(entry("backbone.norm_f.weight", shape=[True] * 16)), r"shape"),
    ("entry-shape-10e400", "mamba1", edit_header(entry(IN_PROJ, shape=[BIG])), r"in_proj\.weight: shape"),
    ("entry-dtype-unknown", "mamba1", edit_header(entry(IN_PROJ, dtype="Q4_0")), r"dtype 'Q4_0' is not one of"),
    ("entry-dtype-missing", "mamba2", edit_header(entry(IN_PROJ, dtype=None)), r"dtype None"),
    ("entry-dtype-int", "mamba1", edit_header(entry(IN_PROJ, dtype="I32")), r"in_proj\.weight is I32"),
    ("entry-dtype-f64-on-f32-bytes", "mamba2", edit_header(entry(IN_PROJ, dtype="F64")), r"bytes for a F64 tensor"),
    ("entry-dtype-f16-on-f32-bytes", "mamba1", edit_header(entry(IN_PROJ, dtype="F16")), r"bytes for a F16 tensor"),
    ("entry-offsets-reversed", "mamba1", edit_header(entry(IN_PROJ, data_offsets=[64, 0])), r"data_offsets"),
    ("entry-offsets-10e400", "mamba2", edit_header(entry(IN_PROJ, data_offsets=[0, BIG])), r"past the end"),
    ("entry-offsets-three", "mamba1", edit_header(entry(IN_PROJ, data_offsets=[0, 4, 8])), r"data_offsets"),
    ("entry-offsets-negative", "mamba2", edit_header(entry(IN_PROJ, data_offsets=[-4, 4092])), r"data_offsets"),
    ("entry-not-an-object", "mamba1", edit_header(lambda h: h.__setitem__(IN_PROJ, [1, 2])), r"not an object"),
    ("entries-overlap", "mamba1",
     edit_header(lambda h: h[IN_PROJ].__setitem__("data_offsets", h[EMBEDDINGS]["data_offsets"][:1] + [
         h[EMBEDDINGS]["data_offsets"][0] + 4 * 2 * 2 * N_EMBD * N_EMBD])),
     r"overlap"),
    # -- tensors against the config --
    ("tensor-missing", "mamba1", rewrite_tensors(lambda t: t.pop("backbone.layers.1.mixer.D")),
     r"backbone\.layers\.1\.mixer\.D is missing"),
    ("tensor-missing-lm-head", "mamba2", rewrite_tensors(lambda t: t.pop("lm_head.weight")),
     r"lm_head\.weight is missing"),
    ("tensor-extra", "mamba1",
     rewrite_tensors(lambda t: t.__setitem__("backbone.layers.2.norm.weight", np.ones(N_EMBD))),
     r"tensors the config\.json does not call for, such as 'backbone\.layers\.2\.norm\.weight'"),
    ("tensor-misnamed", "mamba2",
     rewrite_tensors(lambda t: t.__setitem__("backbone.layers.0.mixer.Dx", t.pop("backbone.layers.0.mixer.D"))),
     r"backbone\.layers\.0\.mixer\.D is missing"),
    ("tensor-shape-mismatch", "mamba1", rewrite_tensors(lambda t: t.__setitem__(IN_PROJ, np.zeros((63, N_EMBD)))),
     r"in_proj\.weight has shape \(63, 16\); the config makes it"),
    ("tensor-transposed", "mamba2", rewrite_tensors(lambda t: t.__setitem__(IN_PROJ, t[IN_PROJ].T)),
     r"in_proj\.weight has shape"),
    ("tensor-scalar", "mamba1",
     rewrite_tensors(lambda t: t.__setitem__("backbone.norm_f.weight", np.array(1.0))), r"norm_f\.weight has shape"),
    ("tensor-nan", "mamba2", rewrite_tensors(lambda t: t[IN_PROJ].__setitem__((0, 0), np.nan)), r"NaN or infinite"),
    ("tensor-infinity", "mamba1", rewrite_tensors(lambda t: t[EMBEDDINGS].__setitem__((3, 3), np.inf)),
     r"embeddings\.weight holds 1 values that are NaN or infinite"),
    ("vocab-size-disagrees", "mamba2", config_field("vocab_size", N_VOCAB + 1), r"embeddings\.weight has shape"),
    ("layers-disagree", "mamba1", config_field("num_hidden_layers", 3), r"backbone\.layers\.2\..* is missing"),
]
# the ids a CLI subprocess runs (each costs an interpreter start): the cases and one of each kind
CLI_SAMPLE = {"config.json-fifo", "config.json-dev-zero", "model.safetensors-fifo", "epsilon-10e400-mamba1",
              "config-nested-100000", "tokenizer-id-1e999", "entry-shape-0-by-2e62", "entry-100-unit-axes",
              "tensor-missing", "weights-truncated"}


@pytest.fixture
def damaged(request, pristine, tmp_path) -> Path:
    """A copy of the checkpoint the case names, with its damage applied."""
    _, checkpoint, damage, _ = request.param
    directory = tmp_path / "checkpoint"
    shutil.copytree(pristine[checkpoint], directory)
    damage(directory)
    return directory


def test_the_pristine_checkpoints_load_and_convert(pristine, tmp_path):
    """The starting points are valid: the damages below are what breaks them."""
    for name, kind in [("mamba1", MambaModel), ("mamba2", Mamba2Model), ("sharded", MambaModel)]:
        model = load_hf(pristine[name])
        assert isinstance(model, kind) and model.hparams.n_vocab == N_VOCAB
        assert model.vocab is not None and model.vocab.decode(model.vocab.encode("hi there")) == b"hi there"
        assert model.vocab.eos == 256
        out = tmp_path / f"{name}.gguf"
        convert_hf_to_gguf(pristine[name], out)
        assert load_gguf(out).hparams.n_vocab == N_VOCAB


# damages only the tokenizers library sees (load_hf hands it tokenizer.json whole): they run where it is
# installed, the test-torch extra's stage of CI
TOKENIZERS_CASES = {"tokenizer-decoders-an-int"}


@pytest.mark.parametrize("damaged", [pytest.param(case, marks=pytest.mark.needs_torch) if case[0] in TOKENIZERS_CASES
                                     else case for case in CASES], ids=[case[0] for case in CASES], indirect=True)
def test_a_damaged_checkpoint_is_one_model_error(damaged, request, deadline):
    """load_hf raises the package's ModelError naming the file / key / value, and nothing else escapes."""
    name, message = request.node.callspec.params["damaged"][0], request.node.callspec.params["damaged"][3]
    if name in TOKENIZERS_CASES:
        pytest.importorskip("tokenizers", reason="the tokenizers library reads this part of tokenizer.json")
    with pytest.raises(ModelError, match=message) as raised:
        load_hf(damaged)
    assert "\n" not in str(raised.value) and len(str(raised.value)) < 600


@pytest.mark.parametrize("damaged", [case for case in CASES if case[0] in CLI_SAMPLE],
                         ids=sorted(CLI_SAMPLE, key=[case[0] for case in CASES].index), indirect=True)
def test_convert_says_one_line_and_writes_nothing(damaged, tmp_path):
    """``python -m recurrent_cache convert``: one line on stderr, exit status 2, no traceback, no output file."""
    out = tmp_path / "out.gguf"
    run = subprocess.run([sys.executable, "-m", "recurrent_cache", "convert", str(damaged), str(out)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("convert: ") and run.stderr.count("\n") == 1, run.stderr
    assert "Traceback" not in run.stderr and run.stdout == ""
    assert not out.exists()


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads a file of mode 000")
@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_an_unreadable_file_is_named(pristine, tmp_path, name):
    directory = tmp_path / "checkpoint"
    shutil.copytree(pristine["mamba1"], directory)
    (directory / name).chmod(0)
    with pytest.raises(ModelError, match=rf"{name}: cannot read"):
        load_hf(directory)


@pytest.mark.parametrize("kind, make", [("a FIFO", fifo), ("a character device", dev_zero)])
def test_load_model_refuses_a_gguf_path_that_is_no_regular_file(tmp_path, kind, make, deadline):
    """``load_model`` reads a path that is no directory as GGUF: the same check of the file's kind."""
    path = tmp_path / "model.gguf"
    make(path)
    with pytest.raises(ModelError, match=rf"model\.gguf: not a valid GGUF file: it is {kind}, not a regular file"):
        load_model(path)


def test_generate_on_a_checkpoint_without_tokenizer_json_says_what_is_missing(pristine, tmp_path):
    """The message speaks of the directory and its missing tokenizer.json, not of a GGUF key."""
    directory = tmp_path / "no-tokenizer"
    shutil.copytree(pristine["mamba1"], directory)
    (directory / "tokenizer.json").unlink()
    run = subprocess.run([sys.executable, "-m", "recurrent_cache", "generate", "hello", "--model", str(directory)],
                         capture_output=True, text=True, timeout=120)
    lines = run.stderr.strip().splitlines()
    assert run.returncode != 0 and len(lines) == 1, run.stderr
    assert "tokenizer.json" in lines[0] and "--tokens" in lines[0] and "tokenizer.ggml" not in lines[0], lines[0]
