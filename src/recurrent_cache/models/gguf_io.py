"""Models in GGUF files, with llama.cpp's keys and tensor names: Mamba-1 (``mamba``), Mamba-2 (``mamba2``) and
the hybrid families that register ``from_gguf`` / ``gguf_layout`` (Jamba: ``jamba``, LFM2: ``lfm2``,
Nemotron-H: ``nemotron_h``, Qwen3-Next: ``qwen3next``).

Each hybrid family reads and writes its own keys (``gguf_own_keys``: ``GGUFReader``'s ``per_layer`` for
llama.cpp's per-layer arrays, ``ssm_sizes`` for a Mamba block's) and names its layers' tensors
(``tensor_suffix``, llama.cpp's names); this module reads and writes what every family shares (the
embedding, the head, the vocabulary, the file itself).

``load_gguf`` needs numpy only (``gguf_file.py`` parses the file) unless a
tensor is quantized; ``write_gguf`` uses the ``gguf`` package, as llama.cpp's
converter does, so llama.cpp loads what it writes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from ..atomic_write import atomic_write
from ..errors import GGUFError, ModelError
from ._registry import Family, by_gguf_arch, of_model
from .gguf_file import FLOAT_TYPES, GGUFFile, TensorInfo
from .language_model import LanguageModel
from .vocab import Vocabulary

__all__ = ["GGUF_MISSING", "GGUFReader", "import_gguf", "layer_layout", "load_gguf", "recurrent_layers",
           "tensor_suffix", "write_gguf", "write_ssm_sizes"]

GGUF_MISSING = ("quantized tensors and writing GGUF files need the gguf package: "
                "pip install 'recurrent_cache[gguf]' (or pip install gguf)")


def import_gguf() -> ModuleType:
    """The ``gguf`` package, or ImportError saying how to install it."""
    try:
        import gguf
    except ImportError as exc:
        raise ImportError(GGUF_MISSING) from exc
    return gguf


def load_gguf(path: str | os.PathLike[str], dtype: Any = np.float64) -> LanguageModel:
    """Load a GGUF file written by llama.cpp's converter (or ``write_gguf``): Mamba-1, Mamba-2 or a hybrid
    family that reads GGUF (Jamba, LFM2, Nemotron-H, Qwen3-Next).

    Reads the ``{arch}.*`` hyper-parameters, llama.cpp's tensor
    names and the vocabulary (``tokenizer.ggml.tokens``; none for a byte-level
    model).  f32, f16, bf16 and f64 tensors need numpy only; quantized tensors
    are dequantized by the ``gguf`` package.  Without ``output.weight`` the
    output is tied to ``token_embd``.  The vocabulary size is ``token_embd``'s
    row count (llama.cpp's converter pads it).

    Any problem — a missing, empty, truncated or corrupt file, another
    architecture, a missing key or tensor, a wrong shape — raises
    ``ModelError`` naming the file and the problem.
    """
    name = os.fspath(path)
    try:
        return _load(GGUFFile(name), dtype)
    except ModelError as exc:
        raise ModelError(f"{name}: {exc}") from None
    except GGUFError as exc:
        raise ModelError(f"{name}: not a valid GGUF file: {exc}") from None
    except OSError as exc:
        raise ModelError(f"{name}: cannot read the file: {exc.strerror or exc}") from None
    except (ValueError, TypeError, OverflowError, MemoryError) as exc:  # e.g. a key of the wrong type
        raise ModelError(f"{name}: not a valid GGUF model file: {exc}") from None


def recurrent_layers(path: str | os.PathLike[str]) -> tuple[int, ...]:
    """The layers of a GGUF model that hold recurrent state: the ``layers`` filter of the
    ``RecurrentCache`` for it (every layer of a Mamba file; a hybrid's Mamba / RWKV layers).

    llama.cpp's hybrids mark an attention layer by a per-layer
    ``{arch}.attention.head_count_kv`` above 0 (qwen3next by its
    ``attention.recurrent_layers`` flags); a layer with 0 (or a file without
    the key: a pure recurrent model) is recurrent when it holds recurrent tensors
    (``blk.{il}.ssm_*``, LFM2's ``blk.{il}.shortconv.*`` or RWKV's
    ``blk.{il}.time_mix_*``): a layer of neither
    kind (Nemotron-H's FFN-only layers) has no state, as in llama.cpp.  Reads the
    header only; a bad file raises ``ModelError`` naming it.
    """
    name = os.fspath(path)
    try:
        file = GGUFFile(name)
        arch = file.fields.get("general.architecture")
        n_layer = GGUFReader(file, str(arch)).key("block_count", int)
        heads_kv = file.fields.get(f"{arch}.attention.head_count_kv", 0)
    except ModelError as exc:
        raise ModelError(f"{name}: {exc}") from None
    except GGUFError as exc:
        raise ModelError(f"{name}: not a valid GGUF file: {exc}") from None
    except OSError as exc:
        raise ModelError(f"{name}: cannot read the file: {exc.strerror or exc}") from None
    per_layer = list(heads_kv) if isinstance(heads_kv, (list, tuple)) else [heads_kv] * n_layer
    if len(per_layer) != n_layer or any(isinstance(h, bool) or not isinstance(h, int) for h in per_layer):
        raise ModelError(f"{name}: GGUF key {arch}.attention.head_count_kv is {heads_kv!r}, not one integer "
                         f"or {n_layer} of them")
    flags = file.fields.get(f"{arch}.attention.recurrent_layers")   # qwen3next's: True on a Gated DeltaNet layer
    if isinstance(flags, list) and len(flags) >= n_layer and all(isinstance(f, bool) for f in flags[:n_layer]):
        per_layer = [0 if flags[il] else 1 for il in range(n_layer)]
    holds_state = set()
    for tensor in file.tensors:
        parts = tensor.split(".", 2)   # blk.{il}.{name}
        if (len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit()
                and parts[2].startswith(("ssm_", "time_mix_", "shortconv."))):
            holds_state.add(int(parts[1]))
    return tuple(il for il in range(n_layer) if per_layer[il] == 0 and il in holds_state)


class GGUFReader:
    """Typed access to one file's keys and tensors, with errors that name them."""

    def __init__(self, file: GGUFFile, arch: str) -> None:
        self.file, self.arch = file, arch

    def key(self, name: str, kind: type, default: Any = None) -> Any:
        full = f"{self.arch}.{name}"
        value = self.file.fields.get(full, default)
        if value is None:
            raise ModelError(f"GGUF key {full} is missing")
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ModelError(f"GGUF key {full} is {value!r}, not an integer")
        if kind is float and not isinstance(value, (int, float)):
            raise ModelError(f"GGUF key {full} is {value!r}, not a number")
        return kind(value)

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        info = self.file.tensors.get(name)
        if info is None:
            raise ModelError(f"tensor {name} is missing")
        values = self.file.floats(info) if info.type_id in FLOAT_TYPES else _dequantized(self.file, info)
        if shape is not None and [d for d in values.shape if d != 1] == [d for d in shape if d != 1]:
            # shapes that differ in unit axes only (an early {d_conv, 1, d_inner} conv weight, Mamba-2's
            # [n_head, 1] ssm_a): anything else is left for the model's shape check to name
            values = values.reshape(shape)
        return values

    def optional_tensor(self, name: str) -> np.ndarray | None:
        return self.tensor(name) if name in self.file.tensors else None

    def has(self, name: str) -> bool:
        """Whether the file holds tensor ``name``."""
        return name in self.file.tensors

    def ssm_sizes(self) -> dict[str, Any]:
        """A Mamba block's sizes (``ssm.conv_kernel``, ``ssm.inner_size``, ``ssm.state_size``), named as the
        hyper-parameters name them (``write_ssm_sizes`` writes them)."""
        return dict(d_conv=self.key("ssm.conv_kernel", int), d_inner=self.key("ssm.inner_size", int),
                    d_state=self.key("ssm.state_size", int))

    def per_layer(self, name: str, n_layer: int) -> tuple[int, ...]:
        """Key ``name`` as one integer per layer: llama.cpp's per-layer arrays (``attention.head_count_kv``)
        hold ``n_layer`` integers >= 0, or one integer for every layer."""
        full = f"{self.arch}.{name}"
        value = self.file.fields.get(full)
        if value is None:
            raise ModelError(f"GGUF key {full} is missing")
        values = list(value) if isinstance(value, (list, tuple)) else [value] * n_layer
        if len(values) != n_layer or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
            raise ModelError(f"GGUF key {full} is {value!r}, not one integer >= 0 or {n_layer} of them")
        return tuple(values)


def _load(file: GGUFFile, dtype: Any) -> LanguageModel:
    arch = file.fields.get("general.architecture")
    family = by_gguf_arch(arch)
    if family.from_gguf is None:
        raise ModelError(f"architecture {arch!r} ({family.label}): this package reads its Hugging Face checkpoints, "
                         "not its GGUF files yet")
    read = GGUFReader(file, str(arch))
    token_embd = read.tensor("token_embd.weight")
    if token_embd.ndim != 2:
        raise ModelError(f"tensor token_embd.weight has shape {token_embd.shape}, not 2-D")
    sizes = dict(n_vocab=int(token_embd.shape[0]), n_embd=read.key("embedding_length", int),
                 n_layer=read.key("block_count", int))
    if not family.gguf_own_keys:
        sizes.update(d_conv=read.key("ssm.conv_kernel", int), d_inner=read.key("ssm.inner_size", int),
                     d_state=read.key("ssm.state_size", int))
    sizes["rms_eps"] = read.key("attention.layer_norm_rms_epsilon", float)
    head = (token_embd, read.tensor(family.gguf_output_norm), read.optional_tensor("output.weight"))
    model: LanguageModel = family.from_gguf(read, sizes, head, dtype, _vocabulary(file))
    return model


def _vocabulary(file: GGUFFile) -> Vocabulary | None:
    """The file's vocabulary: its tokens, or bytes for a token-free ("no_vocab") model of 256 tokens."""
    tokens = file.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        return None  # the model takes a 256-token model as byte-level
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ModelError("GGUF key tokenizer.ggml.tokens is not a list of strings")
    types = file.fields.get("tokenizer.ggml.token_type")
    try:
        eos = file.fields.get("tokenizer.ggml.eos_token_id")
        return Vocabulary.from_gguf_tokens(str(file.fields.get("tokenizer.ggml.model", "gpt2")), tokens, types,
                                           eos if isinstance(eos, int) else None)
    except ValueError as exc:
        raise ModelError(f"vocabulary: {exc}") from None


def _dequantized(file: GGUFFile, info: TensorInfo) -> np.ndarray:
    try:
        gguf = import_gguf()
    except ImportError:
        raise ModelError(f"tensor {info.name} is {info.type_name} (quantized); {GGUF_MISSING}") from None
    try:
        qtype = gguf.GGMLQuantizationType(info.type_id)
        raw = file.raw(info).reshape(int(np.prod(info.shape[:-1], dtype=np.int64)), -1)
        values: np.ndarray = gguf.quants.dequantize(raw, qtype)
    except (NotImplementedError, ValueError) as exc:
        raise ModelError(f"tensor {info.name} has type {info.type_name}: {exc}") from None
    return values.reshape(info.shape)


# Tensors llama.cpp's converter keeps in f32 in an f16 file: every 1-D tensor,
# ssm_conv1d, LFM2's shortconv.conv, ssm_norm and everything not named ".weight" (ssm_a, ssm_d).
def _stays_f32(name: str, array: np.ndarray) -> bool:
    return (array.ndim <= 1 or ".ssm_conv1d." in name or ".shortconv.conv." in name or ".ssm_norm." in name
            or not name.endswith(".weight"))


def write_gguf(model: LanguageModel, path: str | os.PathLike[str], file_type: str = "f32",
               name: str = "recurrent-cache-random-mamba", tokens: Sequence[str] | None = None,
               token_types: Sequence[int] | None = None, tokenizer: str = "gpt2", eos: int | None = None,
               merges: Sequence[str] | None = None) -> None:
    """Write ``model`` as a GGUF file that llama.cpp loads: Mamba-1, Mamba-2 or a hybrid family that writes
    GGUF (Jamba, LFM2, Nemotron-H, Qwen3-Next).

    Keys and tensor names are those of llama.cpp's converter.  ``file_type``
    "f16" stores the 2-D weights in f16 as the converter's ``--outtype f16``
    does (1-D tensors, ``ssm_conv1d``, ``ssm_norm``, ``ssm_a`` and ``ssm_d``
    stay f32).  A tied model gets no ``output.weight``.  Without ``tokens``
    there is no tokenizer (``tokenizer.ggml.model = "no_vocab"``): the model
    takes token ids, or bytes when it has 256 tokens.  ``tokens`` (with
    ``token_types``, the ``eos`` token id and BPE ``merges``) are written as
    ``tokenizer.ggml.*`` of a ``tokenizer`` model, as llama.cpp's converter
    writes them ("gpt2": byte-level BPE pieces).  A model llama.cpp would run
    differently is refused (``ModelError``): a Mamba-2 ``time_step_limit`` that
    clamps (Mamba-2, Nemotron-H), a Jamba whose ``d_inner`` is not ``2 * n_embd``,
    a Qwen3-Next with a dense MLP layer.

    A finite weight beyond the range of the type it is stored in (f16's
    65504) raises ``ModelError`` naming the tensor and the value, before
    anything is written.  The file is written whole or not at all
    (``atomic_write``): a failure part-way leaves what was at ``path``.
    """
    if file_type not in ("f32", "f16"):
        raise ModelError(f"file_type must be 'f32' or 'f16', got {file_type!r}")
    family = of_model(model)
    if family.gguf_layout is None or family.write_gguf_keys is None:
        raise ModelError(f"{family.label}: this package does not write its GGUF files yet")
    layout = family.gguf_layout(model)
    gguf = import_gguf()
    named = {"token_embd.weight": model.token_embd, family.gguf_output_norm: model.output_norm}
    if not model.tied:
        named["output.weight"] = model.output
    for il, layer in enumerate(model.layers):
        # a hybrid's layers are dicts of the fields of their kind; a recurrent model's, dataclasses
        fields = layer if isinstance(layer, dict) else vars(layer)
        for field_name, (suffix, shape) in layout.items():
            if field_name in fields:
                named[f"blk.{il}.{suffix}"] = np.reshape(fields[field_name], shape)
    stored = {tensor_name: _stored(tensor_name, array, np.float32 if file_type == "f32"
                                   or _stays_f32(tensor_name, array) else np.float16)
              for tensor_name, array in named.items()}
    # written whole or not at all: a failure part-way (a full disk) leaves what was at ``path``
    with atomic_write(os.fspath(path)) as temporary:
        _write(gguf, model, temporary, family, family.write_gguf_keys, file_type, stored, name, tokens, token_types,
               tokenizer, eos, merges)


# llama.cpp's tensor names of the attention fields ``_attention.attention`` reads
_ATTENTION_TENSORS = {"wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight",
                      "wo": "attn_output.weight", "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias",
                      "bo": "attn_output.bias", "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight"}
# llama.cpp's tensors without a ".weight" suffix
_BARE_TENSORS = frozenset({"ssm_a", "ssm_d"})


def tensor_suffix(field: str) -> str:
    """The GGUF name (after ``blk.{il}.``) of a hybrid layer's weight field, as llama.cpp names it: the
    field with ``.weight`` (``ssm_in.weight``), a field ending in ``_b`` as a bias (``ssm_dt_b`` ->
    ``ssm_dt.bias``), ``ssm_a`` and ``ssm_d`` bare, attention's ``wq`` .. ``k_norm`` as ``attn_q.weight``
    .. ``attn_k_norm.weight``."""
    if field in _ATTENTION_TENSORS:
        return _ATTENTION_TENSORS[field]
    if field in _BARE_TENSORS:
        return field
    if field.endswith("_b"):
        return f"{field[:-2]}.bias"
    return f"{field}.weight"


def layer_layout(layers: Sequence[dict[str, tuple[int, ...]]]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A hybrid's ``gguf_layout`` from each layer's fields and numpy shapes (``layer_shapes`` of every
    layer), where those shapes are the GGUF file's (ggml's ``ne`` reversed) and the names llama.cpp's
    (``tensor_suffix``).  ``ModelError`` when one field has two shapes in different layers (llama.cpp's
    per-layer widths), which one layout cannot say."""
    layout: dict[str, tuple[str, tuple[int, ...]]] = {}
    for il, shapes in enumerate(layers):
        for field, shape in shapes.items():
            if layout.setdefault(field, (tensor_suffix(field), shape))[1] != shape:
                raise ModelError(f"layer {il}'s {field} is {shape}, another layer's {layout[field][1]}: "
                                 "layers of different widths are not written")
    return layout


def write_ssm_sizes(writer: Any, p: Any) -> None:
    """``ssm.conv_kernel``, ``ssm.inner_size`` and ``ssm.state_size`` of hyper-parameters ``p``
    (``GGUFReader.ssm_sizes`` reads them back)."""
    writer.add_ssm_conv_kernel(p.d_conv)
    writer.add_ssm_inner_size(p.d_inner)
    writer.add_ssm_state_size(p.d_state)


def _stored(tensor_name: str, array: np.ndarray, dtype: type[np.floating[Any]]) -> np.ndarray:
    """``array`` as ``dtype``; ``ModelError`` naming the tensor and the value when a finite value
    is beyond the type's range (it would become infinite)."""
    with np.errstate(over="ignore"):
        converted = np.ascontiguousarray(array, dtype=dtype)
    overflow = np.isinf(converted) & np.isfinite(array)
    if overflow.any():
        index = np.unravel_index(int(np.argmax(overflow)), overflow.shape)
        value = np.asarray(array)[index]
        kind = np.dtype(dtype).name.replace("float", "f")
        hint = "; write the file as f32" if kind == "f16" else ""
        raise ModelError(f"tensor {tensor_name}: value {float(value)!r} at index {tuple(map(int, index))} is beyond "
                         f"{kind}'s range (largest {float(np.finfo(dtype).max)!r}) and would be stored as "
                         f"infinity{hint}")
    return converted


def _write(gguf: ModuleType, model: LanguageModel, path: str, family: Family, family_keys: Callable[[Any, Any], None],
           file_type: str,
           stored: dict[str, np.ndarray], name: str, tokens: Sequence[str] | None, token_types: Sequence[int] | None,
           tokenizer: str, eos: int | None, merges: Sequence[str] | None) -> None:
    """The GGUF file of ``write_gguf`` at ``path``: its keys, then the ``stored`` tensors."""
    p: Any = model.hparams
    writer = gguf.GGUFWriter(path, family.gguf_arch)
    writer.add_name(name)
    writer.add_context_length(2**20)  # the converter's placeholder: a recurrent model has no limit
    writer.add_embedding_length(p.n_embd)
    if not family.gguf_own_keys:
        writer.add_feed_forward_length(0)  # unused, but llama.cpp requires the key
        writer.add_head_count(0)           # likewise
    writer.add_block_count(p.n_layer)
    if not family.gguf_own_keys:
        write_ssm_sizes(writer, p)
    family_keys(writer, model)
    writer.add_vocab_size(p.n_vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if file_type == "f16" else gguf.LlamaFileType.ALL_F32)
    if tokens is None:
        writer.add_tokenizer_model("no_vocab")
    else:
        writer.add_tokenizer_model(tokenizer)
        writer.add_token_list(list(tokens))
        if token_types is not None:
            writer.add_token_types(list(token_types))
        if merges is not None:
            writer.add_token_merges(list(merges))
        if eos is not None:
            writer.add_eos_token_id(eos)

    for tensor_name, array in stored.items():
        writer.add_tensor(tensor_name, array)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
