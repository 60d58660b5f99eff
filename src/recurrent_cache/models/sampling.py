"""Choosing the next token from logits: greedy, or sampled at a temperature from the top k (and the
top p of the probability), seeded."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import _args

__all__ = ["Sampler", "DEFAULT_TEMPERATURE", "DEFAULT_TOP_K"]

# The commands sample by default: greedy decoding of a small byte-level model soon repeats
# itself (runs of spaces); a draw from the 40 most likely bytes at temperature 0.7 reads like Python.
DEFAULT_TEMPERATURE, DEFAULT_TOP_K = 0.7, 40


class Sampler:
    """Picks the next token: ``temperature`` 0 is greedy (argmax); otherwise a draw from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` largest logits (0: all),
    and then to the fewest most likely tokens whose probability sums to at least ``top_p``
    (1: all), with a ``numpy`` generator seeded by ``seed`` (an int or a tuple of ints).

    Two samplers with the same settings make the same draws: ``fresh()`` gives
    one from the start, which is how a served client is replayed alone.
    """

    def __init__(self, temperature: float = 0.0, top_k: int = 0, seed: Any = 0, top_p: float = 1.0) -> None:
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
        top_k = _args.count(top_k, "top_k", 0, int32_only=False)
        self.temperature = float(temperature)
        self.top_k = top_k
        self.top_p = float(top_p)
        self.seed = seed
        self._rng = np.random.default_rng(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def __call__(self, logits: np.ndarray) -> int:
        logits = np.asarray(logits, dtype=np.float64)
        if self.greedy:
            return int(np.argmax(logits))
        candidates = np.arange(len(logits))
        if 0 < self.top_k < len(logits):
            # sorted ids: the same candidates in the same order whatever argpartition's order
            candidates = np.sort(np.argpartition(logits, -self.top_k)[-self.top_k:])
        scaled = logits[candidates] / self.temperature
        weights = np.exp(scaled - scaled.max())
        if self.top_p < 1.0:
            # the nucleus: most likely first (ties by id), cut where the share reaches top_p
            order = np.argsort(-weights, kind="stable")
            share = np.cumsum(weights[order]) / weights.sum()
            kept = np.sort(order[:int(np.searchsorted(share, self.top_p)) + 1])
            candidates, weights = candidates[kept], weights[kept]
        cumulative = np.cumsum(weights)
        pick = np.searchsorted(cumulative, self._rng.random() * cumulative[-1], side="right")
        return int(candidates[min(pick, len(candidates) - 1)])

    def fresh(self) -> "Sampler":
        """The same sampler from its start: same settings, same draws."""
        return Sampler(self.temperature, self.top_k, self.seed, self.top_p)

    def __str__(self) -> str:
        if self.greedy:
            return "greedy"
        top = f", top-k {self.top_k}" if self.top_k else ""
        top += f", top-p {self.top_p:g}" if self.top_p < 1.0 else ""
        return f"sampled (temperature {self.temperature:g}{top}, seed {self.seed})"
