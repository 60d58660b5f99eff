"""Hugging Face checkpoint directories (transformers' ``save_pretrained``): Mamba-1 and Mamba-2.

``load_hf(dir)`` reads ``config.json``, the weights (``model.safetensors``, or
shards named by ``model.safetensors.index.json``; F32, F16 or BF16) with the
numpy safetensors reader — no torch — and ``tokenizer.json`` when there is
one.  ``convert_hf_to_gguf`` writes the same model with llama.cpp's keys and
tensor names; ``load_model`` takes either a GGUF file or a directory.

Supported: ``MambaForCausalLM`` (architecture ``mamba``) and
``Mamba2ForCausalLM`` (``mamba2``) with llama.cpp's restrictions: no biases on
``in_proj`` / ``out_proj`` (``use_bias = false``), ``hidden_act = silu``.
Anything else is one ``ModelError`` naming the file and the field.

A checkpoint directory is untrusted input.  Each file is read only when it is
a regular file (a FIFO, a device, a directory or a socket under a checkpoint
file's name is refused without waiting on it) and only up to a cap:
``JSON_LIMITS`` for the JSON files, the format's 100 MB for a safetensors
header.  JSON nested deeper than ``MAX_JSON_DEPTH`` or holding an integer
beyond 64 bits is refused, and every config value is checked for its type
and range (integers in ``[1, 2**31)``, floats finite) before it is used.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from ._registry import by_hf_architecture, families
from .gguf_io import load_gguf, write_gguf
from ..errors import ModelError
from .language_model import LanguageModel
from ..errors import SafetensorsError
from .safetensors_file import SafetensorsFile
from ._untrusted import read_capped, short_repr
from .vocab import TokenizerTable, Vocabulary

__all__ = ["Checkpoint", "as_float", "built", "common_sizes", "convert_hf_to_gguf", "head_tensors", "load_hf",
           "load_model"]

T = TypeVar("T")
CONFIG, WEIGHTS, WEIGHTS_INDEX, TOKENIZER = ("config.json", "model.safetensors", "model.safetensors.index.json",
                                             "tokenizer.json")
# The most load_hf reads of each JSON file, far above real ones: a config.json is a few KB, an index a few
# hundred KB for thousands of tensors, a tokenizer.json up to ~20 MB (large multilingual vocabularies).
JSON_LIMITS = {CONFIG: 4 * 2**20, WEIGHTS_INDEX: 64 * 2**20, TOKENIZER: 128 * 2**20}
MAX_JSON_DEPTH = 64        # real files nest a handful of levels (tokenizer.json's Sequence of decoders)
MAX_JSON_INT = 2**63       # larger integers are no count, id or offset of any real checkpoint
MAX_CONFIG_INT = 2**31 - 1  # sizes and counts of a config.json: llama.cpp stores them in 32 bits


def load_model(path: str | os.PathLike[str], dtype: Any = np.float64) -> LanguageModel:
    """A GGUF file (``load_gguf``) or a Hugging Face checkpoint directory (``load_hf``)."""
    return load_hf(path, dtype) if os.path.isdir(path) else load_gguf(path, dtype)


def load_hf(path: str | os.PathLike[str], dtype: Any = np.float64) -> LanguageModel:
    """Load a ``MambaForCausalLM`` or ``Mamba2ForCausalLM`` directory written by ``save_pretrained``.

    Returns a ``MambaModel`` or ``Mamba2Model`` computing in ``dtype``, with
    the vocabulary of ``tokenizer.json`` when present (encoding with the
    ``tokenizers`` package when it is installed, else by greedy longest match),
    token ids only without it.  Raises ``ModelError`` naming the file and the
    field for anything it does not support or that is inconsistent.
    """
    return _load(Checkpoint(Path(path)), dtype)


def convert_hf_to_gguf(hf_dir: str | os.PathLike[str], out_gguf: str | os.PathLike[str],
                       file_type: str = "f32") -> LanguageModel:
    """Write the checkpoint in ``hf_dir`` as a GGUF file llama.cpp loads; returns the model (as ``load_hf``).
    Mamba-1, Mamba-2 and the hybrid families whose GGUF the package writes (Jamba, LFM2, Nemotron-H,
    Qwen3-Next); another family's checkpoint, or one llama.cpp would run otherwise, raises ``ModelError``
    before the output file is opened.

    Keys, tensor names and the tokenizer (``tokenizer.ggml.tokens``, types,
    merges, eos) are those of llama.cpp's ``convert_hf_to_gguf.py``;
    ``file_type`` "f16" stores the 2-D weights in f16 as its ``--outtype f16``.
    """
    checkpoint = Checkpoint(Path(hf_dir))
    model = _load(checkpoint, np.float32)   # every check of the checkpoint before the output file is opened
    tokenizer = checkpoint.tokenizer()
    name = Path(hf_dir).resolve().name
    if tokenizer is None:
        write_gguf(model, out_gguf, file_type=file_type, name=name)
    else:
        table = tokenizer[0].padded(model.hparams.n_vocab)
        write_gguf(model, out_gguf, file_type=file_type, name=name, tokens=table.tokens,
                   token_types=table.token_types, tokenizer=table.model, eos=checkpoint.eos(),
                   merges=table.merges or None)
    return model


def _load(checkpoint: Checkpoint, dtype: Any) -> LanguageModel:
    """The model of ``checkpoint``, computing in ``dtype``."""
    vocab = checkpoint.vocabulary()
    model: LanguageModel = checkpoint.family.from_hf(checkpoint, dtype, vocab)
    if checkpoint.unread:
        extra = sorted(checkpoint.unread)
        raise ModelError(f"{checkpoint.directory}: {len(extra)} tensors the {CONFIG} does not call for, "
                         f"such as {short_repr(extra[0])}: weights of another configuration?")
    return model


class Checkpoint:
    """One checkpoint directory: its config, where each tensor lives, and reads that name the file."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        config_path = directory / CONFIG
        if not directory.is_dir():
            raise ModelError(f"{directory}: not a directory")
        if not _present(config_path):
            raise ModelError(f"{config_path}: missing (a save_pretrained directory has one)")
        config = _read_json(config_path)
        if not isinstance(config, dict):
            raise ModelError(f"{config_path}: not a JSON object")
        self.config: dict[str, Any] = config
        architectures = config.get("architectures")
        family = (by_hf_architecture(architectures[0]) if isinstance(architectures, list) and len(architectures) == 1
                  else None)
        if family is None:
            raise ModelError(f"{config_path}: architectures {architectures!r}; load_hf reads "
                             f"{' and '.join(f.hf_architecture for f in families())} checkpoints")
        self.family = family
        self._open: dict[Path, SafetensorsFile] = {}   # each shard parsed once
        self._tokenizer: tuple[TokenizerTable, Any] | None = None   # read once, by tokenizer()
        self.files: dict[str, Path] = self._weight_files()
        self.unread = set(self.files)   # tensors no layer has asked for: a checkpoint of another config

    # -- config fields --------------------------------------------------------------

    def field(self, name: str, kind: type, default: Any = None) -> Any:
        """``config.json`` field ``name``, checked to be ``kind``: a bool, a str, or an int in
        ``[1, MAX_CONFIG_INT]`` (every integer field is a size or a count)."""
        value = self.config.get(name, default)
        where = self.directory / CONFIG
        if value is None:
            raise ModelError(f"{where}: field {name} is missing")
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)
                            or not 1 <= value <= MAX_CONFIG_INT):
            raise ModelError(f"{where}: field {name} is {short_repr(value)}, not an integer in [1, 2**31)")
        if kind in (bool, str) and not isinstance(value, kind):
            raise ModelError(f"{where}: field {name} is {short_repr(value)}, not a {kind.__name__}")
        return kind(value)

    def positive_float(self, name: str, default: float, high: float) -> float:
        """``config.json`` field ``name``: a finite number in ``(0, high]``."""
        value = self.config.get(name, default)
        number = as_float(value)
        if number is None or not 0 < number <= high:
            raise ModelError(f"{self.directory / CONFIG}: field {name} is {short_repr(value)}, not a number "
                             f"in (0, {high:g}]")
        return number

    def refuse(self, name: str, reason: str) -> ModelError:
        return ModelError(f"{self.directory / CONFIG}: field {name} = {short_repr(self.config.get(name))}: {reason}")

    def eos(self) -> int | None:
        """``eos_token_id`` when it is one token id of the vocabulary (a list of them is not read)."""
        eos = self.config.get("eos_token_id")
        if not isinstance(eos, int) or isinstance(eos, bool):
            return None
        n_vocab = self.field("vocab_size", int)
        if not 0 <= eos < n_vocab:
            raise self.refuse("eos_token_id", f"not a token id of the vocabulary [0, {n_vocab})")
        return eos

    # -- weights -------------------------------------------------------------------------

    def _weight_files(self) -> dict[str, Path]:
        index = self.directory / WEIGHTS_INDEX
        single = self.directory / WEIGHTS
        if _present(index):
            contents = _read_json(index)
            weight_map = contents.get("weight_map") if isinstance(contents, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise ModelError(f"{index}: field weight_map is not an object of file names")
            files = {}
            for tensor, file in weight_map.items():
                shard = self.directory / file
                # a shard outside the directory: refuse rather than follow ("", "." and ".." name a directory)
                if Path(file).name != file or file in ("", ".", ".."):
                    raise ModelError(f"{index}: weight_map names {short_repr(file)} for tensor {short_repr(tensor)}, "
                                     f"not a file in the directory")
                files[tensor] = shard
            return files
        if _present(single):
            return {name: single for name in self._safetensors(single).tensors}
        found = sorted(p.name for p in self.directory.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = f" (found {', '.join(found)}: torch pickles are not read; save with safe_serialization)" if found else ""
        raise ModelError(f"{self.directory}: neither {WEIGHTS} nor {WEIGHTS_INDEX}{hint}")

    def _safetensors(self, path: Path) -> SafetensorsFile:
        if path not in self._open:
            try:
                self._open[path] = SafetensorsFile(path)
            except SafetensorsError as exc:
                raise ModelError(f"{path}: not a valid safetensors file: {exc}") from None
            except OSError as exc:
                raise ModelError(f"{path}: cannot read the file: {exc.strerror or exc}") from None
        return self._open[path]

    def layer_tensors(self, il: int, prefix: str = "backbone.layers") -> Callable[[str, tuple[int, ...]], np.ndarray]:
        """``tensor`` of layer ``il``: ``(name, shape)`` reads ``{prefix}.{il}.{name}`` (a hybrid model's
        layers are under ``model.layers``)."""
        return lambda name, shape: self.tensor(f"{prefix}.{il}.{name}", shape)

    def has(self, name: str) -> bool:
        return name in self.files

    def tensor(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Tensor ``name`` of ``shape`` (unit axes aside) as float32/float64: ModelError naming file and tensor
        when it is missing, of another shape or type, or holds NaN or infinity."""
        path = self.files.get(name)
        self.unread.discard(name)
        if path is None:
            raise ModelError(f"{self.directory}: tensor {name} is missing from the checkpoint")
        file = self._safetensors(path)
        if name not in file.tensors:
            raise ModelError(f"{path}: tensor {name} is missing (the index names this file for it)")
        try:
            values = file.floats(name)
        except SafetensorsError as exc:
            raise ModelError(f"{path}: {exc}") from None
        if values.shape != shape:
            # transformers keeps unit axes llama.cpp drops (conv1d.weight [channels, 1, d_conv])
            if [d for d in values.shape if d != 1] != [d for d in shape if d != 1]:
                raise ModelError(f"{path}: tensor {name} has shape {values.shape}; the config makes it {shape}")
            values = values.reshape(shape)
        bad = int(np.size(values) - np.isfinite(values).sum())
        if bad:
            raise ModelError(f"{path}: tensor {name} holds {bad} values that are NaN or infinite")
        return values

    # -- vocabulary ----------------------------------------------------------------------

    def tokenizer(self) -> tuple[TokenizerTable, Any] | None:
        """``tokenizer.json`` as a table of at most ``vocab_size`` tokens, and its JSON; None when the
        directory has none."""
        path = self.directory / TOKENIZER
        if self._tokenizer is None and _present(path):
            data = _read_json(path)
            try:
                table = TokenizerTable.from_json(data)
            except ValueError as exc:
                raise ModelError(f"{path}: not a tokenizer.json this loader reads: {exc}") from None
            n_vocab = self.field("vocab_size", int)
            if len(table.tokens) > n_vocab:
                raise ModelError(f"{path}: token id {len(table.tokens) - 1} is outside the vocabulary "
                                 f"[0, {n_vocab}) of {CONFIG}'s vocab_size")
            self._tokenizer = table, data
        return self._tokenizer

    def vocabulary(self) -> Vocabulary | None:
        tokenizer = self.tokenizer()
        if tokenizer is None:
            return None
        table, data = tokenizer
        return table.vocabulary(self.eos(), _tokenizer_encoder(self.directory / TOKENIZER, data))


_SPECIAL_FLOATS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _json_floats(obj: dict[str, Any]) -> Any:
    """transformers >= 5 writes infinities as ``{"__float__": "Infinity"}``: read them back as floats
    (any other object is left as it is, as transformers leaves it)."""
    if set(obj) == {"__float__"} and obj["__float__"] in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[obj["__float__"]]
    return obj


def _present(path: Path) -> bool:
    """Whether the directory has an entry ``path`` (of any kind: reading it checks that it is a regular file)."""
    try:
        path.lstat()
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise ModelError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    return True


def _read_json(path: Path) -> Any:
    """The JSON value in ``path`` (a regular file of at most ``JSON_LIMITS`` bytes), checked by ``_check_json``;
    ModelError naming the file and what is wrong."""
    try:
        raw = read_capped(path, JSON_LIMITS[path.name], ModelError)
    except ModelError as exc:
        raise ModelError(f"{path}: {exc}") from None
    except OSError as exc:
        raise ModelError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    try:
        value = json.loads(raw.decode("utf-8"), object_hook=_json_floats)
    except RecursionError:
        raise ModelError(f"{path}: nested more than {MAX_JSON_DEPTH} levels deep") from None
    except (UnicodeDecodeError, ValueError) as exc:  # ValueError: bad JSON, an integer of too many digits
        raise ModelError(f"{path}: cannot read it as JSON: {exc}") from None
    _check_json(path, value)
    return value


def _check_json(path: Path, value: Any) -> None:
    """ModelError naming ``path`` and the key when ``value`` nests deeper than ``MAX_JSON_DEPTH`` or holds an
    integer of ``MAX_JSON_INT`` or more.  Iterative: a depth no real file has cannot exhaust the stack here,
    and the readers after it may recurse."""
    pending: list[tuple[Any, str, int]] = [(value, "", 0)]
    while pending:
        item, key, depth = pending.pop()
        if depth > MAX_JSON_DEPTH:
            raise ModelError(f"{path}: {key} is nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(item, dict):
            pending.extend((v, _key(key, k), depth + 1) for k, v in item.items())
        elif isinstance(item, list):
            pending.extend((v, f"{key}[{i}]", depth + 1) for i, v in enumerate(item))
        elif isinstance(item, int) and not isinstance(item, bool) and abs(item) >= MAX_JSON_INT:
            raise ModelError(f"{path}: {key} = {short_repr(item)} is out of range (beyond 64 bits)")


def _key(parent: str, key: str) -> str:
    """The path of ``parent``'s member ``key`` as a message shows it: ``a.b``, or ``a['b c']``."""
    if not key.isidentifier():
        return f"{parent}[{short_repr(key)}]"
    return f"{parent}.{key}" if parent else key


def as_float(value: Any) -> float | None:
    """``value`` as a finite float; None when it is not a number (a bool, a string), infinite, NaN or
    too large for a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None



def _tokenizer_encoder(path: Path, data: Any) -> Any:
    """The ``tokenizers`` package's encoder of ``data``, the JSON of ``path`` (text -> ids), or None when the
    package is missing."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    try:
        tokenizer = Tokenizer.from_str(json.dumps(data))
    except Exception as exc:  # the Rust side raises its own Exception subclass
        raise ModelError(f"{path}: the tokenizers package cannot load it: {exc}") from None

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)
    return encode


def common_sizes(checkpoint: Checkpoint) -> dict[str, Any]:
    """The sizes every family reads from a config.json, after the checks every family makes."""
    if checkpoint.field("hidden_act", str, "silu") != "silu":
        raise checkpoint.refuse("hidden_act", "only silu is supported (as in llama.cpp)")
    if checkpoint.field("use_bias", bool, False):
        raise checkpoint.refuse("use_bias", "in_proj / out_proj biases are not supported (llama.cpp has none)")
    n_embd = checkpoint.field("hidden_size", int)
    return dict(n_vocab=checkpoint.field("vocab_size", int), n_embd=n_embd,
                n_layer=checkpoint.field("num_hidden_layers", int), d_conv=checkpoint.field("conv_kernel", int),
                d_state=checkpoint.field("state_size", int),
                rms_eps=checkpoint.positive_float("layer_norm_epsilon", 1e-5, high=1.0))


def head_tensors(checkpoint: Checkpoint, n_vocab: int, n_embd: int, tied_default: bool
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """token_embd, output_norm and output (None when tied, as transformers ties them)."""
    embeddings = next((n for n in ("backbone.embeddings.weight", "backbone.embedding.weight") if checkpoint.has(n)),
                      "backbone.embeddings.weight")
    token_embd = checkpoint.tensor(embeddings, (n_vocab, n_embd))
    output_norm = checkpoint.tensor("backbone.norm_f.weight", (n_embd,))
    tied = checkpoint.field("tie_word_embeddings", bool, tied_default)
    if tied:   # a tied checkpoint may still carry lm_head.weight; transformers ties it over the embeddings
        checkpoint.unread.discard("lm_head.weight")
    output = None if tied else checkpoint.tensor("lm_head.weight", (n_vocab, n_embd))
    return token_embd, output_norm, output


def built(checkpoint: Checkpoint, build: Callable[..., T], **fields: Any) -> T:
    """``build(**fields)`` (hyper-parameters or the model), its ModelError naming the checkpoint's config."""
    try:
        return build(**fields)
    except ModelError as exc:
        raise ModelError(f"{checkpoint.directory / CONFIG}: {exc}") from None
