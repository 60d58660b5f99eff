"""``python -m recurrent_cache demo --speculative K``: speculative decoding on a recurrent model.

Every running client drafts up to K tokens by *prompt lookup* — the tokens that
followed the most recent earlier occurrence of its last n-gram (n = 3, 2, 1) in
its own prompt and output; no second model — and the model verifies all the
clients' ``1 + K`` tokens in one batch (the package's ``Generator`` with
``draft=prompt_lookup``).  The accepted drafts are kept, plus the
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
import time

from ..generation import Generator, prompt_lookup as draft
from ..models import LanguageModel
from .clients import make_clients, print_clients
from .model_options import model_name, where_states_live
from .serving import Client, Served, new_cache, serve
from .verification import TOLERANCE, fail, verify

__all__ = ["draft", "run", "serve_greedy"]

def serve_greedy(model: LanguageModel, options: argparse.Namespace, k: int,
                 corrupt_step: int | None = None) -> tuple[list[Client], Generator, Served, float]:
    """The demo's clients, greedy, served with prompt-lookup drafts of up to ``k`` tokens (0: plain
    decoding): the clients, the generator (its stats say what speculation did), what it served, and
    the seconds it took."""
    clients = make_clients(model, options.clients, options.n_predict, 0.0, 0, options.seed)
    cache = new_cache(model, options.parallel, options.dtype, n_rollback=k, storage=options.storage,
                      device=options.device)
    generator = Generator(model, cache, n_ubatch=options.ubatch, draft=draft if k else None, n_draft=k)
    start = time.perf_counter()
    served = serve(generator, clients, corrupt_step=corrupt_step)
    seconds = time.perf_counter() - start
    return clients, generator, served, seconds


def run(options: argparse.Namespace, model: LanguageModel) -> int:
    """The two runs, the report and the verification; the exit status."""
    k = options.speculative
    plain_clients, plain, _, plain_seconds = serve_greedy(model, options, 0)
    clients, server, speculative_run, seconds = serve_greedy(model, options, k, options.corrupt_step)
    spec = server.stats
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
    if speculative_run.corruption:
        print(f"testing          {speculative_run.corruption}")
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
