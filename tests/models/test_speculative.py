"""Speculative decoding through the cache's rollback (SPEC §7, issue 9), with the numpy Mamba:
drafts checked in one batch, the rejected tail rolled back, the output token-identical to
plain greedy decoding and its logits equal to a solo run's."""

from __future__ import annotations

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache.cli import demo
from recurrent_cache.cli.demo_speculative import draft
from recurrent_cache.cli.verification import TOLERANCE
from recurrent_cache.models import ReferenceRun, random_model, trained_model


def test_prompt_lookup_drafts_what_followed_the_last_ngram():
    history = [1, 2, 3, 9, 9, 1, 2, 3]
    assert draft(history, 2) == [9, 9]            # after the earlier "1 2 3"
    assert draft([5, 6, 7, 5], 3) == [6, 7, 5]      # unigram "5"
    assert draft([1, 2, 3], 4) == []                # nothing occurs earlier
    assert draft([4, 4, 4, 4], 2) == [4]            # the most recent earlier occurrence


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("engine", ["compiled", "reference"])
def test_random_drafts_equal_plain_greedy_decoding(dtype, engine):
    """Drafts right or wrong at random: kept tokens, rollbacks and logits equal greedy decoding."""
    model = random_model(seed=3)
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 256, 9).tolist()
    alone = ReferenceRun(model, dtype, dtype)
    logits = alone.feed(prompt)[-1]
    truth, truth_logits = [int(np.argmax(logits))], [logits]
    while len(truth) < 30 + 5:   # room for the last step's accepted drafts
        logits = alone.feed(truth[-1:])[-1]
        truth.append(int(np.argmax(logits)))
        truth_logits.append(logits)

    k = 4
    cache = model.new_cache(n_seq_max=2, dtype=dtype, n_rollback=k, engine=engine)
    logits = model.forward(cache.init_batch(rc.Batch(token=prompt, pos=range(len(prompt)))))[-1]
    tokens = [int(np.argmax(logits))]
    rollbacks = 0
    while len(tokens) < 30:
        n = len(prompt) + len(tokens) - 1          # position of the last token, not fed yet
        want = truth[len(tokens):len(tokens) + int(rng.integers(0, k + 1))]
        drafts = [t if rng.random() < 0.6 else (t + 1) % 256 for t in want]
        feed = tokens[-1:] + drafts
        st = cache.init_batch(rc.Batch(token=feed, pos=range(n, n + len(feed))), logits_all=True)
        out = model.forward(st)
        accepted = 0
        while accepted < len(drafts) and int(np.argmax(out[accepted])) == drafts[accepted]:
            accepted += 1
        if accepted < len(drafts):
            assert cache.seq_rm(0, n + 1 + accepted, -1)
            rollbacks += 1
        for j in range(accepted + 1):
            i = len(tokens)
            token = drafts[j] if j < accepted else int(np.argmax(out[j]))
            assert token == truth[i], f"token {i}"
            scale = np.max(np.abs(truth_logits[i]))
            assert np.max(np.abs(out[j] - truth_logits[i])) / scale <= TOLERANCE[dtype]
            tokens.append(token)
        assert cache.seq_pos_max(0) == len(prompt) + len(tokens) - 2
    assert tokens == truth[:len(tokens)] and rollbacks > 3


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_demo_speculative_is_token_identical_to_plain_decoding(dtype, capsys):
    code = demo.main(["--speculative", "4", "--n-predict", "12", "--clients", "4", "--parallel", "3",
                      "--dtype", dtype, "--quiet"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "verification     PASSED" in out and "token-identical to plain greedy" in out
    drafts_line = next(line for line in out.splitlines() if line.startswith("drafts"))
    drafted, accepted = int(drafts_line.split()[1]), int(drafts_line.split()[3])
    assert drafted > 0 and 0 < accepted <= drafted


def test_demo_speculative_fails_loudly_when_a_rollback_restores_a_wrong_state(monkeypatch, capsys):
    """A rollback that lands on the wrong state must make the verification fail."""
    original = rc.RecurrentCache.seq_rm

    def wrong_state(self, seq, p0=-1, p1=-1):
        done = original(self, seq, p0, p1)
        if done and self.n_rollback and p0 > 0:
            self.s[0][self.cell(seq)[2]] *= 0.5   # the row of seq's cell
        return done

    monkeypatch.setattr(rc.RecurrentCache, "seq_rm", wrong_state)
    code = demo.main(["--speculative", "4", "--n-predict", "16", "--clients", "3", "--parallel", "3", "--quiet"])
    captured = capsys.readouterr()
    assert code == 1 and "VERIFICATION FAILED" in captured.err


def test_the_shipped_model_accepts_drafts():
    model = trained_model()
    text = model.vocab.encode("def f(x):\n    return x\n\n\ndef g(x):\n    return x\n\n\ndef h(x):\n")
    assert draft(text, 4)   # repetitive code gives prompt lookup something to propose
