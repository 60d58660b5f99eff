"""The serving loop every ``demo`` mode shares: clients on the sequence slots of one cache.

Each step is ONE ``init_batch`` built by ``build_batch`` from what every
running client feeds next (a prompt or a chunk of it, its last token, a token
and drafts to verify), split into ubatches of at most ``n_ubatch`` tokens and
run through the model.  A client that has generated ``n_predict`` tokens is
removed (``seq_rm``) and a waiting client takes its slot, so freed cells are
re-used.  The modes differ only in the hooks a ``Server`` subclass overrides:
what a client feeds (``feed``), what its logits mean (``settle``), what
happens when it is admitted (``admit``) or finishes (``finish``).
"""

from __future__ import annotations

import importlib
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

import recurrent_cache as rc

from ..models import RecurrentModel, Sampler
from ..storage import storage_for

__all__ = ["Client", "Feed", "NoProgress", "Progress", "Server", "Stats", "build_batch",
           "new_cache", "progress_bar"]


def new_cache(model: RecurrentModel, n_seq_max: int, dtype: str, n_rollback: int = 0, storage: str = "numpy",
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


def host_logits(logits: Any) -> np.ndarray:
    """Logits as a host numpy array (the torch forward returns a tensor on the cache's device)."""
    if isinstance(logits, np.ndarray):
        return logits
    return np.asarray(logits.detach().cpu().numpy())


@dataclass(eq=False)
class Client:
    """One request: a prompt, and the tokens generated for it so far."""

    number: int
    prompt: list[int]
    n_predict: int
    sampler: Sampler
    tokens: list[int] = field(default_factory=list)   # generated tokens
    last_logits: np.ndarray | None = None             # the logits that gave the last token
    slot: int = -1                                     # its sequence id while it is served
    n_cached: int = 0                                  # tokens whose effect is in its state
    cuts: list[int] = field(default_factory=list)      # where the prefill stops next ([]: at the prompt's end)

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.n_predict

    @property
    def prefilled(self) -> bool:
        """Whether its whole prompt is in its state."""
        return self.n_cached >= len(self.prompt)

    def accept(self, logits: np.ndarray) -> None:
        """Sample the next token from ``logits``."""
        self.last_logits = logits
        self.tokens.append(self.sampler(logits))


@dataclass(frozen=True)
class Feed:
    """What one client puts into a step: ``tokens`` from position ``client.n_cached`` on, and
    which of them need logits ("last", "all" or "none")."""

    client: Client
    tokens: list[int]
    logits: Literal["last", "all", "none"] = "last"


def build_batch(feeds: Sequence[Feed]) -> rc.Batch:
    """The one batch of a step: every feed's tokens at its client's next positions and slot."""
    tokens: list[int] = []
    pos: list[int] = []
    seq_id: list[int] = []
    output: list[bool] = []
    for feed in feeds:
        n, first = len(feed.tokens), feed.client.n_cached
        tokens += feed.tokens
        pos += range(first, first + n)
        seq_id += [feed.client.slot] * n
        output += [True] * n if feed.logits == "all" else [False] * (n - 1) + [feed.logits == "last"]
    return rc.Batch(token=tokens, pos=pos, seq_id=seq_id, logits=output)


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
class Stats:
    """What the serving loop did, and where its time went ("cache" / "model" seconds)."""

    steps: int = 0
    ubatches: int = 0
    prompt_tokens: int = 0     # prompt tokens run through the model
    decode_tokens: int = 0     # generated (and draft) tokens run through the model
    peak_used: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: {"cache": 0.0, "model": 0.0})

    @contextmanager
    def timing(self, what: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[what] += time.perf_counter() - start


class Server:
    """Continuous batching of clients over the sequence slots of one cache.

    ``corrupt_step`` is for testing the verification: after that step, the
    layer-0 SSM state of a running client is overwritten (``corruption`` says
    which), so that every check downstream must fail.
    """

    def __init__(self, model: RecurrentModel, cache: rc.RecurrentCache, n_ubatch: int,
                 progress: Progress | None = None, corrupt_step: int | None = None) -> None:
        self.model = model
        self.cache = cache
        self.n_ubatch = n_ubatch
        self.progress: Progress = NoProgress() if progress is None else progress
        self.free_slots = list(range(cache.n_seq_max))
        self.running: dict[int, Client] = {}
        self.finished: list[Client] = []
        self.stats = Stats()
        self.corrupt_step = corrupt_step
        self.corruption = ""

    # -- the loop -------------------------------------------------------------------------

    def serve(self, clients: Iterable[Client]) -> None:
        """Clients wait in a queue and take free slots as they open, until all are done."""
        waiting = deque(clients)
        while waiting or self.running:
            while waiting and self.free_slots:
                self.admit(waiting.popleft())
            self.step()
            waiting.extend(self.end_step())

    def serve_forks(self, forks: Sequence[Client]) -> None:
        """The first fork runs the prompt; the others ``seq_cp`` its state and continue on their own."""
        root = forks[0]
        self.admit(root)
        self.step()
        for child in forks[1:]:
            self.fork(root, child)
        self.end_step()
        self.serve(())

    def step(self) -> None:
        """One init_batch of every running client's feed, then each client settles its logits."""
        feeds = [self.feed(client) for client in self.running.values()]
        generated = sum(len(client.tokens) for client in self.running.values())
        for feed, rows in zip(feeds, self.run(feeds)):
            self.settle(feed, rows)
        self.stats.steps += 1
        self.progress.update(sum(len(client.tokens) for client in self.running.values()) - generated)

    def run(self, feeds: Sequence[Feed]) -> list[list[np.ndarray]]:
        """Run one batch of ``feeds`` through the cache and the model: per feed, the logits of
        its output tokens in position order."""
        stats, cache = self.stats, self.cache
        feed_of: list[int] = []   # batch index -> feed index
        for k, feed in enumerate(feeds):
            feed_of += [k] * len(feed.tokens)
            if feed.client.prefilled:
                stats.decode_tokens += len(feed.tokens)
            else:
                stats.prompt_tokens += len(feed.tokens)
        with stats.timing("cache"):
            st = cache.init_batch(build_batch(feeds), self.n_ubatch)
        if st.status != rc.MemoryStatus.SUCCESS:
            raise RuntimeError(f"init_batch failed ({st.status.name}) with {len(feeds)} clients "
                               f"on {cache.size} cells")
        logits = []
        more = True
        while more:
            with stats.timing("cache"):
                st.apply()
            stats.peak_used = max(stats.peak_used, cache.used)
            with stats.timing("model"):
                logits.append(host_logits(self.model.forward_ubatch(st)))
            stats.ubatches += 1
            with stats.timing("cache"):
                more = st.next()
        rows: list[list[np.ndarray]] = [[] for _ in feeds]
        # out_ids in increasing batch index: a feed's rows come out in position order
        order = np.argsort(st.out_ids, kind="stable")
        for row, batch_index in zip(np.concatenate(logits)[order], np.asarray(st.out_ids)[order].tolist()):
            rows[feed_of[batch_index]].append(row)
        return rows

    # -- the hooks a mode overrides ---------------------------------------------------------

    def admit(self, client: Client) -> None:
        """Give ``client`` the lowest free slot."""
        client.slot = self.free_slots.pop(0)
        self.running[client.slot] = client

    def feed(self, client: Client) -> Feed:
        """The prompt (up to its next cut), then the last generated token."""
        if not client.prefilled:
            end = client.cuts[0] if client.cuts else len(client.prompt)
            return Feed(client, client.prompt[client.n_cached:end], "last" if end == len(client.prompt) else "none")
        return Feed(client, client.tokens[-1:])

    def settle(self, feed: Feed, rows: list[np.ndarray]) -> None:
        """The fed tokens are in the state; the last output row gives the next token."""
        feed.client.n_cached += len(feed.tokens)
        if rows:
            feed.client.accept(rows[-1])

    def finish(self, client: Client) -> list[Client]:
        """``client`` is done and its sequence removed; the clients that follow from it (none)."""
        return []

    # -- between steps ----------------------------------------------------------------------

    def fork(self, parent: Client, child: Client) -> None:
        """Start ``child`` from ``parent``'s state (``seq_cp``) and its last logits."""
        self.admit(child)
        with self.stats.timing("cache"):
            self.cache.seq_cp(parent.slot, child.slot, -1, -1)
        child.n_cached = parent.n_cached
        assert parent.last_logits is not None, "a parent forks after its prompt"
        child.accept(parent.last_logits)
        self.progress.update(1)

    def end_step(self) -> list[Client]:
        """Remove the finished clients' sequences and free their slots; the clients to queue next."""
        follow_ups = []
        for slot, client in list(self.running.items()):
            if client.done:
                follow_ups += self.finish(client)
                with self.stats.timing("cache"):
                    removed = self.cache.seq_rm(slot, -1, -1)
                if not removed:
                    raise RuntimeError(f"seq_rm({slot}, -1, -1) refused to remove a whole sequence")
                del self.running[slot]
                self.free_slots.append(slot)
                self.finished.append(client)
        self.free_slots.sort()
        if self.stats.steps == self.corrupt_step:
            self.corruption = self.corrupt_state()
        return follow_ups

    def corrupt_state(self) -> str:
        """Reverse the layer-0 SSM state of the first running client (finite values, wrong order)."""
        if not self.running:
            return f"no running client left to corrupt after step {self.stats.steps}"
        client = next(iter(self.running.values()))
        cell = self.cache.cell(client.slot)[2]  # the tail: the cell holding that sequence
        states = self.cache.s[0]
        if states is None:   # a cache whose layer filter leaves layer 0 out
            return f"layer 0 holds no SSM state to corrupt (layers={self.cache.layers})"
        row = states[cell]
        row[...] = row.flip(0) if hasattr(row, "flip") else row[::-1].copy()   # torch has no negative steps
        return f"corrupted the layer-0 SSM state of client {client.number} (cell {cell}) after step {self.stats.steps}"
