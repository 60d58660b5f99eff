"""``python -m recurrent_cache demo``: a Mamba model serving many clients from one cache.

In the spirit of llama.cpp's ``llama-parallel -np 5 -ns 8``: ``--clients``
clients, each with a prompt (the start of a held-out standard-library file, or
one written by hand), are served by ``--parallel`` sequence slots.  Every step
is ONE ``init_batch`` that mixes the prompts of newly admitted clients with one
decode token of every running client, split into ubatches of at most
``--ubatch`` tokens.  A client that has generated ``--n-predict`` tokens is
removed (``seq_rm``) and a waiting client takes its slot, so freed cells are
re-used.  ``--fork`` instead runs one prompt and forks it (``seq_cp``) into
``--parallel`` sequences that continue with different sampling seeds.

Afterwards every client is run again alone, from a zero state, through the
plain reference forward (no cache): its tokens must be identical and its last
logits equal within ``TOLERANCE``.  Any difference is reported loudly and the
exit status is 1.

The model is the byte-level Mamba shipped with the package (numpy only);
``--random-weights`` gives the seeded random one, ``--model FILE.gguf`` any
Mamba-1 GGUF (its own vocabulary encodes the prompts and decodes the text).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterator

import numpy as np

import recurrent_cache as rc

from ._cli import USER_ERROR, OneLineParser, float_in, int_in
from .models import (MambaModel, ModelError, ReferenceRun, Sampler, held_out_prompts, load_model as load_model_path,
                     random_model, trained_model, write_gguf)
from .models.sampling import DEFAULT_TEMPERATURE, DEFAULT_TOP_K
from .models._storage import StateStorage
from .models.vocab import escape

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
MAX_SEED = 2**63 - 1

# Largest accepted max|logits - solo logits| / max|solo logits| per state dtype.
# The batched and the solo run round their states at the same points (every
# token), so they agree far below these bounds; the slack for f16/bf16 covers
# one stored element rounding the other way after float noise of a different
# summation order, which moves logits by about one unit in the last place of
# that storage type.
TOLERANCE = {"f32": 1e-5, "f16": 1e-3, "bf16": 1e-2}

# How many clients the report lists one by one.
CLIENTS_LISTED = 10


# -- clients --------------------------------------------------------------------------


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

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.n_predict

    def pending(self) -> list[int]:
        """What to feed next: the prompt, then the last generated token."""
        return self.prompt if self.n_cached == 0 else [self.tokens[-1]]

    def accept(self, logits: np.ndarray) -> None:
        self.last_logits = logits
        self.tokens.append(self.sampler(logits))


def run_alone(model: MambaModel, client: Client, state_dtype: str) -> tuple[list[int], np.ndarray]:
    """The client's prompt and generation on a fresh reference run: (tokens, last logits)."""
    run = ReferenceRun(model, state_dtype, state_dtype)
    sampler = client.sampler.fresh()
    logits = run.feed(client.prompt)[-1]
    tokens = [sampler(logits)]
    while len(tokens) < client.n_predict:
        logits = run.feed(tokens[-1:])[-1]
        tokens.append(sampler(logits))
    return tokens, logits


# -- serving --------------------------------------------------------------------------


@dataclass
class Stats:
    """What the serving loop did, and where its time went ("cache" / "model" seconds)."""

    steps: int = 0
    ubatches: int = 0
    prompt_tokens: int = 0
    decode_tokens: int = 0
    peak_used: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: {"cache": 0.0, "model": 0.0})

    @contextmanager
    def timing(self, what: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[what] += time.perf_counter() - start


class NoProgress:
    """Stands in for a tqdm bar when there is none to show."""

    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, quiet: bool) -> Any:
    """A tqdm bar on stderr when it is a terminal (tqdm is optional)."""
    if quiet or not sys.stderr.isatty():
        return NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return NoProgress()
    return tqdm(total=total, unit="tok", desc="generating", file=sys.stderr, leave=False)


class Server:
    """Continuous batching of clients over the sequence slots of one cache."""

    def __init__(self, model: MambaModel, cache: Any, n_ubatch: int, progress: Any,
                 corrupt_step: int | None = None, seed: int = 0) -> None:
        self.model = model
        self.cache = cache
        self.n_ubatch = n_ubatch
        self.progress = progress
        self.free_slots = list(range(cache.n_seq_max))
        self.running: dict[int, Client] = {}
        self.stats = Stats()
        # Testing only: after this step, overwrite a live state so that the verification must fail.
        self.corrupt_step = corrupt_step
        self.corruption = ""
        self.rng = np.random.default_rng(seed)

    def admit(self, client: Client) -> None:
        client.slot = self.free_slots.pop(0)
        self.running[client.slot] = client

    def fork(self, parent: Client, child: Client) -> None:
        """Start ``child`` from ``parent``'s state (``seq_cp``) and its last logits."""
        self.admit(child)
        with self.stats.timing("cache"):
            self.cache.seq_cp(parent.slot, child.slot, -1, -1)
        child.n_cached = parent.n_cached
        child.accept(parent.last_logits)
        self.progress.update(1)

    def step(self) -> None:
        """One init_batch: every running client's pending tokens, each ending in an output."""
        stats, cache = self.stats, self.cache
        tokens: list[int] = []
        pos: list[int] = []
        seq_id: list[int] = []
        output: list[bool] = []
        owner: list[Client] = []  # batch index -> client
        for client in self.running.values():
            feed = client.pending()
            tokens += feed
            pos += range(client.n_cached, client.n_cached + len(feed))
            seq_id += [client.slot] * len(feed)
            output += [False] * (len(feed) - 1) + [True]
            owner += [client] * len(feed)
            if client.n_cached == 0:
                stats.prompt_tokens += len(feed)
            else:
                stats.decode_tokens += len(feed)
            client.n_cached += len(feed)

        with stats.timing("cache"):
            st = cache.init_batch(rc.Batch(token=tokens, pos=pos, seq_id=seq_id, logits=output), self.n_ubatch)
        if st.status != rc.MemoryStatus.SUCCESS:
            raise RuntimeError(f"init_batch failed ({st.status.name}) with {len(self.running)} clients "
                               f"on {cache.size} cells")
        logits = []
        more = True
        while more:
            with stats.timing("cache"):
                st.apply()
            stats.peak_used = max(stats.peak_used, cache.used)
            with stats.timing("model"):
                logits.append(self.model.forward_ubatch(st))
            stats.ubatches += 1
            with stats.timing("cache"):
                more = st.next()

        for row, batch_index in zip(np.concatenate(logits), st.out_ids):
            owner[batch_index].accept(row)
        stats.steps += 1
        self.progress.update(len(self.running))

    def end_step(self) -> None:
        """Remove the finished clients' sequences and free their slots."""
        for slot, client in list(self.running.items()):
            if client.done:
                with self.stats.timing("cache"):
                    removed = self.cache.seq_rm(slot, -1, -1)
                if not removed:
                    raise RuntimeError(f"seq_rm({slot}, -1, -1) refused to remove a whole sequence")
                del self.running[slot]
                self.free_slots.append(slot)
        self.free_slots.sort()
        if self.stats.steps == self.corrupt_step:
            self.corruption = self._corrupt_state()

    def _corrupt_state(self) -> str:
        """Overwrite the layer-0 SSM state of the first running client with noise."""
        if not self.running:
            return f"no running client left to corrupt after step {self.stats.steps}"
        client = next(iter(self.running.values()))
        cell = self.cache.cell(client.slot)[2]  # the tail: the cell holding that sequence
        row = self.cache.s[0][cell]
        row[...] = StateStorage(row.dtype).encode(10.0 * self.rng.standard_normal(row.shape))
        return f"corrupted the layer-0 SSM state of client {client.number} (cell {cell}) after step {self.stats.steps}"


def serve_queue(server: Server, clients: list[Client]) -> None:
    """Clients wait in a queue and take free slots as they open."""
    waiting = deque(clients)
    while waiting or server.running:
        while waiting and server.free_slots:
            server.admit(waiting.popleft())
        server.step()
        server.end_step()


def serve_forks(server: Server, forks: list[Client]) -> None:
    """The first fork runs the prompt; the others ``seq_cp`` its state and continue on their own."""
    root = forks[0]
    server.admit(root)
    server.step()
    for child in forks[1:]:
        server.fork(root, child)
    server.end_step()
    while server.running:
        server.step()
        server.end_step()


# -- verification and report ----------------------------------------------------------------


def verify(model: MambaModel, clients: list[Client], state_dtype: str) -> tuple[list[str], float]:
    """Compare every client with its solo run: (problems, largest relative logits difference)."""
    tolerance = TOLERANCE[state_dtype]
    problems = []
    worst = 0.0
    for client in clients:
        tokens, logits = run_alone(model, client, state_dtype)
        if tokens != client.tokens:
            at = next(i for i, (a, b) in enumerate(zip(tokens, client.tokens)) if a != b)
            problems.append(f"client {client.number}: token {at} is {client.tokens[at]} served, "
                            f"{tokens[at]} alone (served {client.tokens}, alone {tokens})")
        difference = float(np.max(np.abs(client.last_logits - logits)) / np.max(np.abs(logits)))
        worst = max(worst, difference)
        if not difference <= tolerance:
            problems.append(f"client {client.number}: last logits differ from its solo run by "
                            f"{difference:.3g} (relative; tolerance {tolerance:g})")
    return problems, worst


def report(options: argparse.Namespace, model: MambaModel, clients: list[Client], stats: Stats,
           seconds: float, cells: int) -> None:
    processed = stats.prompt_tokens + stats.decode_tokens
    generated = sum(len(client.tokens) for client in clients)
    shares = {what: 100.0 * spent / seconds for what, spent in stats.seconds.items()}
    mode = f"1 prompt forked into {len(clients)} sequences" if options.fork else \
        f"{len(clients)} ({options.parallel} at a time)"
    print(f"model            {model.hparams.describe()} ({model_name(options)})")
    print(f"cache            {cells} cells, {options.dtype} states, n_ubatch {options.ubatch}")
    print(f"clients          {mode}")
    for client in clients[:CLIENTS_LISTED]:
        print(f"  client {client.number:<3} prompt {len(client.prompt):>3} tokens {shown_prompt(model, client.prompt)}"
              f" -> {shown_tokens(model, client.tokens)}  [{client.sampler}]")
    if len(clients) > CLIENTS_LISTED:
        print(f"  ... and {len(clients) - CLIENTS_LISTED} more")
    print(f"tokens           {processed} processed ({stats.prompt_tokens} prompt + {stats.decode_tokens} decode), "
          f"{generated} generated")
    print(f"steps            {stats.steps} init_batch, {stats.ubatches} ubatches")
    print(f"throughput       {processed / seconds:.0f} tokens/s ({seconds:.2f} s)")
    print(f"peak cells used  {stats.peak_used} of {cells}")
    print(f"time             cache {shares['cache']:.1f}% (init_batch, apply, next, seq ops) · "
          f"model {shares['model']:.1f}% · other {100.0 - shares['cache'] - shares['model']:.1f}%")


def model_name(options: argparse.Namespace) -> str:
    if options.model:
        return options.model
    if options.random_weights:
        return f"random weights, seed {options.seed}"
    return "the shipped byte-level model, trained on the standard library"


def shown_tokens(model: MambaModel, tokens: list[int], tail: int | None = None) -> str:
    """Tokens as quoted, escaped text (or their ids when the model has no vocabulary); with
    ``tail``, only the last ``tail`` bytes after "..." (cut before escaping, so no escape is cut)."""
    if model.vocab is None:
        return " ".join(map(str, tokens[:12])) + (" ..." if len(tokens) > 12 else "")
    data = model.vocab.decode(tokens)
    cut = tail is not None and len(data) > tail
    text = escape(data[-tail:] if cut else data).replace('"', '\\"')
    return f'"{"..." if cut else ""}{text}"'


def shown_prompt(model: MambaModel, prompt: list[int], tail: int = 28) -> str:
    """The end of a prompt, where the generated text continues it."""
    return "" if model.vocab is None else shown_tokens(model, prompt, tail)


# -- command line -------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = OneLineParser(
        prog="python -m recurrent_cache demo",
        description="Serve clients with a Mamba model from one recurrent cache (continuous batching), "
                    "then check every client against a solo run.")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", metavar="GGUF|DIR",
                        help="a Mamba-1/2 GGUF file or Hugging Face checkpoint directory (default: the shipped model)")
    source.add_argument("--random-weights", action="store_true", help="a seeded random model instead")
    parser.add_argument("--clients", type=int_in(1, 10_000), default=8, help="clients to serve (default 8)")
    parser.add_argument("--parallel", type=int_in(1, 1024), default=5,
                        help="sequence slots / cache cells (default 5)")
    parser.add_argument("--n-predict", type=int_in(1, 100_000), default=32,
                        help="tokens each client generates (default 32)")
    parser.add_argument("--ubatch", type=int_in(1, 65536), default=16,
                        help="n_ubatch: most tokens per ubatch (default 16)")
    parser.add_argument("--seed", type=int_in(0, MAX_SEED), default=0,
                        help="seed of the prompt order, the samplers and the random weights")
    parser.add_argument("--temperature", type=float_in(0.0, 100.0), default=DEFAULT_TEMPERATURE,
                        help=f"0 is greedy; above 0 samples softmax(logits / T) (default {DEFAULT_TEMPERATURE})")
    parser.add_argument("--top-k", type=int_in(0, 1_000_000), default=DEFAULT_TOP_K,
                        help=f"sample from the k most likely tokens only, 0: all (default {DEFAULT_TOP_K})")
    parser.add_argument("--dtype", choices=sorted(TOLERANCE), default="f32", help="state storage type")
    parser.add_argument("--compute", choices=["f32", "f64"], default="f32",
                        help="model arithmetic (default f32, as the model was trained)")
    parser.add_argument("--fork", action="store_true",
                        help="one prompt forked with seq_cp into --parallel sampled continuations "
                             "(--clients is ignored)")
    parser.add_argument("--speculative", type=int_in(1, 64), metavar="K",
                        help="speculative decoding: draft K tokens by prompt lookup, verify them in one "
                             "batch, roll the rejected ones back (greedy; compared with plain decoding)")
    parser.add_argument("--prefix-cache", action="store_true",
                        help="conversations sharing system prompts, served with and without rc.PrefixCache "
                             "(see recurrent_cache.demo_prefix; --fork is ignored)")
    parser.add_argument("--store", metavar="DIR_OR_URL",
                        help="with --prefix-cache (implied): a shared state store behind it, a directory or "
                             "a redis:// / unix:// URL; run twice, the second run restores the first's prefixes")
    parser.add_argument("--write-model", metavar="GGUF", help="write the model as a GGUF file and exit")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    # Testing only: overwrite a live state after this step; the verification must then fail.
    parser.add_argument("--corrupt-step", type=int_in(0, 2**31 - 1), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build_model(options: argparse.Namespace) -> MambaModel:
    dtype = np.float32 if options.compute == "f32" else np.float64
    if options.model:
        return load_model_path(options.model, dtype=dtype)
    if options.random_weights:
        return random_model(options.seed, dtype=dtype)
    return trained_model(dtype=dtype)


def prompt_pool(model: MambaModel) -> list[list[int]]:
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


def make_clients(options: argparse.Namespace, model: MambaModel, rng: np.random.Generator) -> list[Client]:
    pool = prompt_pool(model)
    order = rng.permutation(len(pool)).tolist()

    def prompt(k: int) -> list[int]:
        if pool:
            return pool[order[k % len(pool)]]
        length = int(rng.integers(PROMPT_LENGTHS[0], PROMPT_LENGTHS[1] + 1))
        return rng.integers(0, model.hparams.n_vocab, size=length).tolist()

    def sampler(k: int) -> Sampler:
        return Sampler(options.temperature, options.top_k, (options.seed, k))

    if options.fork:
        shared = prompt(0)
        return [Client(k, shared, options.n_predict, sampler(k)) for k in range(options.parallel)]
    return [Client(k, prompt(k), options.n_predict, sampler(k)) for k in range(options.clients)]


def main(argv: list[str] | None = None) -> int:
    options = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        model = build_model(options)
        if options.write_model:
            write_gguf(model, options.write_model, name="recurrent-cache-random-mamba" if options.random_weights
                       else "recurrent-cache-byte-mamba")
            print(f"wrote {options.write_model}: {model.hparams.describe()}")
            return 0
    except (ImportError, OSError, ModelError) as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return USER_ERROR

    if options.prefix_cache or options.store:
        from .demo_prefix import main as prefix_cache_main
        return prefix_cache_main(options, model)
    if options.speculative:
        from .demo_speculative import main as speculative_main
        return speculative_main(options, model)
    rng = np.random.default_rng(options.seed)
    clients = make_clients(options, model, rng)
    try:
        cache = model.new_cache(n_seq_max=options.parallel, dtype=options.dtype)
    except (MemoryError, rc.RecurrentCacheError) as exc:
        print(f"demo: cannot allocate {options.parallel} state cells for this model: {exc}", file=sys.stderr)
        return USER_ERROR
    progress = progress_bar(sum(client.n_predict for client in clients), options.quiet)
    server = Server(model, cache, options.ubatch, progress, options.corrupt_step, options.seed)
    start = time.perf_counter()
    (serve_forks if options.fork else serve_queue)(server, clients)
    seconds = time.perf_counter() - start
    progress.close()

    report(options, model, clients, server.stats, seconds, cache.size)
    if server.corruption:
        print(f"testing          {server.corruption}")
    problems, worst = verify(model, clients, options.dtype)
    if problems:
        print(f"verification     FAILED: {len(problems)} mismatches with the solo runs")
        print("\n*** VERIFICATION FAILED: the cache served states that differ from running each client alone ***",
              file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    print(f"verification     PASSED: {len(clients)} of {len(clients)} clients equal their solo runs "
          f"(tokens identical, last logits within {worst:.1e} relative, tolerance {TOLERANCE[options.dtype]:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
