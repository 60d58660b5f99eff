"""Constructor checks and state-tensor allocation shared by both implementations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import _args
from .errors import ConfigError
from .state_format import STATE_TYPES, Geometry, StateType
from .storage import Storage

__all__ = ["Config"]


@dataclass(frozen=True)
class Config:
    """A cache's geometry (checked by ``Geometry``) and its ``n_seq_max``."""

    n_layer: int
    n_embd_r: int
    n_embd_s: int
    n_seq_max: int
    size: int
    dtype_r: StateType
    dtype_s: StateType
    layers: tuple[int, ...]   # the layers with state, sorted (every layer unless filtered)

    @classmethod
    def check(cls, n_layer: Any, n_embd_r: Any, n_embd_s: Any, n_seq_max: Any = 1,
              size: Any = None, dtype_r: Any = "f32", dtype_s: Any = "f32", layers: Any = None) -> Config:
        n_seq = _args.count(n_seq_max, "n_seq_max", 0, ConfigError)
        geometry = Geometry.checked(ConfigError, n_layer, n_embd_r, n_embd_s, dtype_r, dtype_s,
                                    max(1, n_seq) if size is None else size, layers)
        return cls(n_layer=geometry.n_layer, n_embd_r=geometry.n_embd_r, n_embd_s=geometry.n_embd_s,
                   n_seq_max=n_seq, size=geometry.size, dtype_r=STATE_TYPES[geometry.dtype_r],
                   dtype_s=STATE_TYPES[geometry.dtype_s], layers=geometry.state_layers)

    def type_ids(self) -> list[int]:
        """The ggml type id of every state tensor: r of each layer with state, then s."""
        return [self.dtype_r.type_id] * len(self.layers) + [self.dtype_s.type_id] * len(self.layers)

    def state_bytes(self, n_rollback: int) -> int:
        """Bytes of the state tensors with ``n_rollback`` past states per cell (their rollback history)."""
        return (len(self.layers) * self.size * (1 + n_rollback)
                * (self.n_embd_r * self.dtype_r.itemsize + self.n_embd_s * self.dtype_s.itemsize))

    def allocate(self, storage: Storage) -> tuple[Any, Any]:
        """The zeroed r and s tensors of ``storage``: ``[n_state, size, n_embd_r]`` and
        ``[n_state, size, n_embd_s]`` (row k of axis 0: the k-th layer with state)."""
        n_state = len(self.layers)
        return (storage.allocate((n_state, self.size, self.n_embd_r), self.dtype_r),
                storage.allocate((n_state, self.size, self.n_embd_s), self.dtype_s))
