"""``python -m recurrent_cache demo --prefix-cache``: clients sharing prompts, served through PrefixCache.

``--clients`` conversations of ``TURNS`` turns each.  Every conversation
starts with one of ``N_SYSTEM_PROMPTS`` system prompts; each turn adds a few
user tokens to everything said so far and generates ``--n-predict`` tokens
greedily.  Turns are requests, served with continuous batching on
``--parallel`` sequence slots: a request that finishes frees its slot and
queues its conversation's next turn behind the other clients' requests.

Each request first ``restore``s the longest prefix the ``PrefixCache`` holds
(a shared system prompt, or the whole previous turn), then prefills the rest
in chunks that end at ``plan``'s cuts (the block grid, junctions with earlier
prompts, the end of the prompt), ``save``-ing at each, in the same
``init_batch`` steps as the other clients' chunks and decode tokens.  After
generating it saves the conversation so far, for the next turn.

The same requests are served a second time without the prefix cache (every
prompt computed whole), and every request of both runs is checked against
its solo run (``ReferenceRun``, token by token from a zero state): tokens
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
from dataclasses import dataclass

import numpy as np

import recurrent_cache as rc

from ..models import RecurrentModel, ReferenceRun, Sampler
from .model_options import model_identity, model_name, where_states_live
from .options import USER_ERROR
from .serving import Client, Server, new_cache
from .verification import TOLERANCE, fail, relative_difference

__all__ = ["ConversationServer", "Turn", "make_conversations", "run"]

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
    restored: int = 0   # prompt tokens restored from a snapshot


class ConversationServer(Server):
    """Turns of conversations as requests: each restores its longest cached prefix, prefills the
    rest in chunks that end at the prefix cache's cuts (saving at each), and queues its
    conversation's next turn when done.  Without a prefix cache, every prompt is computed whole."""

    def __init__(self, model: RecurrentModel, cache: rc.RecurrentCache, n_ubatch: int,
                 conversations: list[list[list[int]]], prefix_cache: rc.PrefixCache | None,
                 corrupt_step: int | None = None) -> None:
        super().__init__(model, cache, n_ubatch, corrupt_step=corrupt_step)
        self.conversations = conversations
        self.prefix_cache = prefix_cache
        self.served: list[Turn] = []   # the finished turns, in order

    def serve_conversations(self, n_predict: int) -> None:
        """Every conversation, turn after turn, greedily."""
        self.serve(Turn(number, turns[0], n_predict, Sampler()) for number, turns in enumerate(self.conversations))

    def admit(self, client: Client) -> None:
        super().admit(client)
        turn = self.as_turn(client)
        self.cache.seq_rm(turn.slot, -1, -1)
        if self.prefix_cache is not None:
            turn.restored = turn.n_cached = self.prefix_cache.restore(turn.slot, turn.prompt)
            turn.cuts = self.prefix_cache.plan(turn.prompt, turn.n_cached)

    def finish(self, client: Client) -> list[Client]:
        """Save the conversation so far; its next turn, if any."""
        turn = self.as_turn(client)
        self.served.append(turn)
        if self.prefix_cache is not None:   # the state covers the prompt and every generated token but the last
            self.prefix_cache.save(turn.slot, turn.prompt + turn.tokens[:-1])
        turns = self.conversations[turn.number]
        if turn.turn + 1 == len(turns):
            return []
        prompt = turn.prompt + turn.tokens + turns[turn.turn + 1]
        return [Turn(turn.number, prompt, turn.n_predict, Sampler(), turn=turn.turn + 1)]

    @staticmethod
    def as_turn(client: Client) -> Turn:
        """``client``, which this server only ever admits as a ``Turn``."""
        if not isinstance(client, Turn):
            raise TypeError(f"a conversation serves turns, not {client!r}")
        return client

    def end_step(self) -> list[Client]:
        follow_ups = super().end_step()
        if self.prefix_cache is not None:
            for client in self.running.values():   # a chunk ended at a cut: snapshot it
                if client.cuts and client.n_cached == client.cuts[0]:
                    self.prefix_cache.save(client.slot, client.prompt[:client.n_cached])
                    client.cuts.pop(0)
        return follow_ups


def serve(model: RecurrentModel, options: argparse.Namespace, conversations: list[list[list[int]]],
          prefix_cache: bool, store: rc.stores.DirectoryStore | rc.stores.RedisStore | None = None,
          namespace: str = "") -> tuple[ConversationServer, float, dict[str, int]]:
    """All turns of all conversations through one cache, with or without a PrefixCache (and its
    store): the server, the seconds it took, and the prefix cache's stats."""
    cache = new_cache(model, options.parallel, options.dtype, storage=options.storage,
                      device=options.device)
    pc = (rc.PrefixCache(cache, MAX_BYTES, block_size=BLOCK_SIZE, store=store, namespace=namespace)
          if prefix_cache else None)
    server = ConversationServer(model, cache, options.ubatch, conversations, pc,
                                options.corrupt_step if prefix_cache else None)
    start = time.perf_counter()
    server.serve_conversations(options.n_predict)
    seconds = time.perf_counter() - start
    return server, seconds, pc.stats() if pc is not None else {}


def verify(model: RecurrentModel, runs: list[list[Turn]], conversations: list[list[list[int]]], n_predict: int,
           dtype: str) -> tuple[list[str], float]:
    """Every request of every run against its solo run: (problems, largest relative logits difference)."""
    solo: dict[tuple[int, int], tuple[list[int], np.ndarray]] = {}
    for client, turns in enumerate(conversations):
        reference = ReferenceRun(model, dtype, dtype)   # one conversation, token by token
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


def run(options: argparse.Namespace, model: RecurrentModel) -> int:
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
    with_pc, with_seconds, stats = serve(model, options, conversations, prefix_cache=True, store=store,
                                         namespace=namespace)
    without, without_seconds, _ = serve(model, options, conversations, prefix_cache=False)
    requests = with_pc.served
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
          f"held, {stats['saves']} saves, {stats['evictions']} evicted")
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
          f"cache, {without.stats.prompt_tokens} without: {saved} saved ({100.0 * saved / prompt_tokens:.1f}%)")
    served = prompt_tokens + n_requests * options.n_predict
    print(f"throughput       {served / with_seconds:.0f} tokens/s with the prefix cache ({with_seconds:.2f} s), "
          f"{served / without_seconds:.0f} without ({without_seconds:.2f} s): {without_seconds / with_seconds:.2f}x "
          f"(prompt + generated tokens served per second)")
    if with_pc.corruption:
        print(f"testing          {with_pc.corruption}")
    problems, worst = verify(model, [requests, without.served], conversations, options.n_predict, options.dtype)
    if problems:
        return fail(f": {len(problems)} mismatches with the solo runs",
                    "served requests differ from running each conversation alone", problems)
    print(f"verification     PASSED: {2 * n_requests} of {2 * n_requests} requests ({n_requests} with, {n_requests} "
          f"without the prefix cache) equal their solo runs (tokens identical, last logits within {worst:.1e} "
          f"relative, tolerance {TOLERANCE[options.dtype]:g})")
    return 0
