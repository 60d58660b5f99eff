"""The byte-level Mamba shipped with the package, trained by ``tools/train_byte_mamba.py``.

A Mamba-1 of vocabulary 256 (one token per byte) trained on the Python
standard library's own source; ``byte_mamba.json`` beside the weights records
how (command, split, held-out bits per byte) and keeps the starts of a few
held-out files as prompts.  Loading needs numpy only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from .gguf_io import load_gguf
from .mamba import MambaModel

__all__ = ["TRAINED_GGUF", "trained_model", "training_facts", "held_out_prompts"]

DATA = Path(__file__).resolve().parent / "data"
TRAINED_GGUF = DATA / "byte_mamba.gguf"
"""The shipped byte-level Mamba-1 model's GGUF file, inside the package (``trained_model`` loads it)."""
TRAINING_FACTS = DATA / "byte_mamba.json"


def trained_model(dtype: Any = np.float32) -> MambaModel:
    """The shipped model, computing in ``dtype`` (float32 by default: it was trained in float32)."""
    model = load_gguf(TRAINED_GGUF, dtype=dtype)
    assert isinstance(model, MambaModel), "the shipped file is a Mamba-1 model"
    return model


def training_facts() -> dict[str, Any]:
    """What ``tools/train_byte_mamba.py`` recorded: command, split, held-out bits per byte, prompts."""
    facts: dict[str, Any] = json.loads(TRAINING_FACTS.read_text(encoding="utf-8"))
    return facts


def held_out_prompts() -> list[str]:
    """The starts of held-out standard-library files kept as prompts (text the model never trained on)."""
    return [prompt["text"] for prompt in training_facts()["prompts"]]
