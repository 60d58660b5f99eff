"""Fixtures the model tests share."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from recurrent_cache.models import get_num_threads, set_num_threads


@pytest.fixture
def threads() -> Iterator[Callable[[int], None]]:
    """Set the compiled kernels' threads for a test (``threads(n)``), the setting put back after it."""
    before = get_num_threads()
    yield set_num_threads
    set_num_threads(before)
