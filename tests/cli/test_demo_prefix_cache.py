"""``python -m recurrent_cache demo --prefix-cache`` runs, saves prefill, verifies itself, and can fail."""

from __future__ import annotations

import re

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache.cli import demo
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


# -- --store: the second run restores the first run's prefixes ------------------------------

def store_line(out: str) -> tuple[int, int]:
    """(restores from the store, prompt tokens computed) of a --store run."""
    restores = int(re.search(r"^store .*: (\d+) restores from it", out, re.MULTILINE).group(1))
    computed = int(re.search(r"^prefill\s+(\d+) of", out, re.MULTILINE).group(1))
    return restores, computed


def run_twice(capsys, spec: str, second_options: tuple[str, ...] = ()) -> list[str]:
    outs = []
    for options in ((), second_options):
        assert demo.main(SMALL + ["--store", spec, *options]) == 0
        outs.append(capsys.readouterr().out)
        assert "verification     PASSED: 24 of 24 requests" in outs[-1]
    return outs


def test_second_run_restores_the_first_runs_prefixes_from_a_directory(capsys, tmp_path):
    first, second = run_twice(capsys, str(tmp_path / "states"))
    (hits_1, computed_1), (hits_2, computed_2) = store_line(first), store_line(second)
    assert hits_1 == 0 and hits_2 >= 4          # a new process: the first turns come from the store
    assert computed_2 < computed_1
    assert re.search(r"namespace\s+mamba1 weights-sha256 [0-9a-f]{64} compute f(?:32|64)", second)


def test_second_run_restores_the_first_runs_prefixes_from_redis(capsys, redis_server):
    first, second = run_twice(capsys, redis_server.url)
    assert store_line(first)[0] == 0 and store_line(second)[0] >= 4
    assert store_line(second)[1] < store_line(first)[1]


def test_another_model_finds_nothing_in_the_store(capsys, tmp_path):
    """f64 arithmetic gives other states than the default f32: another namespace, no restores."""
    first, second = run_twice(capsys, str(tmp_path / "states"), ("--compute", "f64"))
    assert store_line(second)[0] == 0 and "compute f64" in second


def test_a_store_it_cannot_use_is_one_line(capsys, tmp_path):
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    assert demo.main(SMALL + ["--store", str(not_a_directory)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("demo: --store: DirectoryStore cannot use ")
    assert str(not_a_directory) in err
