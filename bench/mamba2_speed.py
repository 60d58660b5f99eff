"""Decode speed of a Mamba-2 of the shipped model's size through the cache, next to the shipped Mamba-1.

    python bench/mamba2_speed.py            # ~1 min on 2 cores
    python bench/mamba2_speed.py --quick    # fewer tokens

The Mamba-2 has the shipped model's n_embd (128), layers (4), d_inner (256)
and d_conv (4), in 8 heads of 32 channels, one group, d_state 16 (the same
s row as the shipped model) — random weights, since only the arithmetic
matters here.  Measured as ``generate_speed.py`` measures (greedy, one
``init_batch`` and ``model.forward`` per step), float32 compute, f32 states.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from generate_speed import decode_rate  # noqa: E402

from bench.quick import NOTE, add_quick_option  # noqa: E402

from recurrent_cache.models import random_mamba2_model, trained_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_quick_option(parser, "30 decode steps, one run")
    parser.add_argument("--repeats", type=int, help="runs per row (default 3; 1 with --quick)")
    options = parser.parse_args()
    if options.quick:
        print(NOTE)
    options.repeats = options.repeats or (1 if options.quick else 3)
    steps = 30 if options.quick else 300
    mamba2 = random_mamba2_model(seed=0, n_vocab=256, n_embd=128, n_layer=4, d_state=16, d_conv=4, head_dim=32,
                                 dtype=np.float32)
    print(f"{'model':<8} {'sequences':>9} {'tokens/s (median)':>18} {'min-max':>14}")
    for label, model in (("mamba", trained_model(np.float32)), ("mamba2", mamba2)):
        for n_seqs in (1, 8):
            rates = [decode_rate(model, n_seqs, steps) for _ in range(options.repeats)]
            print(f"{label:<8} {n_seqs:>9} {statistics.median(rates):>18,.1f} "
                  f"{min(rates):>6,.0f}-{max(rates):<7,.0f}")
        print(f"  ({model.hparams.describe()})")
    print(f"(greedy, {steps} decode steps per run, {options.repeats} runs, float32 compute, f32 states)")


if __name__ == "__main__":
    main()
