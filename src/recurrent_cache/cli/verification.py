"""How every ``demo`` mode checks itself: each client against its solo run, loudly.

A solo run is the client's prompt and generation fed token by token to the
model's reference run (``model.reference_run``: a Mamba model without a cache, a hybrid
one alone on its own memory) from a zero state.  The
served tokens must be identical and the last logits equal within
``TOLERANCE``; otherwise the mode prints ``VERIFICATION FAILED`` and the
command exits with status 1.
"""

from __future__ import annotations

import sys

import numpy as np

from ..models import LanguageModel
from .serving import Client

__all__ = ["TOLERANCE", "fail", "relative_difference", "run_alone", "verify"]

# Largest accepted max|logits - solo logits| / max|solo logits| per state dtype.
# The batched and the solo run round their states at the same points (every
# token), so they agree far below these bounds; the slack for f16/bf16 covers
# one stored element rounding the other way after float noise of a different
# summation order, which moves logits by about one unit in the last place of
# that storage type.
TOLERANCE = {"f32": 1e-5, "f16": 1e-3, "bf16": 1e-2}


def run_alone(model: LanguageModel, client: Client, state_dtype: str) -> tuple[list[int], np.ndarray]:
    """The client's prompt and generation on a fresh reference run: (tokens, last logits)."""
    run = model.reference_run(state_dtype)
    sampler = client.sampler.fresh()
    logits = run.feed(client.prompt)[-1]
    tokens = [sampler(logits)]
    while len(tokens) < client.n_predict:
        logits = run.feed(tokens[-1:])[-1]
        tokens.append(sampler(logits))
    return tokens, logits


def relative_difference(served: np.ndarray | None, alone: np.ndarray) -> float:
    """max|served - alone| / max|alone|; infinite when nothing was served."""
    if served is None:
        return float("inf")
    return float(np.max(np.abs(served - alone)) / np.max(np.abs(alone)))


def verify(model: LanguageModel, clients: list[Client], state_dtype: str) -> tuple[list[str], float]:
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
        difference = relative_difference(client.last_logits, logits)
        worst = max(worst, difference)
        if not difference <= tolerance:
            problems.append(f"client {client.number}: last logits differ from its solo run by "
                            f"{difference:.3g} (relative; tolerance {tolerance:g})")
    return problems, worst


def fail(verdict: str, what: str, problems: list[str]) -> int:
    """Report a failed verification: the report's line, the banner and every problem on stderr; 1."""
    print(f"verification     FAILED{verdict}")
    print(f"\n*** VERIFICATION FAILED: {what} ***", file=sys.stderr)
    for problem in problems:
        print(f"  {problem}", file=sys.stderr)
    return 1
