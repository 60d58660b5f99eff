"""The eviction policy on bench/prefix_cache.py's trace: never more prefill recomputed than the
best simulated anchor (no cache, leaf-only, block grid, whole-prompt LRU) at any budget tried.

Token counts only (no timing): deterministic for the seeded trace.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "prefix_cache.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_prefix_cache", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("seed", [0, 1])
def test_prefix_cache_never_recomputes_more_than_an_anchor(bench, seed):
    trace = bench.make_trace(200, seed)
    total = sum(len(r.prompt) for r in trace)
    strictly_better = set()
    for budget in (2, 8, 32, 128):
        results = {name: run(trace, budget, 256) for name, run in bench.POLICIES.items()}
        ours = results.pop("PrefixCache")
        assert results["no cache"] == total
        assert ours <= min(results.values()), (budget, ours, results)
        strictly_better |= {name for name, theirs in results.items() if ours < theirs}
    assert strictly_better == set(bench.POLICIES) - {"PrefixCache"}
