"""One public generation loop: requests in, tokens out, continuous batching over one cache.

``Generator`` serves requests (token ids, or text through ``model.vocab``) on the sequences of one
cache, for any model of the package through its public interface only — ``model.new_cache``,
``cache.init_batch``, ``model.forward(st)`` and the cache's sequence API (``seq_rm``, ``seq_cp``) —
so a ``RecurrentCache`` and a hybrid model's ``HybridCache`` run through it alike.  Each ``step()``
is ONE ``init_batch``: every running request's decode token (with its drafts, when speculating) and
chunks of the prompts being prefilled, within ``n_batch`` tokens, the decode tokens first so that a
long prompt never starves the others.  A request waits in a queue until a sequence is free; a
finished one gives its sequence back (``seq_rm``) to the next.

The guarantees (docs/generation.md, tests/generation/): every request produces the tokens it would
produce alone — whatever the batching, the admission order, the chunking, the forks, the
speculation or the prefix reuse — because a sequence's state depends only on its own tokens and
each request samples from its own seeded ``Sampler``.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from . import _args
from .batch import Batch
from .cache import RecurrentCache
from .errors import ArgumentError, ConfigError, CoreError, NoFreeCellError
from .hybrid import HybridCache
from .hybrid_prefix import HybridPrefixCache
from .memory_state import MemoryStatus
from .models.sampling import Sampler
from .prefix_cache import PrefixCache

__all__ = ["DEFAULT_PREFIX_BYTES", "DraftModel", "Event", "Generator", "Request", "Stats", "batch_of", "host_logits",
           "prompt_lookup"]

POS_END = 2**31 - 1          # positions are int32 and this one means "to the end"
DEFAULT_PREFIX_BYTES = 64 << 20   # the PrefixCache a store gets when no prefix_cache is given
NGRAMS = (3, 2, 1)           # the suffix lengths prompt lookup tries, longest first

FinishReason = Literal["length", "stop", "cancelled"]
DraftSource = Callable[[Sequence[int], int], Sequence[int]]


def host_logits(logits: Any) -> np.ndarray:
    """Logits as a host numpy array (a torch forward returns a tensor on the cache's device): one
    transfer."""
    if isinstance(logits, np.ndarray):
        return logits
    return np.asarray(logits.detach().cpu().numpy())


def prompt_lookup(history: Sequence[int], k: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix
    n-gram of ``history`` (prompt lookup decoding: drafts without a second model); [] when none."""
    history = list(history)
    for n in NGRAMS:
        if len(history) <= n:
            continue
        suffix = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == suffix:
                return history[start + n:start + n + k]
    return []


def batch_of(parts: Sequence[tuple[Sequence[int], int, int, list[bool]]]) -> Batch:
    """One batch of ``(tokens, first position, seq, which tokens give logits)`` parts, in order."""
    tokens: list[int] = []
    pos: list[int] = []
    seq_id: list[int] = []
    output: list[bool] = []
    for new, first, seq, logits in parts:
        tokens += new
        pos += range(first, first + len(new))
        seq_id += [seq] * len(new)
        output += logits
    return Batch(token=tokens, pos=pos, seq_id=seq_id, logits=output)


@dataclass(eq=False)
class Request:
    """One request, its handle: what it asked for and what it has produced so far.

    ``tokens`` are the generated tokens; ``history`` the prompt and them; ``last_logits`` the
    logits that gave the last token; ``restored`` how many prompt tokens a prefix cache gave it
    instead of computing them; ``seq`` its sequence while it runs (-1 otherwise).
    """

    id: int
    prompt: list[int]
    max_new_tokens: int
    sampler: Sampler
    stop_tokens: frozenset[int] = frozenset()
    stop_strings: tuple[bytes, ...] = ()
    tokens: list[int] = field(default_factory=list)
    last_logits: np.ndarray | None = None
    restored: int = 0
    seq: int = -1
    finish_reason: FinishReason | None = None
    forks: list[Request] = field(default_factory=list)   # its forks (``n`` > 1, ``Generator.fork``)
    pending: list[Request] = field(default_factory=list)  # forks that start at its prompt's end
    n_cached: int = 0                                    # tokens of history whose effect is in its state
    cuts: list[int] = field(default_factory=list)        # prompt lengths to stop (and save) at
    text: bytearray = field(default_factory=bytearray)   # the generated text, kept to find stop strings

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def history(self) -> list[int]:
        return self.prompt + self.tokens

    @property
    def prefilled(self) -> bool:
        """Whether its whole prompt is in its state."""
        return self.n_cached >= len(self.prompt)


@dataclass(frozen=True)
class Event:
    """What one step did for one request: the tokens it added, and whether (and why) it finished."""

    request: Request
    tokens: tuple[int, ...]
    finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Stats:
    """What the generator did, and where its time went (``seconds``: "cache" for ``init_batch`` and
    sequence operations, "model" for ``model.forward``, which applies each ubatch)."""

    steps: int = 0
    ubatches: int = 0
    prompt_tokens: int = 0        # prompt tokens run through the model
    decode_tokens: int = 0        # generated and draft tokens run through the model
    restored_tokens: int = 0      # prompt tokens a prefix cache gave instead
    peak_sequences: int = 0       # most sequences held at once
    drafted: int = 0              # draft tokens proposed
    accepted: int = 0             # draft tokens the model agreed with
    rollbacks: int = 0            # seq_rm calls that rolled rejected drafts back
    verify_steps: int = 0         # steps that verified drafts
    seconds: dict[str, float] = field(default_factory=lambda: {"cache": 0.0, "model": 0.0})

    @contextmanager
    def timing(self, what: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[what] += time.perf_counter() - start


@dataclass(frozen=True)
class _Feed:
    """What one request puts into a step: ``tokens`` from position ``request.n_cached`` on; with
    ``every_logit`` each of them gives logits (drafts to verify), else only the last one when
    ``last_logit``."""

    request: Request
    tokens: list[int]
    last_logit: bool = True
    every_logit: bool = False


class DraftModel:
    """A small model that drafts for a bigger one: each running request's history is run through
    ``model`` on a cache of its own (one sequence per generator sequence, ``n_rollback`` = the
    draft length) and continued greedily.  Its rejected drafts are rolled back next time, so a
    request's history is computed once.  Give it to ``Generator(draft=...)``."""

    def __init__(self, model: Any, n_ubatch: int = 64, **cache_options: Any) -> None:
        self.model = model
        self.n_ubatch = _args.count(n_ubatch, "n_ubatch", 1, ConfigError)
        self.cache_options = cache_options
        self.cache: Any = None
        self.fed: dict[int, list[int]] = {}

    def prepare(self, n_seq_max: int, n_draft: int) -> None:
        """Its cache, for ``n_seq_max`` sequences and drafts of up to ``n_draft`` tokens."""
        self.cache = self.model.new_cache(n_seq_max=n_seq_max, n_rollback=n_draft, **self.cache_options)
        self.fed = {}

    def release(self, seq: int) -> None:
        """``seq``'s request is done: forget its history."""
        if self.fed.pop(seq, None) is not None:
            self.cache.seq_rm(seq, -1, -1)

    def propose(self, histories: Mapping[int, Sequence[int]], room: Mapping[int, int]) -> dict[int, list[int]]:
        """Per sequence, ``room[seq]`` greedy tokens continuing ``histories[seq]``: all sequences in
        one batch per draft token."""
        new: dict[int, list[int]] = {}
        for seq, history in histories.items():
            new[seq] = self.catch_up(seq, list(history))
        drafts: dict[int, list[int]] = {seq: [] for seq in histories}
        while new:
            logits = self.run(new)
            for seq, row in zip(new, logits):
                drafts[seq].append(int(np.argmax(row)))
                self.fed[seq] += new[seq]
            new = {seq: drafts[seq][-1:] for seq in new if len(drafts[seq]) < room[seq]}
        return drafts

    def catch_up(self, seq: int, history: list[int]) -> list[int]:
        """Roll ``seq`` back to where its fed tokens and ``history`` agree (or clear it): the tokens
        of ``history`` still to feed, at least the last one (it gives the first draft's logits)."""
        fed = self.fed.get(seq, [])
        common = next((i for i, (a, b) in enumerate(zip(fed, history)) if a != b), min(len(fed), len(history)))
        common = min(common, len(history) - 1)
        if common < len(fed) and not self.cache.seq_rm(seq, common, -1):
            common = 0   # beyond its rollback history: start the sequence again
        if common == 0:
            self.cache.seq_rm(seq, -1, -1)
        self.fed[seq] = history[:common]
        return history[common:]

    def run(self, feeds: Mapping[int, list[int]]) -> np.ndarray:
        """One batch of every sequence's tokens: the logits after each one's last token, in feed order."""
        batch = batch_of([(new, len(self.fed[seq]), seq, [False] * (len(new) - 1) + [True])
                          for seq, new in feeds.items()])
        st = self.cache.init_batch(batch, self.n_ubatch)
        if st.status != MemoryStatus.SUCCESS:
            raise ConfigError(f"the draft model's cache cannot take a batch of {batch.n_tokens} tokens "
                              f"({st.status.name})")
        rows = host_logits(self.model.forward(st))
        return rows[np.argsort(st.out_ids)]   # one output per feed: by batch index is in feed order


class Generator:
    """Continuous batching of requests over the sequences of ``cache`` (or a new one from
    ``model.new_cache``).

    ``n_seq_max``: how many requests run at once (at most the cache's); ``n_ubatch``: most tokens
    per ubatch; ``n_batch``: most tokens per step (prompts are chunked to fit after the decode
    tokens).  ``prefix_cache``: a ``PrefixCache`` or ``HybridPrefixCache`` whose longest held prefix
    of each prompt is restored instead of computed, and which saves the states it plans (and each
    finished request's history); ``store`` (with ``namespace``, the model's identity): a shared
    state store behind a ``PrefixCache`` made here.  ``draft``: speculative decoding — a callable
    ``(history, k) -> up to k tokens`` (``prompt_lookup``) or a ``DraftModel`` — whose drafts of up
    to ``n_draft`` tokens the model verifies in one step, the rejected ones rolled back
    (``seq_rm(seq, p0, -1)``: the cache needs ``n_rollback >= n_draft``).

    The generator owns sequences ``0 .. n_seq_max - 1`` of the cache: it clears each before a
    request takes it.  One thread drives it, as one drives a cache.
    """

    def __init__(self, model: Any, cache: Any = None, *, n_seq_max: int | None = None, n_ubatch: int = 64,
                 n_batch: int = 2048, prefix_cache: Any = None, store: Any = None, namespace: str = "",
                 draft: DraftSource | DraftModel | None = None, n_draft: int = 0, **cache_options: Any) -> None:
        n_ubatch = _args.count(n_ubatch, "n_ubatch", 1, ConfigError)
        n_batch = _args.count(n_batch, "n_batch", 1, ConfigError)
        n_draft = _args.count(n_draft, "n_draft", 0, ConfigError)
        if (draft is None) != (n_draft == 0):
            raise ConfigError(f"speculative decoding takes a draft source and n_draft >= 1, got draft={draft!r} "
                              f"and n_draft={n_draft}")
        if draft is not None and not isinstance(draft, DraftModel) and not callable(draft):
            raise ConfigError(f"draft must be a DraftModel or a callable (history, k) -> tokens, got "
                              f"{type(draft).__name__}")
        if prefix_cache is not None and store is not None:
            raise ConfigError("give the store to the prefix cache you pass (PrefixCache(..., store=...)), "
                              "or pass only the store")
        if cache is None:
            wanted = 1 if n_seq_max is None else _args.count(n_seq_max, "n_seq_max", 1, ConfigError)
            cache = model.new_cache(n_seq_max=wanted, n_rollback=n_draft, **cache_options)
        elif cache_options:
            raise ConfigError(f"cache options {sorted(cache_options)} are for a cache made here; this one is made")
        if not isinstance(cache, (RecurrentCache, HybridCache)):
            raise ConfigError(f"cache must be a RecurrentCache or a HybridCache, got {type(cache).__name__}")
        if prefix_cache is not None:
            if not isinstance(prefix_cache, (PrefixCache, HybridPrefixCache)):
                raise ConfigError(f"prefix_cache must be a PrefixCache or a HybridPrefixCache, got "
                                  f"{type(prefix_cache).__name__}")
            if prefix_cache.cache is not cache:   # it would restore into, and save from, another memory
                raise ConfigError("prefix_cache keeps the states of another cache than this generator's")
        n_seq_max = cache.n_seq_max if n_seq_max is None else _args.count(n_seq_max, "n_seq_max", 1, ConfigError)
        if n_seq_max > cache.n_seq_max:
            raise ConfigError(f"n_seq_max {n_seq_max} is more than the cache's {cache.n_seq_max} sequences")
        if n_draft > cache.n_rollback:
            raise ConfigError(f"drafts of {n_draft} tokens need a cache with n_rollback >= {n_draft}, "
                              f"this one has {cache.n_rollback}")
        if store is not None:
            prefix_cache = PrefixCache(cache, DEFAULT_PREFIX_BYTES, store=store, namespace=namespace)
        if isinstance(draft, DraftModel):
            draft.prepare(n_seq_max, n_draft)
        self.model, self.cache = model, cache
        self.n_seq_max, self.n_ubatch, self.n_batch = n_seq_max, n_ubatch, n_batch
        self.prefix_cache = prefix_cache
        self.draft, self.n_draft = draft, n_draft
        self.n_vocab: int = model.hparams.n_vocab
        self.vocab = getattr(model, "vocab", None)
        # a hybrid cache holds a token's K and V in one of kv_size cells: a sequence is at most that long
        self.kv_size: int | None = getattr(cache, "kv_size", None)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_seqs = list(range(n_seq_max))
        self.stats = Stats()
        self.ids = itertools.count()
        self.unreported: list[Event] = []   # events of forks started between steps

    # -- requests -------------------------------------------------------------------------------

    def submit(self, prompt: str | bytes | Sequence[int], *, max_new_tokens: int = 16, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: Any = 0, stop: Sequence[str | bytes] = (),
               stop_tokens: Sequence[int] | None = None, n: int = 1) -> Request:
        """Queue a request; its handle.  ``prompt``: token ids, or text the model's vocabulary
        encodes.  Sampling: greedy at ``temperature`` 0, else a seeded draw from the ``top_k`` most
        likely tokens (0: all) within ``top_p`` of the probability.  It stops after
        ``max_new_tokens`` ("length") or at a token of ``stop_tokens`` (default: the vocabulary's
        end-of-text token) or once its text contains a string of ``stop`` ("stop"), keeping the
        token that stopped it.  ``n`` > 1: ``n - 1`` forks share the prompt's state
        (``request.forks``, seeds ``(seed, 1)`` ...).  Bad input raises ``ArgumentError`` naming the
        value, queueing nothing."""
        request = self.request(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop, stop_tokens)
        n = _args.count(n, "n", 1)
        if n > self.n_seq_max:
            raise ArgumentError(f"n = {n} samples need as many sequences; the generator runs {self.n_seq_max}")
        request.forks = [self.child(request, (seed, k)) for k in range(1, n)]
        request.pending = list(request.forks)
        if self.kv_size is not None and self.cells_needed(request) > self.kv_size:
            raise ArgumentError(f"{n} samples of {len(request.prompt) + max_new_tokens} tokens may need "
                                f"{self.cells_needed(request)} KV cells; the cache has {self.kv_size}")
        self.waiting.append(request)
        return request

    def request(self, prompt: str | bytes | Sequence[int], max_new_tokens: int, temperature: float, top_k: int,
                top_p: float, seed: Any, stop: Sequence[str | bytes], stop_tokens: Sequence[int] | None) -> Request:
        """A request checked whole (``ArgumentError`` naming the bad value), not queued."""
        ids = self.encoded(prompt)
        max_new_tokens = _args.count(max_new_tokens, "max_new_tokens", 0)
        longest = (self.kv_size if self.kv_size is not None else POS_END) - self.n_draft
        if len(ids) + max_new_tokens > longest:
            where = f"the cache's {self.kv_size} KV cells" if self.kv_size is not None else "int32 positions"
            draft = f" with room for {self.n_draft} drafts" if self.n_draft else ""
            raise ArgumentError(f"a prompt of {len(ids)} tokens and max_new_tokens {max_new_tokens} make a sequence "
                                f"longer than {where} allow{draft} ({longest} tokens)")
        try:
            sampler = Sampler(temperature, top_k, seed, top_p)
        except (ValueError, TypeError) as exc:   # numpy's words for a seed it cannot take (TypeError)
            raise ArgumentError(f"seed {seed!r}: {exc}" if isinstance(exc, TypeError) else str(exc)) from None
        if not isinstance(stop, (str, bytes, Sequence)):
            raise ArgumentError(f"stop must be a string or a sequence of strings, got {type(stop).__name__}")
        strings = tuple(s.encode() if isinstance(s, str) else s for s in ([stop] if isinstance(stop, (str, bytes))
                                                                          else stop))
        if any(not isinstance(s, bytes) or not s for s in strings):
            raise ArgumentError(f"stop strings must be non-empty str or bytes, got {stop!r}")
        if strings and self.vocab is None:
            raise ArgumentError(f"stop strings {stop!r} need a model with a vocabulary: this one has none "
                                "(use stop_tokens)")
        eos = getattr(self.vocab, "eos", None)
        stops = ([] if eos is None else [eos]) if stop_tokens is None else list(self.checked_ids(stop_tokens,
                                                                                                   "stop_tokens"))
        return Request(next(self.ids), ids, max_new_tokens, sampler, frozenset(stops), strings)

    def encoded(self, prompt: str | bytes | Sequence[int]) -> list[int]:
        """The prompt as checked token ids."""
        if isinstance(prompt, (str, bytes)):
            if self.vocab is None:
                raise ArgumentError(f"the prompt {prompt[:40]!r} is text, and this model has no vocabulary: "
                                    "give token ids")
            try:
                ids: list[int] = list(self.vocab.encode(prompt))
            except ValueError as exc:
                raise ArgumentError(f"the prompt {prompt[:40]!r} cannot be encoded: {exc}") from None
        else:
            ids = self.checked_ids(prompt, "prompt")
        if not ids:
            raise ArgumentError("the prompt is empty: a request needs at least one token")
        return ids

    def checked_ids(self, values: Sequence[int], name: str) -> list[int]:
        """``values`` as token ids of the model's vocabulary, or ``ArgumentError`` naming the first
        outside it."""
        ids: list[int] = _args.int_array(values, name, np.dtype(np.int64)).tolist()
        outside = [token for token in ids if not 0 <= token < self.n_vocab]
        if outside:
            raise ArgumentError(f"{name}: token {outside[0]} is outside the model's vocabulary "
                                f"(ids 0 to {self.n_vocab - 1})")
        return ids

    def child(self, parent: Request, seed: Any) -> Request:
        """A fork of ``parent``: its settings, its own seed, and the prompt its state will hold."""
        s = parent.sampler
        return Request(next(self.ids), parent.history[:max(len(parent.prompt), len(parent.history) - 1)],
                       parent.max_new_tokens, Sampler(s.temperature, s.top_k, seed, s.top_p), parent.stop_tokens,
                       parent.stop_strings)

    def fork(self, parent: Request, n: int, seeds: Sequence[Any] | None = None) -> list[Request]:
        """``n`` requests continuing ``parent`` from where it is: they share its state (``seq_cp``)
        and resample its last token, each with its own seed (``seeds``, default ``(parent's seed,
        k)``).  Forks of a request still waiting or in its prompt start at its prompt's end.
        ``NoFreeCellError`` when there are not ``n`` free sequences for a running parent."""
        if not isinstance(parent, Request):
            raise ArgumentError(f"fork takes a Request of this generator, got {type(parent).__name__}")
        n = _args.count(n, "n", 1)
        seeds = [(parent.sampler.seed, len(parent.forks) + k + 1) for k in range(n)] if seeds is None else list(seeds)
        if len(seeds) != n:
            raise ArgumentError(f"{len(seeds)} seeds for {n} forks")
        if parent.finished:
            raise ArgumentError(f"request {parent.id} has finished ({parent.finish_reason}): it has no state to fork")
        children = [self.child(parent, seed) for seed in seeds]
        cells = sum(map(self.cells_needed, children))
        if parent in self.waiting:
            if len(parent.pending) + 1 + n > self.n_seq_max:
                raise ArgumentError(f"{len(parent.pending) + 1 + n} samples of request {parent.id} need as many "
                                    f"sequences; the generator runs {self.n_seq_max}")
            if self.kv_size is not None and self.cells_needed(parent) + cells > self.kv_size:
                raise ArgumentError(f"request {parent.id} and {len(parent.pending) + n} forks may need "
                                    f"{self.cells_needed(parent) + cells} KV cells; the cache has {self.kv_size}")
            parent.forks += children
            parent.pending += children
            return children
        if parent not in self.running:
            raise ArgumentError(f"request {parent.id} is not one of this generator's")
        if n > len(self.free_seqs):
            raise NoFreeCellError(f"{n} forks of request {parent.id} need {n} free sequences; "
                                  f"{len(self.free_seqs)} are free")
        if self.kv_size is not None and sum(map(self.cells_needed, self.running)) + cells > self.kv_size:
            raise NoFreeCellError(f"{n} forks of request {parent.id} may need {cells} more KV cells than the "
                                  f"running requests hold; the cache has {self.kv_size}")
        for child in children:
            child.seq = self.free_seqs.pop(0)
        parent.forks += children
        if parent.prefilled:   # their first tokens, sampled now, are the next step's first events
            self.start_forks(parent, children, self.unreported)
        else:
            parent.pending += children     # their sequences are reserved: they join at the prompt's end
        return children

    def cancel(self, request: Request) -> None:
        """Stop ``request`` (waiting or running) and free its sequence; finished requests are left."""
        if request in self.waiting:
            self.waiting.remove(request)
            for r in [request, *request.pending]:
                r.finish_reason = "cancelled"
            request.pending = []
        elif request in self.running:
            self.release(request, "cancelled")

    # -- the loop -------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """Whether no request waits or runs and every event has been returned."""
        return not self.waiting and not self.running and not self.unreported

    def step(self) -> list[Event]:
        """One continuous-batching step: admit waiting requests into free sequences, run one
        ``init_batch`` of every running request's decode tokens and the prompt chunks that fit in
        ``n_batch``, sample, finish; the events, one per request that added tokens or finished."""
        # the drafts first: a draft source's bad token raises before anything changes
        drafts = self.drafts([request for request in self.running if request.prefilled and request.tokens])
        events, self.unreported = self.unreported, []
        self.admit()
        feeds = self.feeds(drafts)
        if not feeds:
            return events
        rows = self.run(feeds)
        self.stats.steps += 1
        for feed, logits in zip(feeds, rows):
            before = len(feed.request.tokens)
            self.settle(feed, logits, events)
            request = feed.request
            if len(request.tokens) > before or request.finished:
                events.append(Event(request, tuple(request.tokens[before:]), request.finish_reason))
        return events

    def run_until_done(self) -> Iterator[Event]:
        """Step until every request is finished, yielding each event."""
        while not self.done:
            yield from self.step()

    def generate(self, prompts: Sequence[str | bytes | Sequence[int]], **options: Any) -> list[Request]:
        """Every prompt served with the same ``submit`` options; the finished requests, in order."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ArgumentError(f"generate takes a sequence of prompts, got {type(prompts).__name__} (one prompt: "
                                "[prompt])")
        requests = [self.submit(prompt, **options) for prompt in prompts]
        for _ in self.run_until_done():
            pass
        return requests

    def admit(self) -> None:
        """Waiting requests take free sequences, in order (one with forks takes one for each):
        a prefix cache restores their longest held prefix and plans their cuts."""
        while self.waiting and len(self.waiting[0].pending) + 1 <= len(self.free_seqs) and self.fits(self.waiting[0]):
            request = self.waiting.popleft()
            request.seq = self.free_seqs.pop(0)
            for child in request.pending:
                child.seq = self.free_seqs.pop(0)
            self.running.append(request)
            with self.stats.timing("cache"):
                self.cache.seq_rm(request.seq, -1, -1)
                if self.prefix_cache is not None:
                    request.restored = request.n_cached = self.restore(request)
                    self.stats.restored_tokens += request.restored
                request.cuts = self.cuts(request)
        self.stats.peak_sequences = max(self.stats.peak_sequences, self.n_seq_max - len(self.free_seqs))

    def cuts(self, request: Request) -> list[int]:
        """Where ``request``'s prefill stops to save its state: the prefix cache's ``plan``, or, for a
        prefix cache without one (``HybridPrefixCache``), one token before the prompt's end, so that
        the same prompt again restores all but the token whose logits it needs."""
        if self.prefix_cache is None:
            return []
        plan = getattr(self.prefix_cache, "plan", None)
        if plan is not None:
            cuts: list[int] = plan(request.prompt, request.n_cached)
            return cuts
        return [len(request.prompt) - 1] if len(request.prompt) - 1 > request.n_cached else []

    def restore(self, request: Request) -> int:
        """The longest prefix of ``request``'s prompt the prefix cache holds, restored into its
        sequence, leaving at least the last prompt token to compute (its logits give the first token):
        a ``HybridPrefixCache`` may hold the whole prompt, and then restores all but its last token."""
        assert self.prefix_cache is not None
        n: int = self.prefix_cache.restore(request.seq, request.prompt)
        if n < len(request.prompt):
            return n
        self.cache.seq_rm(request.seq, -1, -1)
        shorter: int = self.prefix_cache.restore(request.seq, request.prompt[:-1])
        return shorter

    def cells_needed(self, request: Request) -> int:
        """The most KV cells ``request`` and its forks can hold (a hybrid cache's budget)."""
        return sum(len(r.prompt) + r.max_new_tokens + self.n_draft for r in [request, *request.pending])

    def fits(self, request: Request) -> bool:
        """Whether ``request`` fits beside the running ones in a hybrid cache's KV cells (always, for a
        cache without them): admitted only then, a step never runs out of cells."""
        if self.kv_size is None:
            return True
        return sum(map(self.cells_needed, self.running)) + self.cells_needed(request) <= self.kv_size

    def feeds(self, drafts: Mapping[int, list[int]]) -> list[_Feed]:
        """What each running request puts into this step: decode tokens (and ``drafts``, by sequence)
        first, then prompt chunks ending at the next cut, within ``n_batch`` tokens."""
        decoding = [request for request in self.running if request.prefilled and request.tokens]
        feeds = [_Feed(r, r.tokens[-1:] + drafts.get(r.seq, []), every_logit=bool(drafts.get(r.seq)))
                 for r in decoding]
        budget = self.n_batch - sum(len(feed.tokens) for feed in feeds)
        if not feeds:
            budget = self.n_batch
        for request in self.running:
            if request.prefilled or budget <= 0:
                continue
            end = min(request.cuts[0] if request.cuts else len(request.prompt), request.n_cached + budget)
            feeds.append(_Feed(request, request.prompt[request.n_cached:end], last_logit=end == len(request.prompt)))
            budget -= end - request.n_cached
        return feeds

    def drafts(self, decoding: list[Request]) -> dict[int, list[int]]:
        """The drafts of each decoding request, by sequence (none beyond its ``max_new_tokens``)."""
        if self.draft is None:
            return {}
        room = {r.seq: min(self.n_draft, r.max_new_tokens - len(r.tokens) - 1) for r in decoding}
        room = {seq: k for seq, k in room.items() if k > 0}
        by_seq = {r.seq: r for r in decoding if r.seq in room}
        if isinstance(self.draft, DraftModel):
            proposed = self.draft.propose({seq: r.history for seq, r in by_seq.items()}, room)
        else:
            proposed = {seq: list(self.draft(r.history, room[seq])) for seq, r in by_seq.items()}
        drafts = {seq: self.checked_ids(tokens, "draft")[:room[seq]] for seq, tokens in proposed.items() if tokens}
        self.stats.drafted += sum(map(len, drafts.values()))
        self.stats.verify_steps += bool(drafts)
        return drafts

    def run(self, feeds: Sequence[_Feed]) -> list[list[np.ndarray]]:
        """One batch of ``feeds`` through the cache and the model: per feed, the logits of its
        output tokens in position order."""
        stats = self.stats
        feed_of: list[int] = []   # batch index -> feed index
        for k, feed in enumerate(feeds):
            n = len(feed.tokens)
            feed_of += [k] * n
            if feed.request.prefilled:
                stats.decode_tokens += n
            else:
                stats.prompt_tokens += n
        batch = batch_of([(feed.tokens, feed.request.n_cached, feed.request.seq,
                           [True] * len(feed.tokens) if feed.every_logit
                           else [False] * (len(feed.tokens) - 1) + [feed.last_logit]) for feed in feeds])
        with stats.timing("cache"):
            st = self.cache.init_batch(batch, self.n_ubatch)
        if st.status != MemoryStatus.SUCCESS:
            raise ConfigError(f"the cache cannot take this step's {batch.n_tokens} tokens of {len(feeds)} requests "
                              f"({st.status.name}): give it more room or run fewer sequences")
        with stats.timing("model"):
            logits = host_logits(self.model.forward(st))
        stats.ubatches += st.n_ubatches
        rows: list[list[np.ndarray]] = [[] for _ in feeds]
        # a sequence's tokens keep their order within a ubatch and across ubatches: each feed's rows
        # come in position order, whatever order the ubatches take the feeds in
        for row, batch_index in zip(logits, st.out_ids.tolist()):
            rows[feed_of[batch_index]].append(row)
        return rows

    def settle(self, feed: _Feed, rows: list[np.ndarray], events: list[Event]) -> None:
        """The fed tokens are in the state: sample from their logits (keeping the drafts the model
        agrees with, rolling the rest back), save at a planned cut, finish."""
        request = feed.request
        if not request.prefilled:
            request.n_cached += len(feed.tokens)
            if request.cuts and request.n_cached == request.cuts[0]:
                request.cuts.pop(0)
                self.save(request)
            if request.prefilled:
                if request.max_new_tokens == 0:
                    self.release(request, "length")
                    return
                self.append(request, rows[-1])
                forks, request.pending = request.pending, []
                self.start_forks(request, forks, events)
                if request.finished:
                    self.release(request, request.finish_reason)
            return
        drafts = feed.tokens[1:]
        accepted = 0
        self.append(request, rows[0])
        while accepted < len(drafts) and not request.finished and request.tokens[-1] == drafts[accepted]:
            accepted += 1
            self.append(request, rows[accepted])
        self.stats.accepted += accepted
        request.n_cached += len(feed.tokens)
        if request.n_cached > len(request.history) - 1:   # rejected drafts, or drafts past a finish
            keep = len(request.history) - 1
            with self.stats.timing("cache"):
                rolled_back = self.cache.seq_rm(request.seq, keep, -1)
            if not rolled_back:   # n_rollback >= n_draft was checked: the cache broke its promise
                raise CoreError(f"seq_rm({request.seq}, {keep}, -1) could not roll back "
                                  f"{request.n_cached - keep} draft tokens")
            request.n_cached = keep
            self.stats.rollbacks += 1
        if request.finished:
            self.release(request, request.finish_reason)

    def append(self, request: Request, logits: np.ndarray) -> None:
        """Sample ``request``'s next token from ``logits``; mark it finished when a stop condition holds."""
        token = request.sampler(logits)
        request.tokens.append(token)
        request.last_logits = logits
        if token in request.stop_tokens or self.stopped_by_text(request):
            request.finish_reason = "stop"
        elif len(request.tokens) >= request.max_new_tokens:
            request.finish_reason = "length"

    def stopped_by_text(self, request: Request) -> bool:
        """Whether the generated text now holds a stop string (one that ends in the last token's bytes:
        the text before them was checked already)."""
        if not request.stop_strings or self.vocab is None:
            return False
        piece: bytes = self.vocab.decode(request.tokens[-1:])
        request.text += piece
        recent = request.text[-(max(map(len, request.stop_strings)) + len(piece) - 1):]
        return any(stop in recent for stop in request.stop_strings)

    def start_forks(self, parent: Request, children: list[Request], events: list[Event]) -> None:
        """``children`` (holding reserved sequences) take ``parent``'s state and sample their first
        token from its last logits."""
        assert parent.last_logits is not None, "a request forks once its prompt is in its state"
        for child in children:
            with self.stats.timing("cache"):
                self.cache.seq_rm(child.seq, -1, -1)
                self.cache.seq_cp(parent.seq, child.seq, -1, -1)
            child.n_cached = parent.n_cached
            self.running.append(child)
            self.append(child, parent.last_logits)
            events.append(Event(child, tuple(child.tokens), child.finish_reason))
            if child.finished:
                self.release(child, child.finish_reason)
        self.stats.peak_sequences = max(self.stats.peak_sequences, self.n_seq_max - len(self.free_seqs))

    def save(self, request: Request) -> None:
        """Snapshot ``request``'s state (the first ``n_cached`` tokens of its history) in the prefix cache."""
        if self.prefix_cache is not None and request.n_cached > 0:
            with self.stats.timing("cache"):
                self.prefix_cache.save(request.seq, request.history[:request.n_cached])

    def release(self, request: Request, reason: FinishReason | None) -> None:
        """``request`` is finished: save its history, remove its sequence (and its forks not yet
        started), give the sequences back."""
        request.finish_reason = reason
        if reason != "cancelled":
            self.save(request)
        seqs = [request.seq] + [child.seq for child in request.pending]
        for child in request.pending:   # forks that never started: cancelled with it, or as empty as it
            child.finish_reason = reason
            child.seq = -1
        request.pending = []
        with self.stats.timing("cache"):
            for seq in seqs:
                if not self.cache.seq_rm(seq, -1, -1):
                    raise CoreError(f"seq_rm({seq}, -1, -1) refused to remove a whole sequence")
        if isinstance(self.draft, DraftModel):
            self.draft.release(request.seq)
        self.running.remove(request)
        self.free_seqs = sorted(self.free_seqs + seqs)
        request.seq = -1
