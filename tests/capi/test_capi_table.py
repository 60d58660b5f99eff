"""Every entry of the C API's table, called through ctypes: same results as the Python API,
every cheaply checkable bad argument rejected with a code and the Python API's message,
and nothing changed by a rejected call."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache import _placement, errors
from capi_table import P, Ubatch, header_codes, i32, ints, message, size_t, table

T = table()


def three_sequences() -> rc.RecurrentCache:
    cache = rc.RecurrentCache(2, 3, 4, n_seq_max=6, size=8)
    for _ in cache.init_batch(rc.Batch(token=[1, 2, 3, 4], seq_id=[0, 0, 1, 2], pos=[0, 1, 0, 0])):
        pass
    for k, array in enumerate(cache.r + cache.s):
        array[...] = np.arange(array.size).reshape(array.shape) + 100 * k
    return cache


@pytest.fixture
def cache():
    return three_sequences()


@pytest.fixture
def ctx(cache):
    handle = T.ctx_new(cache)
    yield handle
    assert T.ctx_free(handle) == 0


def state(cache) -> tuple:
    return [cache.cell(i) for i in range(cache.size)], cache.head, cache.used, cache.state_write()


def batch_init(ctx, seq_ids, pos, offsets=None, output=None, n_ubatch=512, flags=0, n_tokens=None):
    batch = P()
    n = len(pos) if n_tokens is None else n_tokens
    flags_array = None if output is None else (ctypes.c_int8 * len(output))(*output)
    code = T.batch_init(ctx, n, ints(seq_ids), None if offsets is None else ints(offsets), ints(pos), flags_array,
                        n_ubatch, flags, ctypes.byref(batch))
    return code, batch


def apply_all(batch) -> list[tuple]:
    reports, ub = [], Ubatch()
    while (code := T.batch_apply(batch, ctypes.byref(ub))) == 1:
        reports.append((ub.index, ub.head, ub.n_seqs, ub.n_seq_tokens, ub.first_output, ub.n_outputs,
                        [ub.token_order[k] for k in range(ub.n_tokens)], [ub.output[k] for k in range(ub.n_tokens)]))
    assert code == 0
    return reports


def test_codes_agree_with_the_one_table():
    codes = header_codes()
    assert codes["RC_OK"] == errors.OK
    for name, value in _placement.CODES.items():
        assert codes[f"RC_ERR_{name}"] == value == getattr(errors, name), name
    capi = {name: value for name, value in vars(errors).items() if name.startswith("CAPI_")}
    assert capi and all(codes[f"RC_ERR_{name[5:]}"] == value for name, value in capi.items())
    assert len(set(codes.values())) == len(codes)
    for value in list(_placement.CODES.values()) + list(capi.values()):
        assert "unknown engine code" not in message(T, None, value)


BATCHES = [  # (seq_ids, offsets, pos, output, n_ubatch, flags)
    ([3, 3, 3, 4, 0, 1], None, [0, 1, 2, 0, 1, 1], None, 512, 0),
    ([3, 3, 3, 4, 0, 1], None, [0, 1, 2, 0, 1, 1], [1, 0, 1, 1, 0, 1], 2, 0),
    ([3, 5, 3, 5, 4, 0, 1], [0, 2, 4, 5, 6, 7], [0, 1, 0, 1, 1], None, 3, 0),    # shared tokens
    ([3, 3, 4, 4, 4, 0], None, [0, 1, 0, 1, 2, 1], None, 4, 2),    # pooled: one sequence per ubatch
    ([3, 4, 0], None, [0, 0, 1], None, 512, 1),                    # every token an output
]


@pytest.mark.parametrize("seq_ids, offsets, pos, output, n_ubatch, flags", BATCHES)
def test_a_batch_is_placed_and_reported_as_the_python_api_does(seq_ids, offsets, pos, output, n_ubatch, flags):
    in_c, in_python = rc.RecurrentCache(1, 2, 3, n_seq_max=8), rc.RecurrentCache(1, 2, 3, n_seq_max=8)
    for cache in (in_c, in_python):
        for _ in cache.init_batch(rc.Batch(token=[1, 2], seq_id=[0, 1], pos=[0, 0])):
            pass
        cache.s[0][...] = np.arange(cache.s[0].size).reshape(cache.s[0].shape)
    ctx = T.ctx_new(in_c)
    try:
        code, batch = batch_init(ctx, seq_ids, pos, offsets, output, n_ubatch, flags)
        assert code == 0, message(T, ctx, code)
        reports = apply_all(batch)
        n_out = i32()
        out_ids = T.batch_out_ids(batch, ctypes.byref(n_out))
        out = [out_ids[k] for k in range(n_out.value)]
        assert T.batch_n_ubatches(batch) == len(reports)
        T.batch_release(batch)
    finally:
        assert T.ctx_free(ctx) == 0
    lists = [seq_ids[offsets[t]:offsets[t + 1]] for t in range(len(pos))] if offsets else seq_ids
    st = in_python.init_batch(rc.Batch(token=[0] * len(pos), pos=pos, seq_id=lists, logits=output),
                              n_ubatch=n_ubatch, logits_all=bool(flags & 1), embd_pooled=bool(flags & 2))
    expected, first = [], 0
    for u, ub in enumerate(st):
        expected.append((u, st.head, ub.n_seqs, ub.n_seq_tokens, first, int(ub.output.sum()),
                         ub.batch_index.tolist(), ub.output.astype(int).tolist()))
        first += int(ub.output.sum())
    assert reports == expected
    assert out == st.out_ids.tolist()
    assert state(in_c) == state(in_python)


def test_null_handles_and_arrays_are_rejected():
    out, ub, n = P(), Ubatch(), size_t()
    assert T.size(None) == T.n_layer(None) == T.used(None) == -1
    assert T.batch_init(None, 1, ints([0]), None, ints([0]), None, 1, 0, ctypes.byref(out)) == errors.CAPI_NULL
    assert T.batch_apply(None, ctypes.byref(ub)) == errors.CAPI_NULL
    assert T.batch_n_ubatches(None) == errors.CAPI_NULL
    assert not T.batch_out_ids(None, None)
    T.batch_release(None)
    for call in (lambda: T.seq_rm(None, 0, -1, -1), lambda: T.seq_cp(None, 0, 1), lambda: T.seq_keep(None, 0),
                 lambda: T.seq_add(None, 0, 0, 1, 1), lambda: T.seq_div(None, 0, 0, 1, 2),
                 lambda: T.seq_pos_min(None, 0), lambda: T.seq_pos_max(None, 0), lambda: T.clear(None),
                 lambda: T.state_size(None, -1, ctypes.byref(n)), lambda: T.state_read(None, -1, None, 0),
                 lambda: T.state_write(None, -1, None, 0, ctypes.byref(n)), lambda: T.ctx_free(None),
                 lambda: T.tensor(None, 0, None, None)):
        assert call() == errors.CAPI_NULL
    assert message(T, None, errors.CAPI_NULL) == \
        "recurrent_cache: a NULL pointer where a handle or an array is required"


def test_bad_batches_are_rejected_with_the_python_messages_and_change_nothing(cache, ctx):
    before = state(cache)
    cases = [
        # (seq_ids, pos, offsets, n_ubatch, flags, n_tokens) -> code, message
        (([0], [2], None, 1, 0, 0), errors.CAPI_N_TOKENS, "rc_batch_init: n_tokens must be >= 1, got 0"),
        (([0], [2], None, 0, 0, None), errors.CAPI_N_UBATCH, "rc_batch_init: n_ubatch must be >= 1, got 0"),
        (([0], [2], None, 1, 4, None), errors.CAPI_FLAGS, "rc_batch_init: unknown flags 4"),
        (([0, 1], [2, 1], [0, 1, 1], 1, 0, None), errors.CAPI_OFFSETS, "seq_id_offsets[2] = 1 is out of order"),
        (([0, 1], [2, 1], [1, 1, 2], 1, 0, None), errors.CAPI_OFFSETS, "seq_id_offsets[0] = 1 is out of order"),
        (([0, 9], [2, 1], None, 1, 0, None), errors.SPLIT_SEQ_RANGE, "token 1: seq_id 9 is out of range [0, 8)"),
        (([0, 1], [2, -1], None, 1, 0, None), errors.SPLIT_NEGATIVE_POS, "token 1 has negative position -1"),
        (([0, 0], [2, 4], None, 1, 0, None), errors.SPLIT_GAP, "sequence 0 has non-consecutive positions"),
        (([1], [5], None, 1, 0, None), errors.SPLIT_CONTINUE, "sequence 1 continues at position 5, but its cached"),
        (([0], [2**31 - 1], None, 1, 0, None), errors.SPLIT_POS_MAX, "token 0 has position 2147483647"),
    ]
    for (seq_ids, pos, offsets, n_ubatch, flags, n_tokens), code, words in cases:
        got, batch = batch_init(ctx, seq_ids, pos, offsets, None, n_ubatch, flags, n_tokens)
        assert (got, batch.value) == (code, None), words
        assert words in message(T, ctx, code)
        assert state(cache) == before
    # the same batches raise the same words through the Python API
    with pytest.raises(rc.PositionError, match="sequence 1 continues at position 5, but its cached"):
        cache.init_batch(rc.Batch(token=[0], seq_id=[1], pos=[5]))


def test_a_batch_applied_after_a_change_is_stale(cache, ctx):
    code, batch = batch_init(ctx, [0, 1], [2, 1], n_ubatch=1)
    assert code == 0
    ub = Ubatch()
    assert T.batch_apply(batch, ctypes.byref(ub)) == 1
    assert T.seq_cp(ctx, 2, 5) == 0           # a change through the context
    before = state(cache)
    assert T.batch_apply(batch, ctypes.byref(ub)) == errors.CAPI_STALE
    assert "the cache changed since the batch was prepared" in message(T, ctx, errors.CAPI_STALE)
    assert state(cache) == before
    assert T.ctx_free(ctx) == errors.CAPI_OPEN_BATCHES   # refused: the batch is still open
    assert "1 batches of this context are not released" in message(T, ctx, errors.CAPI_OPEN_BATCHES)
    T.batch_release(batch)


def test_handles_of_one_cache_share_the_change_count(cache, ctx):
    other = T.ctx_new(cache)
    try:
        code, batch = batch_init(ctx, [0], [2])
        assert T.seq_rm(other, 2, -1, -1) == 1
        assert T.batch_apply(batch, ctypes.byref(Ubatch())) == errors.CAPI_STALE
        T.batch_release(batch)
    finally:
        assert T.ctx_free(other) == 0


def test_sequence_operations_equal_the_python_api(cache, ctx):
    twin = three_sequences()
    calls = [("seq_cp", (0, 4)), ("seq_add", (4, 0, 10, 3)), ("seq_div", (1, 0, 5, 2)), ("seq_rm", (2, 1, -1)),
             ("seq_rm", (2, -1, -1)), ("seq_keep", (4,)), ("seq_cp", (4, 7)), ("seq_rm", (-1, -1, -1))]
    for name, args in calls:
        got = getattr(T, name)(ctx, *args)
        expected = getattr(twin, name)(*args)
        assert got == (int(expected) if name == "seq_rm" else 0), name
        assert [cache.cell(i) for i in range(8)] == [twin.cell(i) for i in range(8)], name
        assert [T.seq_pos_max(ctx, s) for s in range(-1, 9)] == [twin.seq_pos_max(s) for s in range(-1, 9)]
        assert [T.seq_pos_min(ctx, s) for s in range(-1, 9)] == [twin.seq_pos_min(s) for s in range(-1, 9)]
    assert T.clear(ctx) == 0 and cache.used == 0 and not any(a.any() for a in cache.r + cache.s)


def test_bad_sequence_arguments_report_codes(cache, ctx):
    before = state(cache)
    assert T.seq_keep(ctx, 8) == errors.SEQ_RANGE
    assert message(T, ctx, errors.SEQ_RANGE) == "rc_seq_keep: seq_id 8 is out of range [0, 8)"
    assert T.seq_add(ctx, 0, 0, -1, -5) == errors.POSITION
    assert T.seq_div(ctx, 0, 0, -1, 0) == errors.ARGUMENT
    assert T.seq_add(ctx, -3, 0, -1, 1) == errors.SEQ_RANGE
    assert T.seq_rm(ctx, 0, 1, -1) == 0      # a recurrent state cannot be cut: refused
    assert T.seq_cp(ctx, 0, 99) == 0         # out of range: a no-op, as in llama.cpp and the Python API
    assert state(cache) == before


def test_state_round_trip_and_python_blobs(cache, ctx):
    n = size_t()
    for seq_id in (-1, 0, 1, 5):
        assert T.state_size(ctx, seq_id, ctypes.byref(n)) == 0
        assert n.value == cache.state_size(seq_id)
        target = ctypes.create_string_buffer(n.value + 3)
        written = size_t()
        assert T.state_write(ctx, seq_id, target, len(target), ctypes.byref(written)) == 0
        assert target.raw[:written.value] == cache.state_write(seq_id)
    blob, one = cache.state_write(), cache.state_write(1)
    other = rc.RecurrentCache(2, 3, 4, n_seq_max=6, size=8)
    octx = T.ctx_new(other)
    try:
        assert T.state_read(octx, 4, one, len(one)) == 0
        assert other.seq_pos_max(4) == cache.seq_pos_max(1)
        assert T.state_read(octx, -1, blob, len(blob)) == 0
        assert state(other)[0] == state(cache)[0] and other.state_write() == blob
    finally:
        assert T.ctx_free(octx) == 0


def test_bad_state_calls_are_rejected_with_the_python_messages(cache, ctx):
    before = state(cache)
    blob = cache.state_write()
    n, written = size_t(), size_t()
    for bad in (blob[:-1], blob + b"\0", b"", blob[:4]):
        code = T.state_read(ctx, -1, bad, len(bad))
        assert errors.CAPI_NULL < code < 0
        with pytest.raises(rc.StateError) as caught:
            cache.state_read(bad)
        assert message(T, ctx, code) == str(caught.value)
        assert state(cache) == before
    assert T.state_read(ctx, -2, blob, len(blob)) == errors.CAPI_STATE_SEQ
    assert message(T, ctx, errors.CAPI_STATE_SEQ) == "rc_state_read: seq_id -2 is out of range [-1, 8)"
    assert T.state_size(ctx, 8, ctypes.byref(n)) == errors.CAPI_STATE_SEQ
    small = ctypes.create_string_buffer(10)
    assert T.state_write(ctx, -1, small, 10, ctypes.byref(written)) == errors.CAPI_TARGET_SIZE
    assert message(T, ctx, errors.CAPI_TARGET_SIZE) == \
        f"rc_state_write: the target holds 10 bytes, the blob needs {len(blob)}"
    rows = cache.s[1].ctypes.data   # a target or a blob inside the cache's own rows
    assert T.state_write(ctx, 0, rows, cache.s[1].nbytes, ctypes.byref(written)) == errors.CAPI_OVERLAP
    assert T.state_read(ctx, -1, rows, 16) == errors.CAPI_OVERLAP
    assert state(cache) == before


def test_tensors_are_the_numpy_arrays(cache, ctx):
    data, row_bytes = P(), size_t()
    for k, array in enumerate(cache.r + cache.s):
        assert T.tensor(ctx, k, ctypes.byref(data), ctypes.byref(row_bytes)) == 0
        assert (data.value, row_bytes.value) == (array.ctypes.data, array.strides[0])
    assert T.tensor(ctx, 4, ctypes.byref(data), ctypes.byref(row_bytes)) == errors.CAPI_TENSOR_INDEX
    assert message(T, ctx, errors.CAPI_TENSOR_INDEX) == "rc_tensor: tensor index 4 is out of range [0, 4)"
    assert (T.size(ctx), T.n_layer(ctx), T.used(ctx)) == (8, 2, cache.used)


def test_a_context_needs_a_compiled_cache():
    with pytest.raises(TypeError, match="RecurrentCache"):
        T.ctx_new([1, 2])
    with pytest.raises(rc.ArgumentError, match="reference engine"):
        T.ctx_new(rc.RecurrentCache(1, 1, 1, engine="reference"))


def test_messages_fit_any_buffer(cache, ctx):
    T.seq_keep(ctx, 99)
    full = message(T, ctx, errors.SEQ_RANGE)
    small = ctypes.create_string_buffer(8)
    assert T.error_message(ctx, errors.SEQ_RANGE, small, 8) == len(full)
    assert small.value == full[:7].encode()
    assert T.error_message(ctx, errors.SEQ_RANGE, None, 0) == len(full)
    assert message(T, ctx, 0) == "no error"
    assert message(T, ctx, errors.SPLIT_GAP).endswith("(values not recorded: this context's last failure had "
                                                      "another code)")
    assert "unknown engine code -999" in message(T, ctx, -999)


# -- random operations: the C API on the compiled core against the Python API on the reference ----

def c_batch(ctx, rng_batch):
    seq_lists, pos, output, n_ubatch = rng_batch
    flat = [seq for seqs in seq_lists for seq in seqs]
    offsets = [0]
    for seqs in seq_lists:
        offsets.append(offsets[-1] + len(seqs))
    code, batch = batch_init(ctx, flat, pos, offsets, output, n_ubatch)
    if code != 0:
        return code, None
    ub, reports = Ubatch(), []
    data, row_bytes = P(), size_t()
    assert T.tensor(ctx, T.n_layer(ctx), ctypes.byref(data), ctypes.byref(row_bytes)) == 0
    while (applied := T.batch_apply(batch, ctypes.byref(ub))) == 1:
        for g in range(ub.n_seqs):   # the "model": s[0][head + g, 0] += tokens consumed
            row = ctypes.cast(data.value + (ub.head + g) * row_bytes.value, ctypes.POINTER(ctypes.c_float))
            row[0] += ub.n_seq_tokens
        reports.append((ub.head, ub.n_seqs, [ub.token_order[k] for k in range(ub.n_tokens)]))
    T.batch_release(batch)
    assert applied == 0
    return 0, reports


def python_batch(cache, rng_batch):
    seq_lists, pos, output, n_ubatch = rng_batch
    batch = rc.Batch(token=[0] * len(pos), pos=pos, seq_id=[list(s) for s in seq_lists], logits=output)
    st = cache.init_batch(batch, n_ubatch=n_ubatch)
    reports = []
    for ub in st:
        st.s(0)[:, 0] += ub.n_seq_tokens
        reports.append((st.head, ub.n_seqs, ub.batch_index.tolist()))
    return reports


def random_batch(rng, cache):
    """Mostly valid continuations, sometimes shared tokens, sometimes a defect."""
    seqs = rng.choice(cache.size, size=int(rng.integers(1, 4)), replace=False).tolist()
    seq_lists, pos = [], []
    for seq in seqs:
        start = cache.seq_pos_max(seq) + 1
        for k in range(int(rng.integers(1, 4))):
            seq_lists.append((seq,))
            pos.append(start + k)
    if rng.random() < 0.15:                                    # a token shared with another sequence
        other = int(rng.integers(cache.size))
        if other not in seqs and cache.seq_pos_max(other) < 0:
            seq_lists[-1] = (seq_lists[-1][0], other)
    if rng.random() < 0.15:                                    # a defect: out of range, gap, negative
        k = int(rng.integers(len(pos)))
        kind = int(rng.integers(3))
        if kind == 0:
            seq_lists[k] = (cache.size + 1,)
        else:
            pos[k] += 3 if kind == 1 else -(pos[k] + 2)
    output = rng.integers(0, 2, len(pos)).tolist() if rng.random() < 0.5 else None
    return seq_lists, pos, output, int(rng.integers(1, 6))


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_match_the_reference_engine(seed):
    rng = np.random.default_rng(seed)
    compiled = rc.RecurrentCache(1, 2, 3, n_seq_max=8, size=8)
    reference = rc.RecurrentCache(1, 2, 3, n_seq_max=8, size=8, engine="reference")
    ctx = T.ctx_new(compiled)
    try:
        for step in range(150):
            op = rng.choice(["batch"] * 5 + ["seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div", "state"])
            seq, other = (int(x) for x in rng.integers(-1, 9, 2))
            if op == "batch":
                b = random_batch(rng, reference)
                code, reports = c_batch(ctx, b)
                try:
                    expected = python_batch(reference, b)
                except rc.RecurrentCacheError as exc:
                    assert code < 0 and message(T, ctx, code) == str(exc), (step, b)
                else:
                    assert code == 0 and reports == expected, (step, b)
            elif op == "seq_rm":
                p0, p1 = (int(x) for x in rng.integers(-1, 6, 2))
                assert T.seq_rm(ctx, seq, p0, p1) == int(reference.seq_rm(seq, p0, p1))
            elif op == "seq_cp":
                assert T.seq_cp(ctx, seq, other) == 0
                reference.seq_cp(seq, other)
            elif op in ("seq_keep", "seq_add", "seq_div"):
                args = {"seq_keep": (seq,), "seq_add": (seq, 0, -1, other - 3), "seq_div": (seq, 0, -1, other)}[op]
                code = getattr(T, op)(ctx, *args)
                try:
                    getattr(reference, op)(*args)
                except rc.RecurrentCacheError:
                    assert code < 0, (step, op)
                else:
                    assert code == 0, (step, op)
            else:   # state: a sequence's blob written in C, read into another sequence in C and Python
                src, dst = int(rng.integers(8)), int(rng.integers(8))
                n, written = size_t(), size_t()
                assert T.state_size(ctx, src, ctypes.byref(n)) == 0
                blob = ctypes.create_string_buffer(n.value)
                assert T.state_write(ctx, src, blob, n.value, ctypes.byref(written)) == 0
                assert blob.raw == reference.state_write(src)
                assert T.state_read(ctx, dst, blob, n.value) == 0
                reference.state_read(blob.raw, dst)
            assert [compiled.cell(i) for i in range(8)] == [reference.cell(i) for i in range(8)], (step, op)
            assert (compiled.head, compiled.used) == (reference.head, reference.used), (step, op)
            assert compiled.s[0].tobytes() == reference.s[0].tobytes(), (step, op)
        assert compiled.used > 0
    finally:
        assert T.ctx_free(ctx) == 0
    compiled.check()


# -- rollback (API version 2) -------------------------------------------------------------------

def fill_steps_python(st, step, n_layer):
    """The Python API's model writing its step states: deterministic values per (tensor, g, j)."""
    for il in range(n_layer):
        for k, steps in ((il, st.r_steps(il)), (n_layer + il, st.s_steps(il))):
            for g in range(steps.shape[0]):
                for j in range(steps.shape[1]):
                    steps[g, j] = 1000 * step + 100 * k + 10 * g + j


def fill_steps_c(batch, n_tensors, n_seqs, step, row_bytes):
    m = T.batch_n_steps(batch)
    for k in range(n_tensors):
        for g in range(n_seqs):
            for j in range(m):
                row = P()
                assert T.batch_step_row(batch, k, g, j, ctypes.byref(row)) == 0
                values = np.full(row_bytes[k] // 4, 1000 * step + 100 * k + 10 * g + j, dtype=np.float32)
                ctypes.memmove(row, values.ctypes.data, row_bytes[k])
    return m


def test_rollback_through_the_c_api_equals_the_python_api():
    """The same prompts, step states and rollbacks through the C API and the Python API."""
    make = lambda: rc.RecurrentCache(2, 3, 4, n_seq_max=4, n_rollback=3)   # noqa: E731
    by_c, by_python = make(), make()
    handle = T.ctx_new(by_c)
    try:
        assert T.n_rollback(handle) == 3
        row_bytes = [t.shape[1] * 4 for t in by_c.r + by_c.s]
        schedule = [([0] * 6 + [1] * 6, list(range(6)) * 2), ([0, 1], [6, 6]), ([0, 1], [7, 7])]
        for step, (seq_ids, pos) in enumerate(schedule):
            code, batch = batch_init(handle, seq_ids, pos)
            assert code == 0
            ub = Ubatch()
            while T.batch_apply(batch, ctypes.byref(ub)) == 1:
                m = fill_steps_c(batch, 4, ub.n_seqs, step, row_bytes)
                assert m == min(3, ub.n_seq_tokens - 1)
            T.batch_release(batch)
            st = by_python.init_batch(rc.Batch(token=[0] * len(pos), seq_id=seq_ids, pos=pos))
            for _ in st:
                fill_steps_python(st, step, by_python.n_layer)
        for seq in (0, 1):
            assert T.seq_rollback_min(handle, seq) == by_python.seq_rollback_min(seq) == 4
        # the facade has not seen the C calls: compare through the state blobs and the queries
        assert T.seq_rm(handle, 0, 6, -1) == 1 and by_python.seq_rm(0, 6, -1)
        assert T.seq_rm(handle, 1, 2, -1) == 0 and not by_python.seq_rm(1, 2, -1)   # beyond reach
        assert T.seq_cp(handle, 1, 2) == 0
        by_python.seq_cp(1, 2)
        assert T.seq_rm(handle, 2, 7, -1) == 1 and by_python.seq_rm(2, 7, -1)      # copy on write
        assert by_c.state_write() == by_python.state_write()
        for seq in range(3):
            assert T.seq_rollback_min(handle, seq) == by_python.seq_rollback_min(seq)
        row = P()
        assert T.batch_step_row(None, 0, 0, 0, ctypes.byref(row)) == errors.CAPI_NULL
    finally:
        assert T.ctx_free(handle) == 0
