"""The model a subcommand runs: ``--model``, ``--random-weights``, ``--compute``, read in one place.

``build_model`` turns the options into a model; a model file is read by
``_load_model`` alone, so a new kind of model file is a change of one line.
``model_identity`` names the model for a shared state store.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from typing import Any

import numpy as np

from ..models import LanguageModel, Mamba2Model, MambaModel, load_model, random_model, trained_model
from ..models._arrays import layer_arrays
from .options import text

__all__ = ["COMPUTE_DTYPES", "add_model_options", "add_storage_options", "build_model", "model_identity",
           "model_name", "storage_refusal", "where_states_live"]

COMPUTE_DTYPES: dict[str, type[np.floating[Any]]] = {"f32": np.float32, "f64": np.float64}


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """``--model`` / ``--random-weights`` (one or the other) and ``--compute``."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", metavar="GGUF|DIR", type=text("model path"),
                        help="a GGUF file or Hugging Face checkpoint directory: Mamba-1/2 or a hybrid (Jamba, "
                             "LFM2, Granite-4.0-H, Falcon-H1, Qwen3-Next, Nemotron-H) (default: the shipped "
                             "byte-level model)")
    source.add_argument("--random-weights", action="store_true", help="a random model instead, seeded by --seed")
    parser.add_argument("--compute", choices=sorted(COMPUTE_DTYPES), default="f32",
                        help="model arithmetic (default f32, as the model was trained)")


def add_storage_options(parser: argparse.ArgumentParser) -> None:
    """``--storage`` and ``--device``: where the states live and the model runs."""
    parser.add_argument("--storage", choices=["numpy", "torch"],
                        help="where the states live and the model runs: numpy (default) or torch, whose run "
                             "is verified against the numpy forward (needs recurrent_cache[torch])")
    parser.add_argument("--device", type=text("device"),
                        help="the torch device (cpu, cuda, cuda:1, mps; default cpu); needs --storage torch")


def storage_refusal(options: argparse.Namespace) -> str:
    """Why the storage options cannot be served together ("" when they can)."""
    if options.device is not None and options.storage != "torch":
        return f"--device {options.device} needs --storage torch (numpy states live in host memory)"
    return ""


def where_states_live(options: argparse.Namespace) -> str:
    """How the reports name the storage: "" for numpy, else " on torch cpu" and the like."""
    return "" if options.storage == "numpy" else f" on torch {options.device or 'cpu'}"


def build_model(options: argparse.Namespace) -> LanguageModel:
    """The model the options name: ``--model``, ``--random-weights`` (seeded by ``--seed``) or
    the shipped one, computing in ``--compute``.  Raises ``ModelError`` (or ``ImportError``)."""
    dtype = COMPUTE_DTYPES[options.compute]
    if options.model:
        return _load_model(options.model, dtype)
    if options.random_weights:
        return random_model(options.seed, dtype=dtype)
    return trained_model(dtype=dtype)


def _load_model(path: str, dtype: type[np.floating[Any]]) -> LanguageModel:
    """The model at ``path`` (a GGUF file or a checkpoint directory): the one place the
    command line reads a model."""
    return load_model(path, dtype=dtype)


def model_name(options: argparse.Namespace) -> str:
    """Which model the options chose, as the reports name it."""
    if options.model:
        return str(options.model)
    if options.random_weights:
        return f"random weights, seed {options.seed}"
    return "the shipped byte-level model, trained on the standard library"


def model_identity(options: argparse.Namespace, model: LanguageModel) -> str:
    """The store namespace: what the states depend on besides the tokens and the cache geometry.

    The sha256 of the GGUF file, or (a checkpoint directory, random or built-in weights) of the weights
    themselves; and the arithmetic, which changes the states too.  Raises
    ``OSError`` when the model file cannot be read.
    """
    digest = hashlib.sha256()
    if options.model and os.path.isfile(options.model):
        with open(options.model, "rb") as file:
            for chunk in iter(lambda: file.read(1 << 20), b""):
                digest.update(chunk)
        source = "gguf"
    else:
        for layer in model.layers:
            for weights in layer_arrays(layer).values():
                digest.update(np.ascontiguousarray(weights).tobytes())
        for weights in (model.token_embd, model.output_norm, model.output):
            digest.update(np.ascontiguousarray(weights).tobytes())
        source = "weights"
    architecture = ("mamba2" if isinstance(model, Mamba2Model) else "mamba1" if isinstance(model, MambaModel)
                    else type(model).__name__)
    return f"{architecture} {source}-sha256 {digest.hexdigest()} compute {options.compute}"
