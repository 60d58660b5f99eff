"""A decode step updates its recurrent states in their rows (``_storage.StateUndo``): a forward that fails after
some layers stepped in place puts every row back, bit for bit, for pure and hybrid models, numpy and torch CPU
rows, an error or an interrupt; rolled back past the failed step, the cache decodes on as if it had not been
made."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import recurrent_cache as rc
from forks import check_in_forked_child
from recurrent_cache.models import random_jamba_model, random_mamba2_model, random_model
from recurrent_cache.models._storage import StateStorage, StateUndo
from recurrent_cache.models.nemotron_h import random_nemotron_h_model

MODELS = {
    "mamba1": lambda: random_model(3, n_layer=3, dtype=np.float32),
    "mamba2": lambda: random_mamba2_model(3, n_layer=3, dtype=np.float32),
    "jamba": lambda: random_jamba_model(3, dtype=np.float32),              # Mamba-1 layers beside attention
    "nemotron_h": lambda: random_nemotron_h_model(3, dtype=np.float32),   # Mamba-2 layers beside attention
}
PROMPTS = ([5, 6, 7], [9, 10])


class Interrupted(Exception):
    """What the injected failure raises (or KeyboardInterrupt)."""


def host(rows):
    return rows.numpy() if hasattr(rows, "numpy") else rows


def snapshot(cache):
    return [host(rows).copy() for rows in (*cache.r, *cache.s) if rows is not None]   # a hybrid: recurrent layers


def fail_in_the_last_layer(model, monkeypatch, error, seen):
    """Make ``model``'s last layer raise ``error`` after it ran; ``seen`` gets the s rows as they were then."""
    hybrid = hasattr(model, "block")
    name = "block" if hybrid else "mixer"
    original = getattr(model, name)
    calls = []

    def failing(*args, **kwargs):
        result = original(*args, **kwargs)
        calls.append(1)
        if len(calls) == model.hparams.n_layer:
            seen.extend(snapshot(seen_cache[0]))
            raise error
        return result
    seen_cache: list = []
    monkeypatch.setattr(model, name, failing)
    return seen_cache


@pytest.mark.parametrize("family", MODELS)
@pytest.mark.parametrize("storage", ["numpy", pytest.param("torch", marks=pytest.mark.needs_torch)])
@pytest.mark.parametrize("error", [Interrupted("injected"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_a_decode_step_that_fails_leaves_every_row_as_it_was(family, storage, error, monkeypatch):
    if storage == "torch":
        pytest.importorskip("torch")
    model = MODELS[family]()
    cache = model.new_cache(n_seq_max=2, storage=storage, n_rollback=1)
    reference = model.new_cache(n_seq_max=2, n_rollback=1)
    step = rc.Batch(token=[11, 12], seq_id=[0, 1], pos=[len(p) for p in PROMPTS])
    for target in (cache, reference):
        model.forward(target.init_batch(rc.Batch(token=[*PROMPTS[0], *PROMPTS[1]], seq_id=[0] * 3 + [1] * 2)))
    before = snapshot(cache)

    seen: list = []
    seen_cache = fail_in_the_last_layer(model, monkeypatch, error, seen)
    seen_cache.append(cache)
    with pytest.raises(type(error)):
        model.forward(cache.init_batch(step))
    monkeypatch.undo()

    # the steps were made in place (the rows held new states when the failure came), and are undone
    assert any(not np.array_equal(a, b) for a, b in zip(seen, before))
    for after, expected in zip(snapshot(cache), before):
        assert np.array_equal(after, expected)
    # the failed step's position is dropped (rolled back), as a caller does after a failed forward; the cache
    # decodes on as if it had not been made
    for seq in (0, 1):
        assert cache.seq_rm(seq, len(PROMPTS[seq]), -1)
    logits = host(model.forward(cache.init_batch(step)))
    expected_logits = model.forward(reference.init_batch(step))
    assert np.array_equal(logits, expected_logits)


def test_undo_buffers_are_reused_up_to_a_bound(monkeypatch):
    """A released undo's buffers serve the next undo (no new pages a token), and no more than SPARE_BYTES stay."""
    monkeypatch.setattr(StateUndo, "_spare", [])
    monkeypatch.setattr(StateUndo, "SPARE_BYTES", 3 * 4096)
    state = np.zeros((2, 512), np.float32)        # 4096 bytes
    first = StateUndo()
    buffers = [first.saving(state)[0] for _ in range(4)]
    first.release()
    second = StateUndo()
    again = [second.saving(state)[0] for _ in range(4)]
    pointers = {buffer.__array_interface__["data"][0] for buffer in buffers}
    reused = [buffer.__array_interface__["data"][0] in pointers for buffer in again]
    assert reused == [True, True, True, False]


def test_restore_puts_back_only_the_steps_that_were_made():
    """An entry whose step never ran (its flag unset: an interrupt before the kernel) is skipped."""
    undo = StateUndo()
    made, not_made = np.full((1, 4), 2.0, np.float32), np.full((1, 4), 5.0, np.float32)
    saved, done = undo.saving(made)
    saved[...] = 1.0
    done[0] = 1
    undo.saving(not_made)[0][...] = 9.0
    undo.restore()
    assert (made == 1.0).all() and (not_made == 5.0).all()


@pytest.mark.parametrize("width", [7, 300_000])   # a small copy (numpy's) and one in the kernel's threads
def test_write_stores_values_in_their_rows(width):
    """``StateStorage.write``: values of the rows' dtype copied, float64 ones rounded through float32, the rows'
    own memory left as it is, a view overlapping the rows copied as numpy would."""
    storage = StateStorage(np.float32)
    rng = np.random.default_rng(width)
    rows = np.zeros((2, width), np.float32)
    values = rng.standard_normal((2, width)).astype(np.float32)
    storage.write(rows, values)
    assert np.array_equal(rows, values)
    wide = rng.standard_normal((2, width))
    storage.write(rows, wide)
    assert np.array_equal(rows, wide.astype(np.float32))
    before = rows.copy()
    storage.write(rows, rows.reshape(-1).reshape(rows.shape))   # a state stepped in place: nothing to do
    assert np.array_equal(rows, before)
    flat = np.arange(2 * width + 1, dtype=np.float32)
    target, source = flat[:-1].reshape(2, width), flat[1:].reshape(2, width)   # overlapping by all but one value
    expected = source.copy()
    storage.write(target, source)
    assert np.array_equal(target, expected)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX's")
def test_a_child_forked_while_another_thread_uses_the_spare_buffers_can_use_them():
    """The spare buffers' lock is new in a forked child: a fork while another thread held it (a server forking
    workers while it decodes) would otherwise leave every undo in the child waiting for ever."""
    stop = threading.Event()
    state = np.zeros((1, 64), np.float32)

    def churn():
        while not stop.is_set():
            undo = StateUndo()
            undo.saving(state)
            undo.release()
    worker = threading.Thread(target=churn)
    worker.start()
    try:
        def undo_in_the_child() -> bool:
            undo = StateUndo()
            undo.saving(state)
            undo.release()
            return True
        for _ in range(20):
            check_in_forked_child(undo_in_the_child, "its undo waited for the spare buffers' lock", timeout=10)
    finally:
        stop.set()
        worker.join()
