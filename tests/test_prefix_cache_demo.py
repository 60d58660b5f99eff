"""``python -m recurrent_cache demo --prefix-cache`` runs, saves prefill, verifies itself, and can fail."""

from __future__ import annotations

import re

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache import demo

SMALL = ["--clients", "4", "--parallel", "2", "--n-predict", "3", "--ubatch", "8", "--quiet", "--prefix-cache"]


def test_prefix_cache_run_passes_and_saves_prefill(capsys):
    assert demo.main(SMALL) == 0
    out = capsys.readouterr().out
    for label in ("clients", "prefix cache", "hit rate", "prefill", "throughput", "verification"):
        assert re.search(rf"^{label} ", out, re.MULTILINE), f"report lacks {label!r}:\n{out}"
    assert "verification     PASSED: 24 of 24 requests (12 with, 12 without the prefix cache)" in out
    hits, requests = map(int, re.search(r"hit rate\s+(\d+) of (\d+) requests", out).groups())
    assert requests == 12 and hits >= 8   # every later turn restores the previous one
    computed, total, without = map(int, re.search(
        r"prefill\s+(\d+) of (\d+) prompt tokens computed with the prefix cache, (\d+) without", out).groups())
    assert without == total and computed < total / 2


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_half_precision_states_pass(capsys, dtype):
    assert demo.main(SMALL + ["--dtype", dtype]) == 0
    assert "PASSED" in capsys.readouterr().out


def test_a_wrong_restored_state_fails_verification(capsys, monkeypatch):
    """If restore placed a wrong state, the served tokens or logits would leave the solo runs."""
    restore = rc.PrefixCache.restore

    def corrupted(self, seq, tokens):
        n = restore(self, seq, tokens)
        if n:
            row = self.cache.cell(seq)[2]
            self.cache.s[0][row] += np.float32(0.5)
        return n

    monkeypatch.setattr(rc.PrefixCache, "restore", corrupted)
    assert demo.main(SMALL) == 1
    captured = capsys.readouterr()
    assert "verification     FAILED" in captured.out
    assert "with the prefix cache" in captured.err and "VERIFICATION FAILED" in captured.err


def test_default_demo_is_unchanged(capsys):
    assert demo.main(SMALL[:-1]) == 0
    out = capsys.readouterr().out
    assert "prefix cache" not in out and "PASSED: 4 of 4 clients" in out
