"""The demo's clients served by the package's generation loop (``recurrent_cache.generation``).

Every ``demo`` mode and ``generate`` hand their requests to one ``Generator``:
it runs each step as ONE ``init_batch`` of every running request's tokens,
removes a finished request's sequence (``seq_rm``) and admits a waiting one
into it.  What is left here is the demo's own: its clients (a number, a
prompt, a sampler) and what they got, a progress bar, the cache a command asks
for, follow-up requests (the next turn of a conversation), and the testing
hook that corrupts a live state so that the verification must fail.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

import recurrent_cache as rc

from ..generation import Generator, Request
from ..models import LanguageModel, Sampler
from ..storage import storage_for

__all__ = ["Client", "NoProgress", "Progress", "Served", "new_cache", "progress_bar", "serve"]


def new_cache(model: LanguageModel, n_seq_max: int, dtype: str, n_rollback: int = 0, storage: str = "numpy",
              device: str | None = None) -> rc.RecurrentCache:
    """A cache of ``n_seq_max`` cells for ``model`` in ``storage`` (on ``device``); ``ConfigError``
    (saying which and why) when it cannot be had.

    The storage comes first, so that a storage that cannot be had (torch missing, a device torch
    cannot serve) says so in its own words, not as cells that cannot be allocated."""
    where = storage_for(storage, device)
    try:
        cache: rc.RecurrentCache = model.new_cache(n_seq_max=n_seq_max, dtype=dtype, n_rollback=n_rollback,
                                                   storage=where)
    except (MemoryError, rc.RecurrentCacheError) as exc:
        rollback = f" with n_rollback {n_rollback}" if n_rollback else ""
        raise rc.ConfigError(f"cannot allocate {n_seq_max} state cells{rollback} for this model: {exc}") from exc
    return cache


@dataclass(eq=False)
class Client:
    """One request of the demo: a prompt, and the tokens generated for it."""

    number: int
    prompt: list[int]
    n_predict: int
    sampler: Sampler
    tokens: list[int] = field(default_factory=list)   # generated tokens
    last_logits: np.ndarray | None = None             # the logits that gave the last token
    restored: int = 0                                  # prompt tokens a prefix cache restored


class Progress(Protocol):
    """What the loop needs of a progress bar (tqdm's ``update`` and ``close``)."""

    def update(self, n: int) -> object: ...

    def close(self) -> None: ...


class NoProgress:
    """Stands in for a tqdm bar when there is none to show."""

    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, quiet: bool) -> Progress:
    """A tqdm bar on stderr when it is a terminal (tqdm is optional)."""
    if quiet or not sys.stderr.isatty():
        return NoProgress()
    try:
        tqdm = importlib.import_module("tqdm")   # optional, and without type stubs
    except ImportError:
        return NoProgress()
    bar: Progress = tqdm.tqdm(total=total, unit="tok", desc="generating", file=sys.stderr, leave=False)
    return bar


@dataclass
class Served:
    """What ``serve`` did: the clients in the order they finished, and the corruption it made ("" if none)."""

    finished: list[Client] = field(default_factory=list)
    corruption: str = ""


def serve(generator: Generator, clients: Iterable[Client], progress: Progress | None = None,
          corrupt_step: int | None = None, fork: bool = False,
          follow_up: Callable[[Client], Client | None] | None = None) -> Served:
    """Serve ``clients`` through ``generator`` until all are done (each with its own sampler, no stop
    token: ``n_predict`` tokens each).  ``fork``: the first client's prompt runs once and the others
    fork it (``seq_cp``), each sampling with its own seed.  ``follow_up``: the client to queue when
    one finishes (None: none).  ``corrupt_step``: after that step, a running client's state is
    overwritten (``corrupt_state``)."""
    progress = NoProgress() if progress is None else progress
    served = Served()
    client_of: dict[int, Client] = {}

    def submit(client: Client) -> Request:
        s = client.sampler
        request = generator.submit(client.prompt, max_new_tokens=client.n_predict, temperature=s.temperature,
                                   top_k=s.top_k, top_p=s.top_p, seed=s.seed, stop_tokens=[])
        client_of[request.id] = client
        return request

    queue = list(clients)
    if fork:
        root = submit(queue[0])
        for client, child in zip(queue[1:], generator.fork(root, len(queue) - 1,
                                                             seeds=[c.sampler.seed for c in queue[1:]])):
            client_of[child.id] = client
    else:
        for client in queue:
            submit(client)
    while not generator.done:
        for event in generator.step():
            client = client_of[event.request.id]
            client.tokens, client.last_logits = list(event.request.tokens), event.request.last_logits
            client.restored = event.request.restored
            progress.update(len(event.tokens))
            if event.finished:
                served.finished.append(client)
                following = follow_up(client) if follow_up is not None else None
                if following is not None:
                    submit(following)
        if generator.stats.steps == corrupt_step and not served.corruption:
            served.corruption = corrupt_state(generator, client_of)
    return served


def corrupt_state(generator: Generator, client_of: dict[int, Client]) -> str:
    """Reverse the layer-0 SSM state of the first running request (finite values, wrong order)."""
    steps = generator.stats.steps
    if not generator.running:
        return f"no running client left to corrupt after step {steps}"
    request = generator.running[0]
    cache = generator.cache
    cell = cache.cell(request.seq)[2]  # the tail: the cell holding that sequence
    states = cache.s[0]
    if states is None:   # a cache whose layer filter leaves layer 0 out
        return f"layer 0 holds no SSM state to corrupt (layers={cache.layers})"
    row = states[cell]
    row[...] = row.flip(0) if hasattr(row, "flip") else row[::-1].copy()   # torch has no negative steps
    return (f"corrupted the layer-0 SSM state of client {client_of[request.id].number} (cell {cell}) "
            f"after step {steps}")
