"""The exceptions raised by recurrent_cache.

Every error the package raises derives from :class:`RecurrentCacheError`, and
each subclass also derives from the built-in a caller would reach for, so
``except ValueError`` keeps working for code written against plain Python
containers.  A call that raises has changed nothing.
"""

__all__ = [
    "RecurrentCacheError",
    "ConfigError",
    "BatchError",
    "SeqIdError",
    "PositionError",
    "StateError",
    "ArgumentError",
    "CoreError",
]


class RecurrentCacheError(Exception):
    """Base class of every exception raised by recurrent_cache."""


class ConfigError(RecurrentCacheError, ValueError):
    """A constructor argument makes no sense (width < 1, unknown dtype, ...)."""


class BatchError(RecurrentCacheError, ValueError):
    """A batch is malformed: empty, mismatched lengths, a token with no seq id, ..."""


class SeqIdError(BatchError, IndexError):
    """A sequence id lies outside ``[0, size)``.

    It is both an ``IndexError`` (an id is an index into the cell table) and a
    ``ValueError`` (it is bad input like any other batch defect).
    """


class PositionError(BatchError):
    """Positions would make a recurrent state skip or repeat tokens."""


class ArgumentError(RecurrentCacheError, ValueError):
    """A method argument is out of its domain (``seq_div`` by ``d <= 0``, ...)."""


class StateError(RecurrentCacheError, ValueError):
    """A state blob is truncated, has trailing bytes or does not fit this cache."""


class CoreError(RecurrentCacheError, RuntimeError):
    """The compiled core reported a failure that validation should have prevented."""
