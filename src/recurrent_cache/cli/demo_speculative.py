"""``python -m recurrent_cache demo --speculative K``: speculative decoding on a recurrent model.

Every running client drafts up to K tokens by *prompt lookup* — the tokens that
followed the most recent earlier occurrence of its last n-gram (n = 3, 2, 1) in
its own prompt and output; no second model — and the model verifies all the
clients' ``1 + K`` tokens in one batch.  The accepted drafts are kept, plus the
model's own token at the first mismatch; the rest is rolled back with
``seq_rm(seq, p0, -1)``, which the cache answers from its history
(``n_rollback = K``, docs/rollback.md) with no recomputation.

Decoding is greedy, so the output must be token-for-token the plain decoding's:
the demo first serves the same clients without speculation, then with it, and
verifies both against every client's solo run.  It reports the acceptance rate,
tokens per model step and the throughput of both.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

import recurrent_cache as rc

from ..models import RecurrentModel
from .clients import make_clients, print_clients
from .model_options import model_name, where_states_live
from .serving import Client, Feed, Server, new_cache
from .verification import TOLERANCE, fail, verify

__all__ = ["SpeculativeServer", "draft", "run"]

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
    """The serving loop, verifying every client's drafts in its decode steps."""

    def __init__(self, model: RecurrentModel, cache: rc.RecurrentCache, n_ubatch: int, k: int,
                 corrupt_step: int | None = None) -> None:
        super().__init__(model, cache, n_ubatch, corrupt_step=corrupt_step)
        self.k = k
        self.speculation = SpeculationStats()

    def step(self) -> None:
        if any(client.prefilled for client in self.running.values()):
            self.speculation.verify_steps += 1
        super().step()

    def feed(self, client: Client) -> Feed:
        """The prompt; then the last token and up to K drafts, every position with logits."""
        if not client.prefilled:
            return super().feed(client)
        room = client.n_predict - len(client.tokens) - 1   # drafts beyond n_predict are useless
        drafts = draft(client.prompt + client.tokens, min(self.k, room)) if room > 0 else []
        self.speculation.drafted += len(drafts)
        return Feed(client, client.tokens[-1:] + drafts, "all" if drafts else "last")

    def settle(self, feed: Feed, rows: list[np.ndarray]) -> None:
        """Keep the drafts the model agrees with and its own next token; roll the rest back."""
        client = feed.client
        if not client.prefilled:   # the prompt
            super().settle(feed, rows)
            return
        drafts = feed.tokens[1:]
        accepted = 0
        while accepted < len(drafts):
            logits = rows[accepted]
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
            client.accept(rows[accepted])


def serve(model: RecurrentModel, options: argparse.Namespace, k: int,
          corrupt_step: int | None = None) -> tuple[list[Client], Server, SpeculationStats, float]:
    """The demo's clients, greedy, served with drafts of up to ``k`` tokens (0: plain decoding):
    the clients, the server, what speculation did, and the seconds it took."""
    clients = make_clients(model, options.clients, options.n_predict, 0.0, 0, options.seed)
    cache = new_cache(model, options.parallel, options.dtype, n_rollback=k, storage=options.storage,
                      device=options.device)
    server = (SpeculativeServer(model, cache, options.ubatch, k, corrupt_step) if k else
              Server(model, cache, options.ubatch, corrupt_step=corrupt_step))
    start = time.perf_counter()
    server.serve(clients)
    seconds = time.perf_counter() - start
    speculation = server.speculation if isinstance(server, SpeculativeServer) else SpeculationStats()
    return clients, server, speculation, seconds


def run(options: argparse.Namespace, model: RecurrentModel) -> int:
    """The two runs, the report and the verification; the exit status."""
    k = options.speculative
    plain_clients, plain, _, plain_seconds = serve(model, options, 0)
    clients, server, spec, seconds = serve(model, options, k, options.corrupt_step)
    generated = sum(len(client.tokens) for client in clients)
    print(f"model            {model.hparams.describe()} ({model_name(options)})")
    print(f"cache            {options.parallel} cells, {options.dtype} states{where_states_live(options)}, "
          f"n_rollback {k}, n_ubatch {options.ubatch}")
    print(f"clients          {len(clients)} ({options.parallel} at a time), greedy, drafts of up to "
          f"{k} tokens by prompt lookup")
    print_clients(model, clients, samplers=False)
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
    if server.corruption:
        print(f"testing          {server.corruption}")
    problems = []
    for served, alone in zip(clients, plain_clients):
        if served.tokens != alone.tokens:
            problems.append(f"client {served.number}: speculative tokens {served.tokens} differ from plain "
                            f"decoding's {alone.tokens}")
    worst = 0.0
    for run_clients in (plain_clients, clients):
        found, difference = verify(model, run_clients, options.dtype)
        problems += found
        worst = max(worst, difference)
    if problems:
        return fail("", "speculative decoding differs from plain decoding", problems)
    print(f"verification     PASSED: {len(clients)} of {len(clients)} clients token-identical to plain greedy "
          f"decoding and to their solo runs (last logits within {worst:.1e} relative, "
          f"tolerance {TOLERANCE[options.dtype]:g})")
    return 0
