"""``python -m recurrent_cache demo --prefix-cache``: clients sharing prompts, served through PrefixCache.

``--clients`` conversations of ``TURNS`` turns each.  Every conversation
starts with one of ``N_SYSTEM_PROMPTS`` system prompts; each turn adds a few
user tokens to everything said so far and generates ``--n-predict`` tokens
greedily.  Turns are requests, served with continuous batching on
``--parallel`` sequence slots: a request that finishes frees its slot and
queues its conversation's next turn behind the other clients' requests.

The package's ``Generator`` serves them with a ``PrefixCache``: each request
first ``restore``s the longest prefix the ``PrefixCache`` holds
(a shared system prompt, or the whole previous turn), then prefills the rest
in chunks that end at ``plan``'s cuts (the block grid, junctions with earlier
prompts, the end of the prompt), ``save``-ing at each, in the same
``init_batch`` steps as the other clients' chunks and decode tokens.  After
generating it saves the conversation so far, for the next turn.

The same requests are served a second time without the prefix cache (every
prompt computed whole), and every request of both runs is checked against
its solo run (``model.reference_run``, token by token from a zero state): tokens
identical, last logits within the demo's tolerance.

``--store DIR_OR_URL`` puts a shared state store (``rc.stores.open_store``:
a directory, or a Redis / Valkey URL) behind the prefix cache, under a
namespace that is the model's identity (``model_identity``).  Every new
snapshot is written to the store; a restore looks there for longer prefixes
than memory holds.  Run the demo twice with the same store: the second run,
a new process with an empty memory, restores the first run's prefixes from
the store (the ``store`` line reports it), and still equals the solo runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import recurrent_cache as rc

from ..generation import Generator
from ..models import LanguageModel, Sampler
from .model_options import model_identity, model_name, where_states_live
from .options import USER_ERROR
from .serving import Client, Served, new_cache, serve
from .verification import TOLERANCE, fail, relative_difference

__all__ = ["Turn", "make_conversations", "next_turn", "run", "serve_conversations"]

TURNS = 3
N_SYSTEM_PROMPTS = 2
SYSTEM_PROMPT_LENGTHS = (48, 96)   # inclusive ranges of random token counts
USER_LENGTHS = (4, 16)
BLOCK_SIZE = 32
MAX_BYTES = 4 << 20                 # the prefix cache's budget


def make_conversations(options: argparse.Namespace, n_vocab: int) -> list[list[list[int]]]:
    """Per client, the user tokens of each turn; the first turn starts with a system prompt."""
    rng = np.random.default_rng(options.seed)

    def text(bounds: tuple[int, int]) -> list[int]:
        ids: list[int] = rng.integers(0, n_vocab, int(rng.integers(bounds[0], bounds[1] + 1))).tolist()
        return ids

    systems = [text(SYSTEM_PROMPT_LENGTHS) for _ in range(N_SYSTEM_PROMPTS)]
    return [[systems[client % N_SYSTEM_PROMPTS] + text(USER_LENGTHS)] + [text(USER_LENGTHS) for _ in range(TURNS - 1)]
            for client in range(options.clients)]


@dataclass(eq=False)
class Turn(Client):
    """One turn of conversation ``number``: a request whose prompt is everything said so far."""

    turn: int = 0


def next_turn(conversations: list[list[list[int]]]) -> Callable[[Client], Client | None]:
    """What follows a finished turn: its conversation's next turn, whose prompt is everything said so far."""
    def follow_up(client: Client) -> Client | None:
        if not isinstance(client, Turn):
            raise TypeError(f"a conversation serves turns, not {client!r}")
        turns = conversations[client.number]
        if client.turn + 1 == len(turns):
            return None
        prompt = client.prompt + client.tokens + turns[client.turn + 1]
        return Turn(client.number, prompt, client.n_predict, Sampler(), turn=client.turn + 1)
    return follow_up


def serve_conversations(model: LanguageModel, options: argparse.Namespace, conversations: list[list[list[int]]],
                        prefix_cache: bool, store: rc.stores.DirectoryStore | rc.stores.RedisStore | None = None,
                        namespace: str = "") -> tuple[list[Turn], Generator, Served, float, dict[str, int]]:
    """All turns of all conversations through one cache, greedily, with or without a PrefixCache (and
    its store): the finished turns, the generator, what it served, the seconds it took, and the prefix
    cache's stats."""
    cache = new_cache(model, options.parallel, options.dtype, storage=options.storage,
                      device=options.device)
    pc: rc.PrefixCache | rc.HybridPrefixCache | None = None
    if prefix_cache and isinstance(cache, rc.HybridCache):   # a hybrid's prefixes keep their KV rows too
        pc = rc.HybridPrefixCache(cache, MAX_BYTES, block_size=BLOCK_SIZE, store=store,
                                  namespace=namespace if store is not None else None)
    elif prefix_cache:
        pc = rc.PrefixCache(cache, MAX_BYTES, block_size=BLOCK_SIZE, store=store, namespace=namespace)
    generator = Generator(model, cache, n_ubatch=options.ubatch, prefix_cache=pc)
    first_turns = [Turn(number, turns[0], options.n_predict, Sampler()) for number, turns in enumerate(conversations)]
    start = time.perf_counter()
    served = serve(generator, first_turns, corrupt_step=options.corrupt_step if prefix_cache else None,
                   follow_up=next_turn(conversations))
    seconds = time.perf_counter() - start
    turns = [turn for turn in served.finished if isinstance(turn, Turn)]
    return turns, generator, served, seconds, pc.stats() if pc is not None else {}


def verify(model: LanguageModel, runs: list[list[Turn]], conversations: list[list[list[int]]], n_predict: int,
           dtype: str) -> tuple[list[str], float]:
    """Every request of every run against its solo run: (problems, largest relative logits difference)."""
    solo: dict[tuple[int, int], tuple[list[int], np.ndarray]] = {}
    for client, turns in enumerate(conversations):
        reference = model.reference_run(dtype)   # one conversation, token by token
        prompt: list[int] = []
        generated: list[int] = []
        fed = 0
        for turn, user in enumerate(turns):
            prompt = prompt + generated + user
            last = reference.feed(prompt[fed:])[-1]
            generated = [int(np.argmax(last))]
            while len(generated) < n_predict:
                last = reference.feed(generated[-1:])[-1]
                generated.append(int(np.argmax(last)))
            fed = len(prompt) + n_predict - 1
            solo[client, turn] = generated, last
    problems, worst = [], 0.0
    for requests, name in zip(runs, ("with", "without")):
        for request in requests:
            tokens, logits = solo[request.number, request.turn]
            label = f"client {request.number} turn {request.turn} ({name} the prefix cache)"
            if request.tokens != tokens:
                problems.append(f"{label}: generated {request.tokens}, alone {tokens}")
            difference = relative_difference(request.last_logits, logits)
            worst = max(worst, difference)
            if not difference <= TOLERANCE[dtype]:
                problems.append(f"{label}: last logits differ from the solo run by {difference:.3g} (relative)")
    return problems, worst


def run(options: argparse.Namespace, model: LanguageModel) -> int:
    """Serve the scenario with and without the prefix cache, report, verify; the exit status."""
    conversations = make_conversations(options, model.hparams.n_vocab)
    store, namespace = None, ""
    if options.store:
        try:
            store = rc.stores.open_store(options.store)
            namespace = model_identity(options, model)
        except (rc.ArgumentError, ImportError, OSError) as exc:
            print(f"demo: --store: {exc}", file=sys.stderr)
            return USER_ERROR
    requests, with_pc, with_run, with_seconds, stats = serve_conversations(model, options, conversations, True,
                                                                            store, namespace)
    without, without_pc, _, without_seconds, _ = serve_conversations(model, options, conversations, False)
    n_requests = len(requests)
    hits = sum(r.restored > 0 for r in requests)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    computed = with_pc.stats.prompt_tokens
    print(f"model            {model.hparams.describe()} ({model_name(options)})")
    print(f"cache            {options.parallel} cells, {options.dtype} states{where_states_live(options)}, "
          f"n_ubatch {options.ubatch}")
    print(f"clients          {options.clients} conversations of {TURNS} turns ({options.parallel} requests at a time), "
          f"{N_SYSTEM_PROMPTS} shared system prompts, {options.n_predict} tokens generated per turn")
    print(f"prefix cache     block_size {BLOCK_SIZE}, max_bytes {MAX_BYTES / 2**20:g} MiB: "
          f"{stats['snapshots']} snapshots "
          f"held, {stats.get('saves', stats.get('saved'))} saves, "
          f"{stats.get('evictions', stats.get('evicted'))} evicted")
    print(f"hit rate         {hits} of {n_requests} requests restored a prefix ({100.0 * hits / n_requests:.0f}%)")
    if store is not None:
        held = store.stats()
        size = f", {held['entries']} entries ({held['bytes'] / 2**20:.1f} MiB) in it" if "entries" in held else ""
        print(f"store            {store!r}{size}: {stats['store_hits']} restores from it "
              f"({stats['store_tokens_restored']} tokens) in {stats['store_lookups']} lookups, "
              f"{stats['store_puts']} snapshots put ({stats['store_written']} written), "
              f"{stats['store_damaged']} damaged, {stats['store_errors']} errors")
        print(f"namespace        {namespace}")
    saved = prompt_tokens - computed
    print(f"prefill          {computed} of {prompt_tokens} prompt tokens computed with the prefix "
          f"cache, {without_pc.stats.prompt_tokens} without: {saved} saved ({100.0 * saved / prompt_tokens:.1f}%)")
    served = prompt_tokens + n_requests * options.n_predict
    print(f"throughput       {served / with_seconds:.0f} tokens/s with the prefix cache ({with_seconds:.2f} s), "
          f"{served / without_seconds:.0f} without ({without_seconds:.2f} s): {without_seconds / with_seconds:.2f}x "
          f"(prompt + generated tokens served per second)")
    if with_run.corruption:
        print(f"testing          {with_run.corruption}")
    problems, worst = verify(model, [requests, without], conversations, options.n_predict, options.dtype)
    if problems:
        return fail(f": {len(problems)} mismatches with the solo runs",
                    "served requests differ from running each conversation alone", problems)
    print(f"verification     PASSED: {2 * n_requests} of {2 * n_requests} requests ({n_requests} with, {n_requests} "
          f"without the prefix cache) equal their solo runs (tokens identical, last logits within {worst:.1e} "
          f"relative, tolerance {TOLERANCE[options.dtype]:g})")
    return 0
