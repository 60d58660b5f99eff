"""Types shared by both implementations of the memory state: status and ubatch."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

__all__ = ["MemoryStatus", "Ubatch"]


class MemoryStatus(enum.IntEnum):
    """Outcome of ``init_batch`` / ``init_full`` (llama.cpp's ``llama_memory_status``)."""

    SUCCESS = 0
    NO_UPDATE = 1
    FAILED_PREPARE = 2
    FAILED_COMPUTE = 3


@dataclass(frozen=True, eq=False)
class Ubatch:
    """One micro-batch: ``n_seqs`` groups of exactly ``n_seq_tokens`` tokens.

    Token ``k`` of group ``s`` is entry ``s * n_seq_tokens + k`` of every
    per-token array.  ``seq_id[s]`` is group ``s``'s seq-id list, owner first,
    in the order the batch listed them.
    """

    n_tokens: int
    n_seq_tokens: int
    n_seqs: int
    token: np.ndarray | None      # [n_tokens] int32, or None for an embedding batch
    embd: np.ndarray | None       # [n_tokens, n_embd] float32, or None for a token batch
    pos: np.ndarray               # [n_tokens] int32
    seq_id: tuple[tuple[int, ...], ...]  # [n_seqs] seq-id lists
    output: np.ndarray            # [n_tokens] bool
    batch_index: np.ndarray       # [n_tokens] int64, where each token sits in the batch

    def __repr__(self) -> str:
        owners = [ids[0] for ids in self.seq_id]
        return (f"Ubatch(n_tokens={self.n_tokens}, n_seqs={self.n_seqs}, "
                f"n_seq_tokens={self.n_seq_tokens}, owners={owners})")
