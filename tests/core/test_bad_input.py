"""Every bad input of SPEC.md §4 (and the policy choices made for the API).

Each rejection must
  * raise a subclass of ``rc.RecurrentCacheError`` that is also the matching
    built-in (``ValueError`` for bad values, ``IndexError`` for ids / indices
    out of range), so plain ``except ValueError`` code keeps working;
  * name the offending value in its message;
  * leave the cache exactly as it was: cells, head, used, n and every byte of
    every state row.

The starting point is a cache that is not trivial (see ``populated``), so an
implementation that half-applies an operation before noticing the error is
caught by the snapshot comparison.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from golden import formula, store
from rows import host


# -- the starting cache --------------------------------------------------------


def populated(rc):
    """size 4, two layers, f16 / bf16 rows.

    seq 0 at pos 2 (own cell), seqs 1 and 2 sharing one cell at pos 1 (a fork),
    seq 3 absent; every row of every layer filled with distinct values.
    """
    cache = rc.RecurrentCache(2, 3, 2, n_seq_max=4, dtype_r="f16", dtype_s="bf16")
    st = cache.init_batch(rc.Batch(token=[1, 2, 3, 4, 5], pos=[0, 1, 2, 0, 1],
                                   seq_id=[0, 0, 0, 1, 1]))
    for _ in st:
        pass
    cache.seq_cp(1, 2, -1, -1)
    fill(cache, salt=3)
    assert [cache.seq_pos_max(s) for s in range(4)] == [2, 1, 1, -1]
    assert cache.used == 2
    return cache


def fill(cache, salt):
    arrays = list(cache.r) + list(cache.s)
    for k, array in enumerate(arrays):
        for c in range(cache.size):
            store(array[c], formula(salt, c, k, 7, array.shape[1]))


def full_snapshot(cache):
    return {
        "cells": [cache.cell(i) for i in range(cache.size)],
        "head": cache.head,
        "used": cache.used,
        "n": cache.n,
        "r": [host(a).tobytes() for a in cache.r],
        "s": [host(a).tobytes() for a in cache.s],
    }


def names(message, value):
    """True when ``value`` appears in ``message`` as a whole token (so '1' does not
    match inside '12' and '-1' does not match '1')."""
    text = str(value)
    return re.search(r"(?<![\w.\-])" + re.escape(text) + r"(?![\w.])", message) is not None


def assert_rejected(rc, cache, call, builtins, fragments):
    before = full_snapshot(cache)
    with pytest.raises(rc.RecurrentCacheError) as info:
        call(cache)
    for builtin in builtins:
        assert isinstance(info.value, builtin), f"{type(info.value).__mro__} is not a {builtin}"
    message = str(info.value)
    for fragment in fragments:
        # a tuple lists alternatives: naming any one of them is enough
        options = fragment if isinstance(fragment, tuple) else (fragment,)
        assert any(names(message, f) for f in options), f"message {message!r} does not name {fragment!r}"
    assert full_snapshot(cache) == before, "a rejected call changed the cache"
    cache.check()
    return info.value


# -- constructor ---------------------------------------------------------------

GOOD = dict(n_layer=1, n_embd_r=2, n_embd_s=2)


@pytest.mark.parametrize("override, offending", [
    ({"n_layer": 1.5}, "1.5"),
    ({"n_embd_r": "2"}, "'2'"),
    ({"n_embd_s": 2.0}, "2.0"),
    ({"n_seq_max": None}, "None"),
    ({"size": 3.5}, "3.5"),
    ({"n_layer": True}, "True"),          # bools are not counts
    ({"size": False}, "False"),
    ({"n_embd_r": 0}, "0"),
    ({"n_embd_s": -1}, "-1"),
    ({"size": 0}, "0"),
    ({"size": -3}, "-3"),
    ({"n_layer": -1}, "-1"),
    ({"n_seq_max": -1}, "-1"),
    ({"dtype_r": "f64"}, "'f64'"),
    ({"dtype_s": "F32"}, "'F32'"),
    ({"dtype_r": None}, "None"),
    ({"dtype_s": 0}, "0"),
])
def test_constructor_rejects_arguments_that_make_no_sense(rc, override, offending):
    with pytest.raises(rc.RecurrentCacheError) as info:
        rc.RecurrentCache(**{**GOOD, **override})
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert names(message, offending) or names(message, offending.strip("'")), message


def test_a_cache_with_no_layers_keeps_only_the_bookkeeping(rc):
    cache = rc.RecurrentCache(0, 2, 2, n_seq_max=2)
    assert (cache.n_layer, len(cache.r), len(cache.s)) == (0, 0, 0)
    st = cache.init_batch(rc.Batch(token=[1, 2], pos=[0, 0], seq_id=[0, 1]))
    for _ in st:
        pass
    # groups [1] [0] -> seq 1 in cell 0, seq 0 in cell 1
    assert [cache.cell(i) for i in range(2)] == [(0, 0, 1, (1,)), (0, 1, 0, (0,))]
    cache.check()


def test_n_seq_max_zero_gives_one_cell(rc):
    assert rc.RecurrentCache(1, 1, 1, n_seq_max=0).size == 1


# -- Batch ---------------------------------------------------------------------

BATCH_ERRORS = [
    # (id, kwargs, what the message must name)
    ("no-token-or-embd", dict(), ["token"]),
    ("token-and-embd", dict(token=[1], embd=[[0.5]]), ["embd"]),
    ("empty-token", dict(token=[]), []),
    ("empty-embd", dict(embd=np.zeros((0, 3))), []),
    ("pos-too-short", dict(token=[1, 2, 3], pos=[0, 1]), ["2", "3"]),
    ("seq-id-too-long", dict(token=[1, 2], seq_id=[0, 0, 0]), ["3", "2"]),
    ("seq-id-lists-too-short", dict(token=[1, 2], seq_id=[[0]]), ["1", "2"]),
    ("logits-too-long", dict(token=[1], logits=[1, 0]), ["2", "1"]),
    ("float-tokens", dict(token=[1.5, 2.0]), ["token"]),
    ("string-tokens", dict(token=["a", "b"]), ["token"]),
    ("float-pos", dict(token=[1], pos=[0.5]), ["pos"]),
    ("float-seq-id", dict(token=[1], seq_id=[0.5]), ["0.5"]),
    ("float-in-seq-id-list", dict(token=[1], seq_id=[[0, 1.5]]), ["1.5"]),
    ("2d-token", dict(token=[[1, 2]]), ["token"]),
    ("3d-embd", dict(embd=np.zeros((2, 2, 2))), ["embd"]),
    ("1d-embd", dict(embd=[0.5, 1.5]), ["embd"]),
    ("string-embd", dict(embd=[["a", "b"]]), ["embd"]),
    ("token-without-seq-id", dict(token=[1, 2, 3], seq_id=[[0], [], [1]]), ["1"]),
    ("seq-id-listed-twice", dict(token=[1, 2], seq_id=[[0], [2, 3, 2]]), ["2"]),
]


@pytest.mark.parametrize("kwargs, fragments", [e[1:] for e in BATCH_ERRORS],
                         ids=[e[0] for e in BATCH_ERRORS])
def test_malformed_batches_are_rejected(rc, kwargs, fragments):
    cache = populated(rc)
    assert_rejected(rc, cache, lambda c: c.init_batch(rc.Batch(**kwargs)), [ValueError], fragments)


def test_batch_with_no_tokens_says_so(rc):
    with pytest.raises(rc.RecurrentCacheError) as info:
        rc.Batch(token=[])
    assert re.search(r"empty|no token|0 token", str(info.value)), str(info.value)


# -- init_batch ----------------------------------------------------------------

# populated(): size 4; seq 0 at pos 2; seqs 1, 2 share a cell at pos 1; seq 3 absent.
INIT_BATCH_ERRORS = [
    # seq ids outside [0, size): an IndexError (and a ValueError: it is bad input)
    ("seq-id-equal-to-size", dict(token=[1], pos=[0], seq_id=[4]), {}, [IndexError, ValueError], ["4"]),
    ("seq-id-far-too-large", dict(token=[1], pos=[0], seq_id=[70]), {}, [IndexError, ValueError], ["70", "4"]),
    ("negative-seq-id", dict(token=[1], pos=[0], seq_id=[-2]), {}, [IndexError, ValueError], ["-2"]),
    ("bad-second-id-of-a-shared-token", dict(token=[1], pos=[0], seq_id=[[3, 9]]), {},
     [IndexError, ValueError], ["9"]),
    ("bad-id-after-good-tokens", dict(token=[1, 2], pos=[3, 0], seq_id=[0, -1]), {},
     [IndexError, ValueError], ["-1"]),
    # n_ubatch
    ("n-ubatch-zero", dict(token=[1], pos=[0], seq_id=[3]), dict(n_ubatch=0), [ValueError], ["0"]),
    ("n-ubatch-negative", dict(token=[1], pos=[0], seq_id=[3]), dict(n_ubatch=-1), [ValueError], ["-1"]),
    ("n-ubatch-float", dict(token=[1], pos=[0], seq_id=[3]), dict(n_ubatch=2.5), [ValueError], ["2.5"]),
    ("n-ubatch-bool", dict(token=[1], pos=[0], seq_id=[3]), dict(n_ubatch=True), [ValueError], ["True"]),
    ("n-ubatch-string", dict(token=[1], pos=[0], seq_id=[3]), dict(n_ubatch="8"), [ValueError], ["8"]),
    # positions
    ("negative-pos-new-seq", dict(token=[1], pos=[-1], seq_id=[3]), {}, [ValueError], ["-1"]),
    ("negative-pos-later-token", dict(token=[1, 2], pos=[0, -5], seq_id=[3, 3]), {}, [ValueError], ["-5"]),
    ("gap-in-new-seq", dict(token=[1, 2], pos=[0, 2], seq_id=[3, 3]), {}, [ValueError], [("3", "2")]),
    ("gap-in-cached-seq", dict(token=[1, 2], pos=[3, 5], seq_id=[0, 0]), {}, [ValueError], [("0", "5")]),
    ("gap-in-one-member-of-a-shared-prompt", dict(token=[1, 2, 3], pos=[2, 3, 5],
                                                  seq_id=[[1, 2], [1, 2], [2]]), {}, [ValueError], [("2", "5")]),
    ("skips-a-cached-pos", dict(token=[1], pos=[4], seq_id=[0]), {}, [ValueError], ["4"]),
    ("repeats-the-cached-pos", dict(token=[1], pos=[2], seq_id=[0]), {}, [ValueError], ["2"]),
    ("restarts-a-cached-seq-at-0", dict(token=[1], pos=[0], seq_id=[1]), {}, [ValueError], ["0"]),
    ("forked-seq-not-continuing", dict(token=[1], pos=[5], seq_id=[2]), {}, [ValueError], ["5"]),
    # Multi-seq token ordering: seq 0 gets pos 3 ([0]) and 4 ([0, 3]); as a set {3, 4}
    # continues pos 2, but the two-id group is split off first (§3 step 3), so find_slot
    # would see seq 0 jump from 2 to 4.
    ("shared-token-split-before-its-predecessor", dict(token=[1, 2], pos=[3, 4], seq_id=[[0], [0, 3]]),
     {}, [ValueError], ["4"]),
    # seq 1 at pos 1: own tokens 2, 3 and a token shared with seq 3 at pos 4 -> the shared
    # group goes first and seq 1 would jump from 1 to 4.
    ("shared-token-after-private-tokens", dict(token=[1, 2, 3], pos=[2, 3, 4], seq_id=[[1], [1], [1, 3]]),
     {}, [ValueError], ["4"]),
    # seq 0 as the second id of a shared token: the [3, 0] group (pos 4) is placed first and
    # takes seq 0 along (§2 step 2), so the [0] token at pos 3 would then follow pos 4.
    ("shared-token-owned-by-another-seq", dict(token=[1, 2], pos=[3, 4], seq_id=[[0], [3, 0]]),
     dict(n_ubatch=1), [ValueError], ["4"]),
]


@pytest.mark.parametrize("kwargs, options, builtins, fragments", [e[1:] for e in INIT_BATCH_ERRORS],
                         ids=[e[0] for e in INIT_BATCH_ERRORS])
def test_init_batch_rejects_bad_input_and_changes_nothing(rc, kwargs, options, builtins, fragments):
    cache = populated(rc)
    assert_rejected(rc, cache, lambda c: c.init_batch(rc.Batch(**kwargs), **options), builtins, fragments)


def test_init_batch_rejects_something_that_is_not_a_batch(rc):
    cache = populated(rc)
    assert_rejected(rc, cache, lambda c: c.init_batch([1, 2, 3]), [ValueError], [])


def test_a_rejected_batch_leaves_a_working_cache(rc):
    cache = populated(rc)
    with pytest.raises(rc.RecurrentCacheError):
        cache.init_batch(rc.Batch(token=[1, 2], pos=[3, 4], seq_id=[[0], [0, 3]]))
    # the same tokens in an order that keeps seq 0 consecutive are accepted:
    # one shared token at pos 3 for seqs 0 and 3, then seq 0 alone at pos 4
    st = cache.init_batch(rc.Batch(token=[1, 2], pos=[3, 4], seq_id=[[0, 3], [0]]))
    assert st.status == rc.MemoryStatus.SUCCESS
    for _ in st:
        pass
    assert (cache.seq_pos_max(0), cache.seq_pos_max(3)) == (4, 3)
    cache.check()


# -- sequence operations -------------------------------------------------------

SEQ_OP_ERRORS = [
    # seq_div by d <= 0 (FIX: the reference divides by zero)
    ("seq-div-by-zero", lambda c: c.seq_div(0, -1, -1, 0), [ValueError], ["0"]),
    ("seq-div-by-negative", lambda c: c.seq_div(0, -1, -1, -2), [ValueError], ["-2"]),
    ("seq-div-by-zero-outside-range", lambda c: c.seq_div(0, 10, 20, 0), [ValueError], ["0"]),
    ("seq-div-by-zero-no-cell", lambda c: c.seq_div(3, -1, -1, 0), [ValueError], ["0"]),
    # seq_add to a negative position (seq 0 is at 2; seqs 1 and 2 share pos 1)
    ("seq-add-below-zero", lambda c: c.seq_add(0, -1, -1, -3), [ValueError], ["-3"]),
    ("seq-add-shared-cell-below-zero", lambda c: c.seq_add(2, 0, 2, -2), [ValueError], ["-2"]),
    # ids outside [0, size) for seq_keep / seq_add / seq_div (policy: raise)
    ("seq-keep-size", lambda c: c.seq_keep(4), [IndexError, ValueError], ["4"]),
    ("seq-keep-negative", lambda c: c.seq_keep(-1), [IndexError, ValueError], ["-1"]),
    ("seq-add-size", lambda c: c.seq_add(4, -1, -1, 1), [IndexError, ValueError], ["4"]),
    ("seq-add-negative", lambda c: c.seq_add(-1, -1, -1, 1), [IndexError, ValueError], ["-1"]),
    ("seq-div-large", lambda c: c.seq_div(99, -1, -1, 2), [IndexError, ValueError], ["99"]),
    ("seq-div-negative", lambda c: c.seq_div(-7, -1, -1, 2), [IndexError, ValueError], ["-7"]),
]


@pytest.mark.parametrize("call, builtins, fragments", [e[1:] for e in SEQ_OP_ERRORS],
                         ids=[e[0] for e in SEQ_OP_ERRORS])
def test_sequence_operations_reject_bad_arguments(rc, call, builtins, fragments):
    cache = populated(rc)
    assert_rejected(rc, cache, call, builtins, fragments)


def test_seq_rm_beyond_the_cache_is_false_not_an_error(rc):
    # policy: seq_rm(seq >= size) returns False (SPEC §1) and seq_cp out of range is a no-op
    cache = populated(rc)
    before = full_snapshot(cache)
    assert cache.seq_rm(4, -1, -1) is False
    cache.seq_cp(0, 4, -1, -1)
    cache.seq_cp(-3, 1, -1, -1)
    assert full_snapshot(cache) == before


@pytest.mark.parametrize("index", [4, 5, -1, 1000])
def test_cell_index_out_of_range(rc, index):
    cache = populated(rc)
    assert_rejected(rc, cache, lambda c: c.cell(index), [IndexError], [str(index)])


# -- the one exception table -------------------------------------------------------------------


def test_every_exception_class_is_in_errors_and_exported():
    """Every exception class of the package is defined in ``errors.py``, derives from
    ``RecurrentCacheError`` and a built-in, and is exported from ``recurrent_cache`` itself."""
    import ast
    import builtins
    import pathlib

    import recurrent_cache
    from recurrent_cache import errors

    source = pathlib.Path(recurrent_cache.__file__).parent
    for path in source.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and path.name != "errors.py":
                bases = {ast.unparse(base) for base in node.bases}
                assert not (node.name.endswith(("Error", "Exception")) or bases & {"Exception", "ValueError"}
                            or any(base.endswith("Error") for base in bases)), \
                    f"{path.relative_to(source)} defines the exception {node.name}"
    classes = [getattr(errors, name) for name in errors.__all__
               if isinstance(getattr(errors, name), type) and issubclass(getattr(errors, name), BaseException)]
    assert len(classes) >= 13
    built_in = {cls for cls in vars(builtins).values() if isinstance(cls, type) and issubclass(cls, BaseException)}
    for cls in classes:
        assert cls.__module__ == "recurrent_cache.errors"
        assert getattr(recurrent_cache, cls.__name__) is cls and cls.__name__ in recurrent_cache.__all__
        if cls is not errors.RecurrentCacheError:
            assert issubclass(cls, errors.RecurrentCacheError)
            assert set(cls.__mro__) & (built_in - {Exception, BaseException, object}), \
                f"{cls.__name__} derives from no built-in a caller would catch"
    for module, name in (("prefix_cache", "NoFreeCellError"), ("models", "ModelError"),
                         ("models.gguf_file", "GGUFError"), ("models.gguf_io", "GGUFError")):
        imported = __import__(f"recurrent_cache.{module}", fromlist=[name])
        assert getattr(imported, name) is getattr(errors, name)
