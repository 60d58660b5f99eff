"""``python -m recurrent_cache demo --speculative K``: speculative decoding on a recurrent model.

Every running client drafts up to K tokens by *prompt lookup* — the tokens that
followed the most recent earlier occurrence of its last n-gram (n = 3, 2, 1) in
its own prompt and output; no second model — and the model verifies all the
clients' ``1 + K`` tokens in one batch.  The accepted drafts are kept, plus the
model's own token at the first mismatch; the rest is rolled back with
``seq_rm(seq, p0, -1)``, which the cache answers from its history
(``n_rollback = K``, SPEC §7) with no recomputation.

Decoding is greedy, so the output must be token-for-token the plain decoding's:
the demo first serves the same clients without speculation, then with it, and
verifies both against every client's solo run.  It reports the acceptance rate,
tokens per model step and the throughput of both.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import deque

import numpy as np

import recurrent_cache as rc

from .options import USER_ERROR
from .demo import (CLIENTS_LISTED, TOLERANCE, Client, NoProgress, Server, make_clients, model_name,
                   serve_queue, shown_prompt, shown_tokens, verify)
from ..models import MambaModel

NGRAMS = (3, 2, 1)   # the suffix lengths prompt lookup tries, longest first


def draft(history: list[int], k: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest
    suffix n-gram of ``history`` (prompt lookup decoding); [] when none occurs earlier."""
    for n in NGRAMS:
        if len(history) <= n:
            continue
        suffix = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == suffix:
                return history[start + n:start + n + k]
    return []


@dataclasses.dataclass
class SpeculationStats:
    drafted: int = 0      # draft tokens proposed
    accepted: int = 0     # draft tokens the model agreed with
    rollbacks: int = 0    # seq_rm calls that rolled a sequence back
    verify_steps: int = 0  # init_batch steps after the prompts


class SpeculativeServer(Server):
    """The demo's server, verifying every client's drafts in its decode steps."""

    def __init__(self, model: MambaModel, cache: rc.RecurrentCache, n_ubatch: int, k: int) -> None:
        super().__init__(model, cache, n_ubatch, NoProgress())
        self.k = k
        self.speculation = SpeculationStats()

    def step(self) -> None:
        stats, cache = self.stats, self.cache
        tokens: list[int] = []
        pos: list[int] = []
        seq_id: list[int] = []
        output: list[bool] = []
        fed: dict[int, tuple[Client, list[int]]] = {}   # batch index of a client's first token
        for client in self.running.values():
            if client.n_cached == 0:
                feed, drafts = client.prompt, []
                stats.prompt_tokens += len(feed)
            else:
                room = client.n_predict - len(client.tokens) - 1   # drafts beyond n_predict are useless
                drafts = draft(client.prompt + client.tokens, min(self.k, room)) if room > 0 else []
                feed = [client.tokens[-1]] + drafts
                stats.decode_tokens += len(feed)
                self.speculation.drafted += len(drafts)
            fed[len(tokens)] = (client, drafts)
            tokens += feed
            pos += range(client.n_cached, client.n_cached + len(feed))
            seq_id += [client.slot] * len(feed)
            # a prompt needs its last logits; a verification needs every position's
            output += [False] * (len(feed) - 1) + [True] if not drafts else [True] * len(feed)
        with stats.timing("cache"):
            st = cache.init_batch(rc.Batch(token=tokens, pos=pos, seq_id=seq_id, logits=output), self.n_ubatch)
        logits_of: dict[int, np.ndarray] = {}
        rows = []
        for _ in st:
            stats.peak_used = max(stats.peak_used, cache.used)
            with stats.timing("model"):
                rows.append(self.model.forward_ubatch(st))
            stats.ubatches += 1
        for row, batch_index in zip(np.concatenate(rows), st.out_ids.tolist()):
            logits_of[batch_index] = row
        stats.steps += 1
        if any(client.n_cached for client, _ in fed.values()):
            self.speculation.verify_steps += 1
        for first, (client, drafts) in fed.items():
            self.settle(client, drafts, first, logits_of)

    def settle(self, client: Client, drafts: list[int], first: int, logits_of: dict[int, np.ndarray]) -> None:
        """Keep the drafts the model agrees with and its own next token; roll the rest back."""
        if client.n_cached == 0:   # the prompt
            client.n_cached = len(client.prompt)
            client.accept(logits_of[first + len(client.prompt) - 1])
            return
        accepted = 0
        while accepted < len(drafts):
            logits = logits_of[first + accepted]
            if client.sampler(logits) != drafts[accepted]:
                break
            client.last_logits = logits
            client.tokens.append(drafts[accepted])
            accepted += 1
        self.speculation.accepted += accepted
        # the inputs that stand: the last token and the accepted drafts
        client.n_cached += 1 + accepted
        if accepted < len(drafts):
            with self.stats.timing("cache"):
                rolled_back = self.cache.seq_rm(client.slot, client.n_cached, -1)
            if not rolled_back:
                raise RuntimeError(f"seq_rm({client.slot}, {client.n_cached}, -1) could not roll back "
                                   f"{len(drafts) - accepted} rejected draft tokens")
            self.speculation.rollbacks += 1
        if not client.done:
            client.accept(logits_of[first + accepted])


def serve(model: MambaModel, options: argparse.Namespace, clients: list[Client], k: int) -> tuple[Server, float]:
    cache = model.new_cache(n_seq_max=options.parallel, dtype=options.dtype, n_rollback=k)
    server: Server = SpeculativeServer(model, cache, options.ubatch, k) if k else \
        Server(model, cache, options.ubatch, NoProgress())
    start = time.perf_counter()
    if k:
        waiting = deque(clients)
        while waiting or server.running:
            while waiting and server.free_slots:
                server.admit(waiting.popleft())
            server.step()
            server.end_step()
    else:
        serve_queue(server, clients)
    return server, time.perf_counter() - start


def main(options: argparse.Namespace, model: MambaModel) -> int:
    """The two runs, the report and the verification; the exit status."""
    greedy = argparse.Namespace(**{**vars(options), "temperature": 0.0})
    try:
        runs = {}
        for k in (0, options.speculative):
            clients = make_clients(greedy, model, np.random.default_rng(options.seed))
            runs[k] = (clients, *serve(model, options, clients, k))
    except (MemoryError, rc.RecurrentCacheError) as exc:
        print(f"demo: cannot serve {options.parallel} sequences with n_rollback {options.speculative}: {exc}",
              file=sys.stderr)
        return USER_ERROR
    plain_clients, plain, plain_seconds = runs[0]
    clients, server, seconds = runs[options.speculative]
    spec = server.speculation
    generated = sum(len(client.tokens) for client in clients)
    print(f"model            {model.hparams.describe()} ({model_name(options)})")
    print(f"cache            {options.parallel} cells, {options.dtype} states, n_rollback {options.speculative}, "
          f"n_ubatch {options.ubatch}")
    print(f"clients          {len(clients)} ({options.parallel} at a time), greedy, drafts of up to "
          f"{options.speculative} tokens by prompt lookup")
    for client in clients[:CLIENTS_LISTED]:
        print(f"  client {client.number:<3} prompt {len(client.prompt):>3} tokens {shown_prompt(model, client.prompt)}"
              f" -> {shown_tokens(model, client.tokens)}")
    if len(clients) > CLIENTS_LISTED:
        print(f"  ... and {len(clients) - CLIENTS_LISTED} more")
    rate = spec.accepted / spec.drafted if spec.drafted else 0.0
    print(f"drafts           {spec.drafted} drafted, {spec.accepted} accepted ({100 * rate:.1f}%), "
          f"{spec.rollbacks} rollbacks")
    plain_decode = plain.stats.steps - 1 if plain.stats.steps else 0
    print(f"model steps      {server.stats.steps} init_batch ({spec.verify_steps} verifying) vs "
          f"{plain.stats.steps} without speculation")
    per_step = generated / max(1, server.stats.steps)
    plain_per_step = generated / max(1, plain.stats.steps)
    print(f"tokens per step  {per_step:.2f} vs {plain_per_step:.2f} ({plain_decode} plain decode steps)")
    print(f"throughput       {generated / seconds:.0f} generated tokens/s ({seconds:.2f} s) vs "
          f"{generated / plain_seconds:.0f} without speculation ({plain_seconds:.2f} s): "
          f"{plain_seconds / seconds:.2f}x")
    problems = []
    for served, alone in zip(clients, plain_clients):
        if served.tokens != alone.tokens:
            problems.append(f"client {served.number}: speculative tokens {served.tokens} differ from plain "
                            f"decoding's {alone.tokens}")
    for run in (plain_clients, clients):
        found, worst = verify(model, run, options.dtype)
        problems += found
    if problems:
        print("verification     FAILED")
        print("\n*** VERIFICATION FAILED: speculative decoding differs from plain decoding ***", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    print(f"verification     PASSED: {len(clients)} of {len(clients)} clients token-identical to plain greedy "
          f"decoding and to their solo runs (last logits within {worst:.1e} relative, "
          f"tolerance {TOLERANCE[options.dtype]:g})")
    return 0


__all__ = ["draft", "main", "SpeculativeServer"]
