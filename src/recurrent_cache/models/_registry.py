"""The model families the package runs, each registered by its own module.

A family's module (``mamba.py``, ``mamba2.py``) calls ``register`` with a
``Family``: its GGUF architecture name, its Hugging Face class name, and how
to build its model from a GGUF file or a checkpoint and write it back.
``gguf_io.py`` and ``hf.py`` look families up here and hold no list of their
own, so a new family is one new module (imported by ``models/__init__``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ModelError

__all__ = ["Family", "by_gguf_arch", "by_hf_architecture", "families", "of_model", "register"]


@dataclass(frozen=True)
class Family:
    """One architecture: its names, and the code that reads and writes its models."""

    label: str                 # for people: "Mamba-1"
    gguf_arch: str             # GGUF general.architecture, llama.cpp's name: "mamba"
    hf_architecture: str       # config.json's architectures[0]: "MambaForCausalLM"
    model_class: type
    # (checkpoint, dtype, vocab) -> model
    from_hf: Callable[..., Any]
    # (GGUF reader, the sizes every family reads, (token_embd, output_norm, output), dtype, vocab) -> model;
    # None: the package reads no GGUF file of this family (yet)
    from_gguf: Callable[..., Any] | None = None
    # model -> {layer field: (GGUF tensor suffix, shape as stored)}; ModelError when llama.cpp cannot run it
    gguf_layout: Callable[[Any], dict[str, tuple[str, tuple[int, ...]]]] | None = None
    # (gguf.GGUFWriter, model): the family's own keys
    write_gguf_keys: Callable[[Any, Any], None] | None = None
    # True: its reader and writer take every key past the common ones (a hybrid's feed-forward and head
    # counts); False: gguf_io reads and writes the Mamba families' ssm.* sizes (and zero head counts)
    gguf_own_keys: bool = False
    # the GGUF tensor of the final norm (llama.cpp's lfm2 names it token_embd_norm)
    gguf_output_norm: str = "output_norm.weight"


_FAMILIES: list[Family] = []


def register(family: Family) -> Family:
    """Add ``family`` (once per name); returns it.  A second family of a GGUF architecture is another Hugging
    Face class of it (Bamba's files are llama.cpp's ``granitehybrid``, as Granite-4.0-H's): it reads and writes
    no GGUF file of its own, the first family does."""
    twins = [f for f in _FAMILIES if f.gguf_arch == family.gguf_arch]
    if twins and (any(f.hf_architecture == family.hf_architecture for f in twins) or family.from_gguf is not None
                  or family.gguf_layout is not None or family.write_gguf_keys is not None):
        raise ValueError(f"model family {family.gguf_arch!r} is registered twice")
    _FAMILIES.append(family)
    return family


def families() -> tuple[Family, ...]:
    """Every registered family, in registration order."""
    return tuple(_FAMILIES)


def by_gguf_arch(arch: object) -> Family:
    """The family of GGUF architecture ``arch``, or ``ModelError`` naming it and the ones there are."""
    for family in _FAMILIES:
        if family.gguf_arch == arch:
            return family
    known = " and ".join(f"{f.gguf_arch!r} ({f.label})" for f in _FAMILIES)
    raise ModelError(f"architecture {arch!r}; this loader reads {known} models")


def by_hf_architecture(name: object) -> Family | None:
    """The family of a config.json ``architectures`` entry, or None."""
    return next((f for f in _FAMILIES if f.hf_architecture == name), None)


def of_model(model: object) -> Family:
    """The family of ``model``'s class, or of its nearest base class that has one; ``ModelError`` otherwise."""
    for cls in type(model).__mro__:
        for family in _FAMILIES:
            if family.model_class is cls:
                return family
    raise ModelError(f"no registered model family runs {type(model).__name__} "
                     f"(families: {', '.join(f.label for f in _FAMILIES)})")
