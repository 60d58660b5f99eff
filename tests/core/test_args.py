"""The argument module: every kind of argument, what it accepts and how it refuses, in one wording.

Each check is also exercised through a public call that uses it, on both
engines, so a call site that kept a hand-written variant (another rule or
another message) fails here.
"""

from __future__ import annotations

import os
import pathlib
import re

import numpy as np
import pytest

import recurrent_cache
from recurrent_cache import _args
from recurrent_cache.errors import ArgumentError, ConfigError, OutOfRangeError, SeqIdError

NUMPY_INTS = [np.int8(3), np.int16(3), np.int32(3), np.int64(3), np.uint8(3), np.uint32(3), np.uint64(3)]
NOT_INTEGERS = [True, False, np.bool_(True), 1.0, 1.5, np.float32(2.0), "1", b"1", None, [1], (1,),
                complex(1, 0), np.array([1])]


def not_integer(name: str, value: object) -> str:
    return "^" + re.escape(f"{name} must be an integer, got {value!r}") + "$"


def outside(name: str, value: int, low: str, high: str) -> str:
    return "^" + re.escape(f"{name} must be in [{low}, {high}), got {value}") + "$"


# -- integers ------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 1, -7, 2**80, -2**80] + NUMPY_INTS)
def test_integer_accepts_python_and_numpy_integers(value):
    result = _args.integer(value, "n")
    assert type(result) is int and result == int(value)


@pytest.mark.parametrize("value", NOT_INTEGERS)
def test_integer_refuses_everything_else_with_one_wording(value):
    with pytest.raises(ArgumentError, match=not_integer("n", value)):
        _args.integer(value, "n")
    with pytest.raises(ConfigError, match=not_integer("n", value)):   # the caller's class, the same words
        _args.integer(value, "n", ConfigError)


@pytest.mark.parametrize("value", [-2**31, -2**31 + 1, -1, 0, 2**31 - 2, 2**31 - 1, np.int64(2**31 - 1)])
def test_as_int_accepts_the_int32_range(value):
    assert _args.as_int(value, "pos") == int(value)


@pytest.mark.parametrize("value", [2**31, -2**31 - 1, 2**63, np.uint64(2**63)])
def test_as_int_refuses_beyond_int32_naming_the_bounds(value):
    with pytest.raises(ArgumentError, match=outside("pos", int(value), "-2**31", "2**31")):
        _args.as_int(value, "pos")


def test_count_has_a_floor_and_int32_unless_told_otherwise():
    assert _args.count(0, "n") == 0 and _args.count(2**31 - 1, "n") == 2**31 - 1
    with pytest.raises(ArgumentError, match=outside("n", -1, "0", "2**31")):
        _args.count(-1, "n")
    with pytest.raises(ArgumentError, match=outside("n", 2**31, "1", "2**31")):
        _args.count(2**31, "n", 1)
    assert _args.count(2**40, "max_bytes", 1, int32_only=False) == 2**40
    with pytest.raises(ArgumentError, match="^" + re.escape("max_bytes must be >= 1, got 0") + "$"):
        _args.count(0, "max_bytes", 1, int32_only=False)
    with pytest.raises(ArgumentError, match=not_integer("n", True)):
        _args.count(True, "n")


def test_index_is_an_argument_error_when_no_integer_and_an_index_error_when_outside():
    assert _args.index(3, "cell index", 4) == 3
    assert _args.index(-1, "seq_id", 4, SeqIdError, low=-1) == -1
    for value, low in ((4, 0), (-1, 0), (-2, -1)):
        with pytest.raises(OutOfRangeError, match=outside("i", value, str(low), "4")) as caught:
            _args.index(value, "i", 4, low=low)
        assert isinstance(caught.value, IndexError)
    with pytest.raises(ArgumentError, match=not_integer("i", 1.0)) as caught:
        _args.index(1.0, "i", 4)
    assert not isinstance(caught.value, IndexError)


def test_state_seq_id_is_minus_one_or_a_sequence():
    assert [_args.state_seq_id(v, 3, "state_write") for v in (-1, 0, 2, np.int16(1))] == [-1, 0, 2, 1]
    for value in (-2, 3, 2**31):
        with pytest.raises(SeqIdError, match=outside("state_write: seq_id", value, "-1", "3")):
            _args.state_seq_id(value, 3, "state_write")
    with pytest.raises(ArgumentError, match=not_integer("state_write: seq_id", True)):
        _args.state_seq_id(True, 3, "state_write")


# -- flags ---------------------------------------------------------------------------


@pytest.mark.parametrize("value,expected", [(True, True), (False, False), (np.bool_(True), True), (0, False),
                                            (1, True), (np.int8(1), True), (np.uint64(0), False)])
def test_flags_are_bools_or_zero_or_one(value, expected):
    assert _args.as_flag(value, "logits_all") is expected


@pytest.mark.parametrize("value", [2, -1, 0.0, 1.0, "True", None, [True]])
def test_anything_else_is_not_a_flag(value):
    with pytest.raises(ArgumentError, match="^" + re.escape(f"logits_all must be True or False, got {value!r}") + "$"):
        _args.as_flag(value, "logits_all")


# -- integer arrays ------------------------------------------------------------------


@pytest.mark.parametrize("values", [[1, 2, 3], (1, 2, 3), range(1, 4), np.array([1, 2, 3], np.int8),
                                    np.array([1, 2, 3], np.uint64), np.array([1, 2, 3], ">i4"),
                                    np.array([[1, 2, 3]])[0], np.array([1, 0, 2, 0, 3])[::2]])
def test_int_arrays_from_any_one_dimensional_integer_sequence(values):
    for dtype in (np.int32, np.int64):
        array = _args.int_array(values, "tokens", dtype)
        assert array.dtype == dtype and array.ndim == 1 and array.flags.c_contiguous
        assert array.tolist() == [1, 2, 3]
    assert _args.tokens(values).dtype == np.dtype("<i4")


def test_an_int_array_of_the_right_kind_is_not_copied_and_an_empty_one_is_fine():
    given = np.array([5, 6], np.int32)
    assert _args.int_array(given, "tokens") is given
    assert _args.int_array([], "tokens").shape == (0,)


@pytest.mark.parametrize("values,what", [
    ([True, False], "dtype bool"), (np.array([True]), "dtype bool"), ([1, True], "a bool"),
    ([1.0, 2.0], "dtype float64"), (np.array([1.5]), "dtype float64"), (["1"], "dtype <U1"),
    ([[1, 2], [3, 4]], "shape (2, 2)"), (np.int32(4), "shape ()"), (5, "shape ()"),
])
def test_int_arrays_refuse_bools_floats_and_other_shapes(values, what):
    words = f"tokens must be a 1-D array of integers, got {what}"
    with pytest.raises(ArgumentError, match="^" + re.escape(words) + "$"):
        _args.int_array(values, "tokens")


def test_int_arrays_refuse_ragged_lists_masks_and_mappings():
    with pytest.raises(ArgumentError, match="^tokens must be a 1-D array of integers: "):
        _args.int_array([[1], [2, 3]], "tokens")
    with pytest.raises(ArgumentError, match="tokens is a masked array"):
        _args.int_array(np.ma.masked_array([1, 2], mask=[0, 1]), "tokens")
    for mapping in ({1: 2}, {1, 2}, "12", b"12"):
        with pytest.raises(ArgumentError, match="tokens must be a sequence or array"):
            _args.int_array(mapping, "tokens")


@pytest.mark.parametrize("dtype,bad", [(np.int32, 2**31), (np.int32, -2**31 - 1), (np.int64, 2**63)])
def test_int_arrays_refuse_values_beyond_their_dtype(dtype, bad):
    source = np.array([0, bad], dtype=np.uint64 if bad >= 2**63 else np.int64)
    with pytest.raises(ArgumentError, match=f"^tokens must hold {np.dtype(dtype).name} values, got {bad}$"):
        _args.int_array(source, "tokens", dtype)
    edge = np.iinfo(dtype)
    assert _args.int_array([edge.min, edge.max], "tokens", dtype).tolist() == [edge.min, edge.max]


# -- strings and paths ---------------------------------------------------------------


def test_text_is_a_str():
    assert _args.text("x", "namespace") == "x"
    for value in (b"x", None, 1):
        with pytest.raises(ArgumentError, match="^" + re.escape(f"namespace must be a str, got {value!r}") + "$"):
            _args.text(value, "namespace")


class _PathLike:
    def __init__(self, path):
        self.path = path

    def __fspath__(self):
        return self.path


def test_paths_are_str_bytes_or_pathlike_decoded_as_os_does(tmp_path):
    name = str(tmp_path / "a")
    for value in (name, os.fsencode(name), pathlib.Path(name), _PathLike(name), _PathLike(os.fsencode(name))):
        assert _args.path(value) == name
    for value in (1, None, ["a"]):
        words = f"path must be a str, bytes or os.PathLike, got {type(value).__name__}"
        with pytest.raises(ArgumentError, match="^" + re.escape(words) + "$"):
            _args.path(value)
    for value in ("", b"", "a\0b", b"a\0b"):
        with pytest.raises(ArgumentError, match="is empty or has a NUL character"):
            _args.path(value)


# -- through the public calls, on both engines -----------------------------------------


def test_public_calls_use_the_one_wording(rc):
    cache = rc.RecurrentCache(1, 2, 3, n_seq_max=2)
    for call, name, value in ((lambda: cache.seq_rm(True, 0, -1), "seq", True),
                              (lambda: cache.seq_pos_max(1.0), "seq", 1.0),
                              (lambda: cache.cell(np.float64(0)), "cell index", np.float64(0)),
                              (lambda: cache.state_size(None), "state_size: seq_id", None)):
        with pytest.raises(ArgumentError, match=not_integer(name, value)):
            call()
    with pytest.raises(OutOfRangeError, match=outside("cell index", 2, "0", "2")):
        cache.cell(2)
    with pytest.raises(SeqIdError, match=outside("state_write: seq_id", 2, "-1", "2")):
        cache.state_write(2)
    with pytest.raises(ConfigError, match=not_integer("n_layer", True)):
        rc.RecurrentCache(True, 2, 3)
    with pytest.raises(ConfigError, match=outside("n_embd_r", 0, "1", "2**31")):
        rc.RecurrentCache(1, 0, 3)
    with pytest.raises(ConfigError, match=outside("n_embd_s", -1, "0", "2**31")):
        rc.RecurrentCache(1, 2, -1)
    with pytest.raises(ArgumentError, match="^embd_pooled must be True or False, got 2$"):
        cache.init_batch(rc.Batch(token=[1], seq_id=[0], pos=[0]), embd_pooled=2)
    assert cache.cell(np.int64(1)) == cache.cell(1)


def test_stores_prefix_cache_and_sequence_files_use_the_one_wording(rc, tmp_path):
    cache = rc.RecurrentCache(1, 2, 3, n_seq_max=2)
    with pytest.raises(ArgumentError, match=not_integer("PrefixCache: block_size", 2.0)):
        recurrent_cache.PrefixCache(cache, 1 << 20, block_size=2.0)
    with pytest.raises(ArgumentError, match=re.escape("PrefixCache: namespace must be a str, got b'x'")):
        recurrent_cache.PrefixCache(cache, 1 << 20, namespace=b"x")
    with pytest.raises(ArgumentError, match="^DirectoryStore: max_bytes must be >= 1, got 0$"):
        recurrent_cache.stores.DirectoryStore(tmp_path, max_bytes=0)
    with pytest.raises(ArgumentError, match="^load_seq_file: max_tokens must be >= 0, got -1$"):
        recurrent_cache.load_seq_file(tmp_path / "x", cache, 0, max_tokens=-1)
    with pytest.raises(ArgumentError, match="^tokens must be a 1-D array of integers, got dtype bool$"):
        recurrent_cache.save_seq_file(tmp_path / "x", cache, 0, [True])
    assert not (tmp_path / "x").exists()


def test_a_bytes_path_works_for_a_directory_store_as_for_a_sequence_file(tmp_path):
    """One rule: a bytes path means the directory os.fsdecode names (it used to be kept as bytes
    and then misbehave in the store)."""
    store = recurrent_cache.stores.DirectoryStore(os.fsencode(tmp_path / "store"))
    assert store.path == str(tmp_path / "store") and os.path.isdir(store.path)
