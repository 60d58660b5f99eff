"""Random interleavings of submit / fork / cancel / step (hypothesis) against a model that knows each
request's tokens: its state is a hash of the sequence's history, its logits a function of that hash,
so a request's tokens follow from its own history alone.  Run on a ``RecurrentCache`` and on a
``HybridCache`` (what a hybrid model's ``new_cache`` returns), with and without drafts to verify."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

import recurrent_cache as rc
from recurrent_cache.generation import Generator
from recurrent_cache.hybrid import HybridCache
from recurrent_cache.models import Sampler

N_VOCAB = 7
MODULUS = 1 << 20    # hashes stay integers an f32 state row holds exactly


def advance(h: int, token: int) -> int:
    return (h * 31 + token + 1) % MODULUS


def logits_of(h: int) -> np.ndarray:
    """Largest at ``h % N_VOCAB``; the others spread by the hash, so sampling depends on it too."""
    return -(((np.arange(N_VOCAB) - h) % N_VOCAB) * (0.3 + (h % 5) * 0.2))


class HashModel:
    """A model through the public interface only: ``new_cache``, ``forward(st)`` in ``st.out_ids``
    order, the recurrent rows (``st.s(0)``, and ``st.s_steps(0)`` for rollback)."""

    def __init__(self, kv_size: int | None = None) -> None:
        self.hparams = SimpleNamespace(n_vocab=N_VOCAB)
        self.vocab = None
        self.kv_size = kv_size

    def new_cache(self, n_seq_max: int = 1, n_rollback: int = 0) -> rc.RecurrentCache | HybridCache:
        if self.kv_size is None:
            return rc.RecurrentCache(1, 1, 1, n_seq_max=n_seq_max, n_rollback=n_rollback)
        return HybridCache(1, attn_layers=[0], recr_layers=[0], n_embd_k=1, n_embd_v=1, n_embd_r=1, n_embd_s=1,
                           kv_size=self.kv_size, n_seq_max=n_seq_max, n_rollback=n_rollback, kv_pad=1)

    def forward(self, st) -> np.ndarray:
        rows = []
        for ub in st:
            states, steps = st.s(0), st.s_steps(0)
            m = steps.shape[1]
            tokens = np.asarray(ub.token).reshape(ub.n_seqs, ub.n_seq_tokens)
            output = np.asarray(ub.output).reshape(ub.n_seqs, ub.n_seq_tokens)
            for g in range(ub.n_seqs):
                h = int(states[g, 0])
                for j, token in enumerate(tokens[g].tolist()):
                    h = advance(h, token)
                    if ub.n_seq_tokens - 1 - m <= j < ub.n_seq_tokens - 1:
                        steps[g, j - (ub.n_seq_tokens - 1 - m), 0] = h
                    if output[g, j]:
                        rows.append(logits_of(h))
                states[g, 0] = h
        return np.array(rows).reshape(-1, N_VOCAB)


def expected(prompt: list[int], n: int, sampler: Sampler, stops: frozenset[int]) -> list[int]:
    h = 0
    for token in prompt:
        h = advance(h, token)
    sampler, tokens = sampler.fresh(), []
    while len(tokens) < n:
        tokens.append(sampler(logits_of(h)))
        if tokens[-1] in stops:
            break
        h = advance(h, tokens[-1])
    return tokens


def oracle_drafts(history, k):
    """The greedy continuation, wrong at every third position: some drafts kept, some rolled back."""
    h = 0
    for token in history:
        h = advance(h, token)
    drafts = []
    for j in range(k):
        token = int(np.argmax(logits_of(h)))
        drafts.append(token if (len(history) + j) % 3 else (token + 1) % N_VOCAB)
        h = advance(h, drafts[-1])
    return drafts


requests = st.tuples(st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=12),   # prompt
                     st.integers(0, 6),                                                 # max_new_tokens
                     st.sampled_from([0.0, 0.7, 2.0]),                                  # temperature
                     st.integers(0, 3),                                                 # seed
                     st.booleans())                                                     # stop at token 0
actions = st.lists(st.one_of(st.tuples(st.just("submit"), requests), st.just(("step",)),
                             st.tuples(st.just("fork"), st.integers(0, 20)),
                             st.tuples(st.just("cancel"), st.integers(0, 20))), max_size=30)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=actions, n_seq_max=st.integers(1, 4), n_batch=st.integers(1, 9), n_ubatch=st.integers(1, 5),
       n_draft=st.sampled_from([0, 2]), hybrid=st.booleans())
def test_random_interleavings_give_every_request_its_own_tokens(actions, n_seq_max, n_batch, n_ubatch, n_draft,
                                                                hybrid):
    model = HashModel(kv_size=40 if hybrid else None)
    generator = Generator(model, n_seq_max=n_seq_max, n_batch=n_batch, n_ubatch=n_ubatch,
                          draft=oracle_drafts if n_draft else None, n_draft=n_draft)
    made: list = []
    streamed: dict[int, list[int]] = {}

    def record(events):
        for event in events:
            streamed.setdefault(event.request.id, []).extend(event.tokens)

    for action in actions:
        if action[0] == "submit":
            prompt, max_new, temperature, seed, stop_at_zero = action[1]
            made.append(generator.submit(prompt, max_new_tokens=max_new, temperature=temperature, seed=seed,
                                         stop_tokens=[0] if stop_at_zero else []))
        elif action[0] == "step":
            record(generator.step())
        elif made:
            request = made[action[1] % len(made)]
            if action[0] == "cancel":
                generator.cancel(request)
            else:
                before = (list(generator.waiting), list(generator.running), list(generator.free_seqs),
                          list(request.forks), list(request.pending))
                try:
                    made += generator.fork(request, 1)
                except (rc.ArgumentError, rc.NoFreeCellError):   # finished, no room: refused, nothing changed
                    assert before == (list(generator.waiting), list(generator.running), list(generator.free_seqs),
                                      list(request.forks), list(request.pending))
    record(generator.run_until_done())
    assert generator.done and generator.cache.seq_pos_max(0) == -1
    assert sorted(generator.free_seqs) == list(range(n_seq_max))
    for request in made:
        assert request.finished
        assert streamed.get(request.id, []) == request.tokens
        if request.finish_reason == "cancelled":
            continue
        want = expected(request.prompt, request.max_new_tokens, request.sampler, request.stop_tokens)
        assert request.tokens == want, (request.prompt, request.sampler.seed)
