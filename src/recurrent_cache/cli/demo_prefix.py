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
import hashlib
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import recurrent_cache as rc

from .options import USER_ERROR
from .demo import model_name
from ..models import MambaModel, ReferenceRun

TURNS = 3
N_SYSTEM_PROMPTS = 2
SYSTEM_PROMPT_LENGTHS = (48, 96)   # inclusive ranges of random token counts
USER_LENGTHS = (4, 16)
BLOCK_SIZE = 32
MAX_BYTES = 4 << 20                 # the prefix cache's budget
TOLERANCE = {"f32": 1e-5, "f16": 1e-3, "bf16": 1e-2}  # as the main demo's verification


@dataclass(eq=False)
class Request:
    """One turn of one conversation."""

    client: int
    turn: int
    prompt: list[int]
    n_predict: int
    tokens: list[int] = field(default_factory=list)   # generated
    last_logits: np.ndarray | None = None
    slot: int = -1
    done: int = 0                 # prompt tokens whose effect is in the state
    cuts: list[int] = field(default_factory=list)     # where to stop the prefill next and save
    restored: int = 0             # prompt tokens restored from a snapshot


@dataclass
class Run:
    """What one serving run did."""

    requests: list[Request] = field(default_factory=list)
    prompt_tokens: int = 0        # prompt tokens of every request
    computed: int = 0             # prompt tokens run through the model
    steps: int = 0
    seconds: float = 0.0
    stats: dict[str, int] = field(default_factory=dict)


def make_conversations(options: argparse.Namespace, n_vocab: int) -> list[list[list[int]]]:
    """Per client, the user tokens of each turn; the first turn starts with a system prompt."""
    rng = np.random.default_rng(options.seed)

    def text(bounds: tuple[int, int]) -> list[int]:
        return rng.integers(0, n_vocab, int(rng.integers(bounds[0], bounds[1] + 1))).tolist()

    systems = [text(SYSTEM_PROMPT_LENGTHS) for _ in range(N_SYSTEM_PROMPTS)]
    return [[systems[client % N_SYSTEM_PROMPTS] + text(USER_LENGTHS)] + [text(USER_LENGTHS) for _ in range(TURNS - 1)]
            for client in range(options.clients)]


def model_identity(options: argparse.Namespace, model: MambaModel) -> str:
    """The store namespace: what the states depend on besides the tokens and the cache geometry.

    The sha256 of the GGUF file, or (random or built-in weights) of the weights
    themselves; and the arithmetic, which changes the states too.
    """
    digest = hashlib.sha256()
    if options.model:
        with open(options.model, "rb") as file:
            for chunk in iter(lambda: file.read(1 << 20), b""):
                digest.update(chunk)
        source = "gguf"
    else:
        for layer in model.layers:
            for weights in vars(layer).values():
                digest.update(np.ascontiguousarray(weights).tobytes())
        for weights in (model.token_embd, model.output_norm, model.output):
            digest.update(np.ascontiguousarray(weights).tobytes())
        source = "weights"
    return f"mamba1 {source}-sha256 {digest.hexdigest()} compute {options.compute}"


def serve(model: MambaModel, options: argparse.Namespace, conversations: list[list[list[int]]],
          use_prefix_cache: bool, store: Any = None, namespace: str = "") -> Run:
    """All turns of all conversations through one cache, with or without a PrefixCache (and its store)."""
    cache = model.new_cache(n_seq_max=options.parallel, dtype=options.dtype)
    pc = (rc.PrefixCache(cache, MAX_BYTES, block_size=BLOCK_SIZE, store=store, namespace=namespace)
          if use_prefix_cache else None)
    run = Run()
    free = list(range(options.parallel))
    waiting = deque(Request(c, 0, turns[0], options.n_predict) for c, turns in enumerate(conversations))
    running: list[Request] = []
    start = time.perf_counter()
    while waiting or running:
        while waiting and free:
            request = waiting.popleft()
            request.slot = free.pop(0)
            cache.seq_rm(request.slot, -1, -1)
            if pc is not None:
                request.restored = request.done = pc.restore(request.slot, request.prompt)
                request.cuts = pc.plan(request.prompt, request.done)
            else:
                request.cuts = [len(request.prompt)]
            run.prompt_tokens += len(request.prompt)
            run.computed += len(request.prompt) - request.done
            running.append(request)
        step(model, cache, options.ubatch, running, run)
        for request in [r for r in running if len(r.tokens) >= r.n_predict]:
            if pc is not None:   # the state covers the prompt and every generated token but the last
                pc.save(request.slot, request.prompt + request.tokens[:-1])
            cache.seq_rm(request.slot, -1, -1)
            free.append(request.slot)
            free.sort()
            running.remove(request)
            run.requests.append(request)
            turns = conversations[request.client]
            if request.turn + 1 < len(turns):
                prompt = request.prompt + request.tokens + turns[request.turn + 1]
                waiting.append(Request(request.client, request.turn + 1, prompt, request.n_predict))
        if pc is not None:
            for request in running:   # a chunk ended at a cut: snapshot it
                if request.cuts and request.done == request.cuts[0]:
                    pc.save(request.slot, request.prompt[:request.done])
                    request.cuts.pop(0)
    run.seconds = time.perf_counter() - start
    run.stats = pc.stats() if pc is not None else {}
    return run


def step(model: MambaModel, cache: Any, n_ubatch: int, running: list[Request], run: Run) -> None:
    """One init_batch: each prefilling request's chunk up to its next cut, one token for each decoding one."""
    tokens: list[int] = []
    pos: list[int] = []
    seq_id: list[int] = []
    output: list[bool] = []
    owner: list[Request] = []
    for request in running:
        if request.done < len(request.prompt):
            end = request.cuts[0]
            feed, first = request.prompt[request.done:end], request.done
            wants_logits = end == len(request.prompt)
            request.done = end
        else:
            feed, first = request.tokens[-1:], len(request.prompt) + len(request.tokens) - 1
            wants_logits = True
        tokens += feed
        pos += range(first, first + len(feed))
        seq_id += [request.slot] * len(feed)
        output += [False] * (len(feed) - 1) + [wants_logits]
        owner += [request] * len(feed)
    st = cache.init_batch(rc.Batch(token=tokens, pos=pos, seq_id=seq_id, logits=output), n_ubatch)
    if st.status != rc.MemoryStatus.SUCCESS:
        raise RuntimeError(f"init_batch failed ({st.status.name}) with {len(running)} requests")
    logits = model.forward(st)
    for row, batch_index in zip(logits, st.out_ids):
        request = owner[batch_index]
        request.last_logits = row
        request.tokens.append(int(np.argmax(row)))
    run.steps += 1


def verify(model: MambaModel, runs: list[Run], conversations: list[list[list[int]]], n_predict: int,
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
    for run, name in zip(runs, ("with", "without")):
        for request in run.requests:
            tokens, logits = solo[request.client, request.turn]
            label = f"client {request.client} turn {request.turn} ({name} the prefix cache)"
            if request.tokens != tokens:
                problems.append(f"{label}: generated {request.tokens}, alone {tokens}")
            difference = float(np.max(np.abs(request.last_logits - logits)) / np.max(np.abs(logits)))
            worst = max(worst, difference)
            if not difference <= TOLERANCE[dtype]:
                problems.append(f"{label}: last logits differ from the solo run by {difference:.3g} (relative)")
    return problems, worst


def main(options: argparse.Namespace, model: MambaModel) -> int:
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
    with_pc = serve(model, options, conversations, use_prefix_cache=True, store=store, namespace=namespace)
    without = serve(model, options, conversations, use_prefix_cache=False)
    stats = with_pc.stats
    n_requests = len(with_pc.requests)
    hits = sum(r.restored > 0 for r in with_pc.requests)
    print(f"model            {model.hparams.describe()} ({model_name(options)})")
    print(f"cache            {options.parallel} cells, {options.dtype} states, n_ubatch {options.ubatch}")
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
    saved = with_pc.prompt_tokens - with_pc.computed
    print(f"prefill          {with_pc.computed} of {with_pc.prompt_tokens} prompt tokens computed with the prefix "
          f"cache, {without.computed} without: {saved} saved ({100.0 * saved / with_pc.prompt_tokens:.1f}%)")
    served = with_pc.prompt_tokens + n_requests * options.n_predict
    print(f"throughput       {served / with_pc.seconds:.0f} tokens/s with the prefix cache ({with_pc.seconds:.2f} s), "
          f"{served / without.seconds:.0f} without ({without.seconds:.2f} s): {without.seconds / with_pc.seconds:.2f}x "
          f"(prompt + generated tokens served per second)")
    problems, worst = verify(model, [with_pc, without], conversations, options.n_predict, options.dtype)
    if problems:
        print(f"verification     FAILED: {len(problems)} mismatches with the solo runs")
        print("\n*** VERIFICATION FAILED: served requests differ from running each conversation alone ***",
              file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    print(f"verification     PASSED: {2 * n_requests} of {2 * n_requests} requests ({n_requests} with, {n_requests} "
          f"without the prefix cache) equal their solo runs (tokens identical, last logits within {worst:.1e} "
          f"relative, tolerance {TOLERANCE[options.dtype]:g})")
    return 0
