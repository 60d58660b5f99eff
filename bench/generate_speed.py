"""Decode speed of the shipped byte-level Mamba through the cache: 1 sequence and 8 concurrent ones.

    python bench/generate_speed.py            # ~20 s on 2 cores
    python bench/generate_speed.py --quick    # fewer tokens, one run

Each measurement feeds a prompt, then generates greedily one token per
sequence per step: one ``init_batch`` per step (8 sequences: one ubatch of 8
groups, the model's matrix products batched over them) and ``model.forward``.
Printed: tokens/s (median of the repeats, min-max), and the ratio to the
targets of issue 13 (200 tokens/s for one sequence, 1,000 summed over 8).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import recurrent_cache as rc
from recurrent_cache.models import held_out_prompts, trained_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the repository root, for bench.quick
from bench.quick import NOTE, add_quick_option  # noqa: E402

TARGETS = {1: 200.0, 8: 1000.0}


def greedy(model, st) -> list[int]:
    """The argmax token of each output, in batch order (logits row i is batch index st.out_ids[i])."""
    logits = model.forward(st)
    row_of_batch_index = np.argsort(st.out_ids)
    return [int(logits[row].argmax()) for row in row_of_batch_index]


def decode_rate(model, n_seqs: int, n_steps: int) -> float:
    """Generated tokens per second, summed over ``n_seqs`` sequences decoding together."""
    prompts = [model.vocab.encode(text) for text in held_out_prompts()[:n_seqs]]
    cache = model.new_cache(n_seq_max=n_seqs)
    tokens = [t for p in prompts for t in p]
    pos = [i for p in prompts for i in range(len(p))]
    seq_id = [s for s, p in enumerate(prompts) for _ in p]
    last = [i == len(p) - 1 for p in prompts for i in range(len(p))]
    next_tokens = greedy(model, cache.init_batch(rc.Batch(token=tokens, pos=pos, seq_id=seq_id, logits=last), 512))
    positions = np.array([len(p) for p in prompts])
    seq_ids = list(range(n_seqs))
    start = time.perf_counter()
    for _ in range(n_steps):
        st = cache.init_batch(rc.Batch(token=next_tokens, pos=positions, seq_id=seq_ids, logits=[1] * n_seqs),
                              n_seqs)
        next_tokens = greedy(model, st)
        positions = positions + 1
    return n_seqs * n_steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_quick_option(parser, "20 decode steps in one run instead of 300 in three")
    parser.add_argument("--repeats", type=int, help="runs per figure (default 3; 1 with --quick)")
    options = parser.parse_args()
    if options.quick:
        print(NOTE)
    steps = 20 if options.quick else 300
    options.repeats = options.repeats or (1 if options.quick else 3)
    print(f"{'compute':<8} {'sequences':>9} {'tokens/s (median)':>18} {'min-max':>14} {'target':>7} {'ratio':>6}")
    for compute in (np.float32, np.float64):
        model = trained_model(dtype=compute)
        for n_seqs in (1, 8):
            rates = [decode_rate(model, n_seqs, steps) for _ in range(options.repeats)]
            median = statistics.median(rates)
            print(f"{np.dtype(compute).name:<8} {n_seqs:>9} {median:>18,.0f} {min(rates):>6,.0f}-{max(rates):<7,.0f} "
                  f"{TARGETS[n_seqs]:>7,.0f} {median / TARGETS[n_seqs]:>5.1f}x")
    print(f"({model.hparams.describe()}; greedy, {steps} decode steps per run, {options.repeats} runs)")


if __name__ == "__main__":
    main()
