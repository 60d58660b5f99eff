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
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from .gguf_io import load_gguf, write_gguf
from .mamba import MambaHParams, MambaLayer, MambaModel
from .mamba2 import Mamba2HParams, Mamba2Layer, Mamba2Model
from ..errors import ModelError
from .recurrent import RecurrentModel
from ..errors import SafetensorsError
from .safetensors_file import SafetensorsFile
from .vocab import TokenizerTable, Vocabulary

__all__ = ["ARCHITECTURES", "convert_hf_to_gguf", "load_hf", "load_model"]

ARCHITECTURES = ("MambaForCausalLM", "Mamba2ForCausalLM")
T = TypeVar("T")
CONFIG, WEIGHTS, WEIGHTS_INDEX, TOKENIZER = ("config.json", "model.safetensors", "model.safetensors.index.json",
                                             "tokenizer.json")


def load_model(path: str | os.PathLike[str], dtype: Any = np.float64) -> RecurrentModel:
    """A GGUF file (``load_gguf``) or a Hugging Face checkpoint directory (``load_hf``)."""
    return load_hf(path, dtype) if os.path.isdir(path) else load_gguf(path, dtype)


def load_hf(path: str | os.PathLike[str], dtype: Any = np.float64) -> RecurrentModel:
    """Load a ``MambaForCausalLM`` or ``Mamba2ForCausalLM`` directory written by ``save_pretrained``.

    Returns a ``MambaModel`` or ``Mamba2Model`` computing in ``dtype``, with
    the vocabulary of ``tokenizer.json`` when present (encoding with the
    ``tokenizers`` package when it is installed, else by greedy longest match),
    token ids only without it.  Raises ``ModelError`` naming the file and the
    field for anything it does not support or that is inconsistent.
    """
    checkpoint = _Checkpoint(Path(path))
    config = checkpoint.config
    architecture = checkpoint.architecture
    vocab = checkpoint.vocabulary()
    if architecture == "MambaForCausalLM":
        return _mamba(checkpoint, config, dtype, vocab)
    return _mamba2(checkpoint, config, dtype, vocab)


def convert_hf_to_gguf(hf_dir: str | os.PathLike[str], out_gguf: str | os.PathLike[str],
                       file_type: str = "f32") -> RecurrentModel:
    """Write the checkpoint in ``hf_dir`` as a GGUF file llama.cpp loads; returns the model (as ``load_hf``).

    Keys, tensor names and the tokenizer (``tokenizer.ggml.tokens``, types,
    merges, eos) are those of llama.cpp's ``convert_hf_to_gguf.py``;
    ``file_type`` "f16" stores the 2-D weights in f16 as its ``--outtype f16``.
    """
    checkpoint = _Checkpoint(Path(hf_dir))
    model = load_hf(hf_dir, dtype=np.float32)
    table = checkpoint.tokenizer_table()
    name = Path(hf_dir).resolve().name
    if table is not None:
        table = table.padded(model.hparams.n_vocab)
    if table is None:
        write_gguf(model, out_gguf, file_type=file_type, name=name)
    else:
        write_gguf(model, out_gguf, file_type=file_type, name=name, tokens=table.tokens,
                   token_types=table.token_types, tokenizer=table.model, eos=checkpoint.eos(),
                   merges=table.merges or None)
    return model


class _Checkpoint:
    """One checkpoint directory: its config, where each tensor lives, and reads that name the file."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        config_path = directory / CONFIG
        if not directory.is_dir():
            raise ModelError(f"{directory}: not a directory")
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"), object_hook=_json_floats)
        except FileNotFoundError:
            raise ModelError(f"{config_path}: missing (a save_pretrained directory has one)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelError(f"{config_path}: cannot read it as JSON: {exc}") from None
        if not isinstance(config, dict):
            raise ModelError(f"{config_path}: not a JSON object")
        self.config: dict[str, Any] = config
        architectures = config.get("architectures")
        if not isinstance(architectures, list) or len(architectures) != 1 or architectures[0] not in ARCHITECTURES:
            raise ModelError(f"{config_path}: architectures {architectures!r}; load_hf reads "
                             f"{' and '.join(ARCHITECTURES)} checkpoints")
        self.architecture = str(architectures[0])
        self._open: dict[Path, SafetensorsFile] = {}   # each shard parsed once
        self.files: dict[str, Path] = self._weight_files()

    # -- config fields --------------------------------------------------------------

    def field(self, name: str, kind: type, default: Any = None) -> Any:
        """``config.json`` field ``name``, checked to be ``kind`` (int, float, bool, str)."""
        value = self.config.get(name, default)
        where = self.directory / CONFIG
        if value is None:
            raise ModelError(f"{where}: field {name} is missing")
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ModelError(f"{where}: field {name} is {value!r}, not an integer")
        if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ModelError(f"{where}: field {name} is {value!r}, not a number")
        if kind in (bool, str) and not isinstance(value, kind):
            raise ModelError(f"{where}: field {name} is {value!r}, not a {kind.__name__}")
        return kind(value)

    def refuse(self, name: str, reason: str) -> ModelError:
        return ModelError(f"{self.directory / CONFIG}: field {name} = {self.config.get(name)!r}: {reason}")

    def eos(self) -> int | None:
        eos = self.config.get("eos_token_id")
        return eos if isinstance(eos, int) and not isinstance(eos, bool) else None

    # -- weights -------------------------------------------------------------------------

    def _weight_files(self) -> dict[str, Path]:
        index = self.directory / WEIGHTS_INDEX
        single = self.directory / WEIGHTS
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
                raise ModelError(f"{index}: cannot read it as JSON: {exc}") from None
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise ModelError(f"{index}: field weight_map is not an object of file names")
            files = {}
            for tensor, file in weight_map.items():
                shard = self.directory / file
                if Path(file).name != file:  # a shard outside the directory: refuse rather than follow
                    raise ModelError(f"{index}: weight_map names {file!r}, not a file in the directory")
                files[tensor] = shard
            return files
        if single.is_file():
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

    def has(self, name: str) -> bool:
        return name in self.files

    def tensor(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Tensor ``name`` of ``shape`` (unit axes aside) as float32/float64: ModelError naming file and tensor
        when it is missing, of another shape or type, or holds NaN or infinity."""
        path = self.files.get(name)
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

    def tokenizer_table(self) -> TokenizerTable | None:
        path = self.directory / TOKENIZER
        if not path.is_file():
            return None
        try:
            return TokenizerTable.read(path)
        except (OSError, ValueError, TypeError, AttributeError, KeyError, IndexError) as exc:
            raise ModelError(f"{path}: not a tokenizer.json this loader reads: {exc}") from None

    def vocabulary(self) -> Vocabulary | None:
        table = self.tokenizer_table()
        if table is None:
            return None
        return table.vocabulary(self.eos(), _tokenizer_encoder(self.directory / TOKENIZER))


def _json_floats(obj: dict[str, Any]) -> Any:
    """transformers >= 5 writes infinities as ``{"__float__": "Infinity"}``: read them back as floats."""
    if set(obj) == {"__float__"} and isinstance(obj["__float__"], str):
        return float(obj["__float__"])
    return obj


def _tokenizer_encoder(path: Path) -> Any:
    """The ``tokenizers`` package's encoder of ``path`` (text -> ids), or None when the package is missing."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    try:
        tokenizer = Tokenizer.from_file(os.fspath(path))
    except Exception as exc:  # the Rust side raises its own Exception subclass
        raise ModelError(f"{path}: the tokenizers package cannot load it: {exc}") from None

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)
    return encode


def _common(checkpoint: _Checkpoint) -> dict[str, Any]:
    if checkpoint.field("hidden_act", str, "silu") != "silu":
        raise checkpoint.refuse("hidden_act", "only silu is supported (as in llama.cpp)")
    if checkpoint.field("use_bias", bool, False):
        raise checkpoint.refuse("use_bias", "in_proj / out_proj biases are not supported (llama.cpp has none)")
    n_embd = checkpoint.field("hidden_size", int)
    return dict(n_vocab=checkpoint.field("vocab_size", int), n_embd=n_embd,
                n_layer=checkpoint.field("num_hidden_layers", int), d_conv=checkpoint.field("conv_kernel", int),
                d_state=checkpoint.field("state_size", int),
                rms_eps=checkpoint.field("layer_norm_epsilon", float, 1e-5))


def _head(checkpoint: _Checkpoint, n_vocab: int, n_embd: int, tied_default: bool
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """token_embd, output_norm and output (None when tied, as transformers ties them)."""
    embeddings = next((n for n in ("backbone.embeddings.weight", "backbone.embedding.weight") if checkpoint.has(n)),
                      "backbone.embeddings.weight")
    token_embd = checkpoint.tensor(embeddings, (n_vocab, n_embd))
    output_norm = checkpoint.tensor("backbone.norm_f.weight", (n_embd,))
    tied = checkpoint.field("tie_word_embeddings", bool, tied_default)
    output = None if tied else checkpoint.tensor("lm_head.weight", (n_vocab, n_embd))
    return token_embd, output_norm, output


def _built(checkpoint: _Checkpoint, build: Callable[..., T], **fields: Any) -> T:
    """``build(**fields)`` (hyper-parameters or the model), its ModelError naming the checkpoint's config."""
    try:
        return build(**fields)
    except ModelError as exc:
        raise ModelError(f"{checkpoint.directory / CONFIG}: {exc}") from None


def _mamba(checkpoint: _Checkpoint, config: dict[str, Any], dtype: Any, vocab: Vocabulary | None) -> MambaModel:
    common = _common(checkpoint)
    n_embd = common["n_embd"]
    d_inner = checkpoint.field("intermediate_size", int, int(checkpoint.field("expand", int, 2) * n_embd))
    rank = config.get("time_step_rank", "auto")
    dt_rank = math.ceil(n_embd / 16) if rank == "auto" else checkpoint.field("time_step_rank", int)
    p = _built(checkpoint, MambaHParams, **common, d_inner=d_inner, dt_rank=dt_rank)
    use_conv_bias = checkpoint.field("use_conv_bias", bool, True)
    layers = []
    for il in range(p.n_layer):
        prefix = f"backbone.layers.{il}."

        def weight(name: str, shape: tuple[int, ...], prefix: str = prefix) -> np.ndarray:
            return checkpoint.tensor(prefix + name, shape)
        layers.append(MambaLayer(
            attn_norm=weight("norm.weight", (p.n_embd,)),
            ssm_in=weight("mixer.in_proj.weight", (2 * p.d_inner, p.n_embd)),
            ssm_conv1d=weight("mixer.conv1d.weight", (p.d_inner, p.d_conv)),
            ssm_conv1d_b=(weight("mixer.conv1d.bias", (p.d_inner,)) if use_conv_bias
                          else np.zeros(p.d_inner, np.float32)),
            ssm_x=weight("mixer.x_proj.weight", (p.dt_rank + 2 * p.d_state, p.d_inner)),
            ssm_dt=weight("mixer.dt_proj.weight", (p.d_inner, p.dt_rank)),
            ssm_dt_b=weight("mixer.dt_proj.bias", (p.d_inner,)),
            ssm_a=-np.exp(weight("mixer.A_log", (p.d_inner, p.d_state)).astype(np.float64)),
            ssm_d=weight("mixer.D", (p.d_inner,)),
            ssm_out=weight("mixer.out_proj.weight", (p.n_embd, p.d_inner)),
        ))
    token_embd, output_norm, output = _head(checkpoint, p.n_vocab, p.n_embd, tied_default=True)
    return _built(checkpoint, MambaModel, hparams=p, token_embd=token_embd, layers=layers,
                    output_norm=output_norm, output=output, dtype=dtype, vocab=vocab)


def _mamba2(checkpoint: _Checkpoint, config: dict[str, Any], dtype: Any, vocab: Vocabulary | None) -> Mamba2Model:
    common = _common(checkpoint)
    n_embd = common["n_embd"]
    d_inner = int(checkpoint.field("expand", float, 2) * n_embd)
    n_head, head_dim = checkpoint.field("num_heads", int), checkpoint.field("head_dim", int)
    if n_head * head_dim != d_inner:
        raise checkpoint.refuse("num_heads", f"num_heads × head_dim = {n_head * head_dim}, but "
                                f"expand × hidden_size = {d_inner}")
    limit = config.get("time_step_limit", (0.0, math.inf))
    if (not isinstance(limit, (list, tuple)) or len(limit) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in limit)):
        raise checkpoint.refuse("time_step_limit", "not a pair of numbers")
    p = _built(checkpoint, Mamba2HParams, **common, d_inner=d_inner, n_head=n_head,
                                n_group=checkpoint.field("n_groups", int, 1),
                                time_step_limit=(float(limit[0]), float(limit[1])))
    use_conv_bias = checkpoint.field("use_conv_bias", bool, True)
    layers = []
    for il in range(p.n_layer):
        prefix = f"backbone.layers.{il}."

        def weight(name: str, shape: tuple[int, ...], prefix: str = prefix) -> np.ndarray:
            return checkpoint.tensor(prefix + name, shape)
        layers.append(Mamba2Layer(
            attn_norm=weight("norm.weight", (p.n_embd,)),
            ssm_in=weight("mixer.in_proj.weight", (p.d_in_proj, p.n_embd)),
            ssm_conv1d=weight("mixer.conv1d.weight", (p.conv_channels, p.d_conv)),
            ssm_conv1d_b=(weight("mixer.conv1d.bias", (p.conv_channels,)) if use_conv_bias
                          else np.zeros(p.conv_channels, np.float32)),
            ssm_dt_b=weight("mixer.dt_bias", (p.n_head,)),
            ssm_a=-np.exp(weight("mixer.A_log", (p.n_head,)).astype(np.float64)),
            ssm_d=weight("mixer.D", (p.n_head,)),
            ssm_norm=weight("mixer.norm.weight", (p.d_inner,)),
            ssm_out=weight("mixer.out_proj.weight", (p.n_embd, p.d_inner)),
        ))
    token_embd, output_norm, output = _head(checkpoint, p.n_vocab, p.n_embd, tied_default=False)
    return _built(checkpoint, Mamba2Model, hparams=p, token_embd=token_embd, layers=layers,
                    output_norm=output_norm, output=output, dtype=dtype, vocab=vocab)
