from typing import final

import numpy as np

from ._engines import KVTable, Placement

@final
class StepGuard:
    """One thread at a time inside a hybrid memory, as ``memory_state.ThreadGuard``."""

    def enter(self) -> None: ...
    def leave(self) -> None: ...

@final
class KvPlan:
    """Every ubatch's KV tokens and the cells ``prepare`` found for them (``HybridState``'s KV half)."""

    @property
    def n_ubatches(self) -> int: ...
    def apply(self, u: int, pad: int) -> int: ...
    def cells(self, u: int) -> np.ndarray: ...
    def tokens(self, u: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...

def prepare(table: KVTable, placement: Placement) -> KvPlan | None: ...
