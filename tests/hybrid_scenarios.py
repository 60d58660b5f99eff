"""The scenarios every hybrid family runs against transformers (issue 27's done-when), in one place.

A family's test supplies ``load(dtype)`` (the package's model of a checkpoint) and ``reference(tokens)``
(transformers' full-sequence forward of the same checkpoint: logits ``[len(tokens), n_vocab]`` as float64),
and runs ``run_scenarios``.  Every logit the package computes through the hybrid memory is compared with
the reference's logit at the same position of the same token sequence, relative to the largest reference
logit:

* prompts of three sequences in one batch split into ubatches of 4 tokens (every position's logits);
* decoding one token per step for every sequence (three steps);
* a fork (``seq_cp`` of a whole sequence) that then decodes its own tokens, its parent its own;
* a sequence moved through its state bytes into a second memory, decoded there, and back;
* a rollback: three drafted tokens in one step, two rejected (``seq_rm``), another token decoded;
* a prefix: ``HybridPrefixCache`` restoring a saved history into a new sequence, which continues; and
  with ``store_path``, a history saved through a ``DirectoryStore`` and restored from it by a fresh
  memory (its own ``HybridPrefixCache`` over the same directory), which continues.

``Recorder`` keeps the worst error per scenario so a test can report it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import recurrent_cache as rc
from recurrent_cache.hybrid_prefix import HybridPrefixCache
from recurrent_cache.stores import DirectoryStore

Reference = Callable[[Sequence[int]], np.ndarray]

TOLERANCE = 1e-4     # of the largest logit: issue 27's bound, f32 and f64 alike


def host(array: Any) -> np.ndarray:
    """Logits as a float64 numpy array (torch tensors moved to the host)."""
    if not isinstance(array, np.ndarray):
        array = array.detach().cpu().numpy()
    return np.asarray(array, dtype=np.float64)


def memoised(reference: Reference) -> Reference:
    """``reference`` computing each token sequence's logits once, as float64.  The scenarios draw the same
    tokens (seeded) on every storage, so a module's tests of one checkpoint and dtype can share one
    (a module-scoped fixture) and run transformers' forward once for all their storages."""
    seen: dict[tuple[int, ...], np.ndarray] = {}

    def logits(tokens: Sequence[int]) -> np.ndarray:
        key = tuple(int(t) for t in tokens)
        if key not in seen:
            seen[key] = np.asarray(reference(key), dtype=np.float64)
        return seen[key]
    return logits


def shared(load: Callable[[Path, Any], Reference]) -> Callable[[Path, Any], Reference]:
    """``load(directory, dtype)`` (transformers' forward of a checkpoint in a dtype) as a decorator: called once
    per checkpoint and dtype, its reference ``memoised``, so the tests of every storage share one (for the
    session: the models are tiny)."""
    return functools.cache(lambda directory, dtype: memoised(load(directory, dtype)))


@dataclass
class Recorder:
    """The reference's logits by token sequence (each computed once) and the worst error per scenario."""

    reference: Reference
    worst: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.logits_of = memoised(self.reference)

    def check(self, scenario: str, tokens: Sequence[int], got: Any, positions: Sequence[int]) -> None:
        """``got`` [len(positions), n_vocab]: the package's logits after ``tokens[: p + 1]`` for each p."""
        ref = self.logits_of(tokens)
        rows = ref[list(positions)]
        error = float(np.abs(host(got) - rows).max() / np.abs(ref).max())
        self.worst[scenario] = max(self.worst.get(scenario, 0.0), error)
        assert error <= TOLERANCE, (f"{scenario}: {error:.3g} of the largest logit after {len(tokens)} tokens "
                                    f"(allowed {TOLERANCE})")


def _decode(model: Any, cache: Any, steps: dict[int, list[int]], histories: dict[int, list[int]],
            n_ubatch: int = 512) -> dict[int, np.ndarray]:
    """One batch: ``steps[seq]`` tokens for each sequence after its history (every token an output);
    histories extended.  Returns each sequence's logits rows in order."""
    tokens, seqs, pos = [], [], []
    for seq, new in steps.items():
        start = len(histories[seq])
        tokens += new
        seqs += [seq] * len(new)
        pos += list(range(start, start + len(new)))
    st = cache.init_batch(rc.Batch(token=tokens, seq_id=seqs, pos=pos, logits=[1] * len(tokens)), n_ubatch=n_ubatch)
    assert st.status == rc.MemoryStatus.SUCCESS, st.status
    # torch storage runs torch's own ops here (native), so each family's torch math meets transformers; the numpy
    # math on torch rows (forward's default on the CPU) is tests/models/test_host_math.py's
    logits = host(model.forward(st, native=True))
    ordered = np.empty_like(logits)
    ordered[np.asarray(st.out_ids)] = logits     # row i belongs to batch index out_ids[i]
    out, at = {}, 0
    for seq, new in steps.items():
        out[seq] = ordered[at:at + len(new)]
        histories[seq] += new
        at += len(new)
    return out


def run_scenarios(model: Any, recorder: Recorder, *, storage: Any = "numpy", seed: int = 0,
                  store_path: Path | None = None) -> None:
    """Every scenario of the module's docstring on ``model``, against ``recorder``'s reference."""
    n_vocab = model.hparams.n_vocab
    rng = np.random.default_rng(seed)

    def draw(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, n_vocab, n)]

    new_cache = lambda **kw: model.new_cache(n_seq_max=5, kv_size=96, dtype="f32", storage=storage, **kw)  # noqa: E731
    cache = new_cache(n_rollback=3)
    histories: dict[int, list[int]] = {0: [], 1: [], 2: []}

    # prompts, one batch in ubatches of 4
    prompts = {0: draw(9), 1: draw(5), 2: draw(12)}
    for seq, rows in _decode(model, cache, prompts, histories, n_ubatch=4).items():
        recorder.check("prompt", histories[seq], rows, range(len(histories[seq])))

    # decoding, one token per sequence per step
    for _ in range(3):
        for seq, rows in _decode(model, cache, {s: draw(1) for s in histories}, histories).items():
            recorder.check("decode", histories[seq], rows, [len(histories[seq]) - 1])

    # a fork of sequence 0 into 3; both go on with their own tokens
    cache.seq_cp(0, 3)
    histories[3] = list(histories[0])
    for _ in range(2):
        for seq, rows in _decode(model, cache, {0: draw(1), 3: draw(1)}, histories).items():
            recorder.check("fork", histories[seq], rows, [len(histories[seq]) - 1])

    # sequence 1 through its state bytes into a second memory and back
    blob = cache.state_write(1)
    other = new_cache()
    other.state_read(blob, 0)
    moved = {0: list(histories[1])}
    for seq, rows in _decode(model, other, {0: draw(1)}, moved).items():
        recorder.check("state bytes", moved[seq], rows, [len(moved[seq]) - 1])
    cache.seq_rm(1)
    cache.state_read(other.state_write(0), 1)
    histories[1] = moved[0]
    for seq, rows in _decode(model, cache, {1: draw(1)}, histories).items():
        recorder.check("state bytes", histories[seq], rows, [len(histories[seq]) - 1])

    # rollback: three drafted tokens in one step, the last two rejected, another token in their place
    accepted = len(histories[2]) + 1
    drafted = _decode(model, cache, {2: draw(3)}, histories)
    recorder.check("rollback", histories[2], drafted[2], range(accepted - 1, accepted + 2))
    assert cache.seq_rm(2, accepted, -1)
    histories[2] = histories[2][:accepted]
    for seq, rows in _decode(model, cache, {2: draw(1)}, histories).items():
        recorder.check("rollback", histories[seq], rows, [len(histories[seq]) - 1])

    # a prefix from HybridPrefixCache: sequence 3's whole history restored into sequence 4
    prefixes = HybridPrefixCache(cache, max_bytes=1 << 24, block_size=4)
    assert prefixes.save(3, histories[3])
    assert prefixes.restore(4, histories[3]) == len(histories[3])
    histories[4] = list(histories[3])
    for seq, rows in _decode(model, cache, {4: draw(1), 3: draw(1)}, histories).items():
        recorder.check("prefix cache", histories[seq], rows, [len(histories[seq]) - 1])

    if store_path is not None:
        # a prefix from a store: sequence 0's history saved through a DirectoryStore, restored by a fresh memory
        saving = HybridPrefixCache(cache, max_bytes=1 << 24, block_size=4, store=DirectoryStore(store_path),
                                   namespace="scenario")
        assert saving.save(0, histories[0])
        fresh = new_cache()
        restoring = HybridPrefixCache(fresh, max_bytes=1 << 24, block_size=4, store=DirectoryStore(store_path),
                                      namespace="scenario")
        assert restoring.restore(1, histories[0]) == len(histories[0])
        assert restoring.stats()["store_hits"] == 1
        restored = {1: list(histories[0])}
        for seq, rows in _decode(model, fresh, {1: draw(1)}, restored).items():
            recorder.check("prefix from a store", restored[seq], rows, [len(restored[seq]) - 1])
