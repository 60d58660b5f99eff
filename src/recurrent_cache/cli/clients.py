"""The demo's clients: their prompts and samplers, and how a report shows them.

A client's prompt is the start of a held-out standard-library file or one
written by hand, encoded by the model's vocabulary; a model without one gets
random token ids.  Client ``k`` samples with the seed ``(seed, k)``.
"""

from __future__ import annotations

import numpy as np

from ..models import LanguageModel, Sampler, escape, held_out_prompts
from .serving import Client

__all__ = ["CLIENTS_LISTED", "HANDWRITTEN_PROMPTS", "make_clients", "print_clients", "shown_prompt", "shown_tokens"]

PROMPT_LENGTHS = (4, 48)  # inclusive range of random prompt lengths (a model without a vocabulary)

# Prompts written by hand, served with the starts of held-out standard-library files.
HANDWRITTEN_PROMPTS = (
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n',
    "    for i in range(len(items)):\n",
    "# Copyright (C) 2001 Python Software Foundation\n",
    'def read_config(path):\n    """Return the settings in the file at *path*."""\n',
)

# How many clients a report lists one by one.
CLIENTS_LISTED = 10


def prompt_pool(model: LanguageModel) -> list[list[int]]:
    """The prompts as token ids: hand-written ones and held-out file starts, encoded by the model's
    vocabulary; empty when it has none (the clients then get random token ids)."""
    if model.vocab is None:
        return []
    pool = []
    for text in (*HANDWRITTEN_PROMPTS, *held_out_prompts()):
        try:
            pool.append(model.vocab.encode(text))
        except ValueError:  # a vocabulary without a token for some byte: leave that prompt out
            continue
    return pool


def make_clients(model: LanguageModel, count: int, n_predict: int, temperature: float, top_k: int, seed: int,
                 same_prompt: bool = False) -> list[Client]:
    """``count`` clients in a seeded order of the prompt pool; with ``same_prompt``, all with the first."""
    rng = np.random.default_rng(seed)
    pool = prompt_pool(model)
    order = rng.permutation(len(pool)).tolist()

    def prompt(k: int) -> list[int]:
        if pool:
            return pool[order[k % len(pool)]]
        length = int(rng.integers(PROMPT_LENGTHS[0], PROMPT_LENGTHS[1] + 1))
        ids: list[int] = rng.integers(0, model.hparams.n_vocab, size=length).tolist()
        return ids

    def sampler(k: int) -> Sampler:
        return Sampler(temperature, top_k, (seed, k))

    if same_prompt:
        shared = prompt(0)
        return [Client(k, shared, n_predict, sampler(k)) for k in range(count)]
    return [Client(k, prompt(k), n_predict, sampler(k)) for k in range(count)]


def shown_tokens(model: LanguageModel, tokens: list[int], tail: int | None = None) -> str:
    """Tokens as quoted, escaped text (or their ids when the model has no vocabulary); with
    ``tail``, only the last ``tail`` bytes after "..." (cut before escaping, so no escape is cut)."""
    if model.vocab is None:
        return " ".join(map(str, tokens[:12])) + (" ..." if len(tokens) > 12 else "")
    data = model.vocab.decode(tokens)
    cut = tail is not None and len(data) > tail
    text = escape(data[-tail:] if cut and tail is not None else data).replace('"', '\\"')
    return f'"{"..." if cut else ""}{text}"'


def shown_prompt(model: LanguageModel, prompt: list[int], tail: int = 28) -> str:
    """The end of a prompt, where the generated text continues it."""
    return "" if model.vocab is None else shown_tokens(model, prompt, tail)


def print_clients(model: LanguageModel, clients: list[Client], samplers: bool) -> None:
    """The report's lines of the first ``CLIENTS_LISTED`` clients: the end of the prompt, what the
    client generated, and (with ``samplers``) how it sampled."""
    for client in clients[:CLIENTS_LISTED]:
        sampling = f"  [{client.sampler}]" if samplers else ""
        print(f"  client {client.number:<3} prompt {len(client.prompt):>3} tokens {shown_prompt(model, client.prompt)}"
              f" -> {shown_tokens(model, client.tokens)}{sampling}")
    if len(clients) > CLIENTS_LISTED:
        print(f"  ... and {len(clients) - CLIENTS_LISTED} more")
