"""The storage interface (recurrent_cache.storage): every storage holds what the numpy storage holds.

Caches of one shape but different storages run the same random operation scripts in lockstep —
batches whose model reads the rows it is given and writes new rows and step states, every
sequence operation, rollbacks, state I/O, seq_state / seq_restore, prefix-cache saves and
restores — and after every operation they must hold identical cells, identical rows (every
row, even of empty cells), identical rollback histories and write identical bytes.  The
storages: torch on the CPU moved by the core in C, torch on the CPU through the index-array
path a GPU takes, a recording storage that delegates to numpy (so the interface is all the
core needs), and CUDA where a GPU is present.  The scripts also run with the histories read
only at the end (reading them files pending step states, which would hide a late filing),
on both engines: the reference on the storages with host memory.
"""

from __future__ import annotations

import io
import random
from typing import Any

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache import PrefixCache
from recurrent_cache.errors import ConfigError
from recurrent_cache.formats.dtypes import STATE_TYPES
from recurrent_cache.storage import NumpyStorage, Storage, TorchStorage

torch = pytest.importorskip("torch")

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the cuda storage runs on a GPU only")


class RecordingStorage:
    """A third storage: every call recorded, the work delegated to numpy, and no host view — so the
    core must hand every move over through the interface."""

    name = "recording"
    device = "cpu"

    def __init__(self) -> None:
        self.inner = NumpyStorage()
        self.calls: list[str] = []

    def allocate(self, shape, dtype):
        self.calls.append("allocate")
        return self.inner.allocate(shape, dtype)

    def host_view(self, tensor):
        return None

    def take(self, tensor, rows):
        self.calls.append("take")
        return self.inner.take(tensor, rows)

    def put(self, tensor, rows, values):
        self.calls.append("put")
        self.inner.put(tensor, rows, values)

    def zero(self, tensor, rows):
        self.calls.append("zero")
        self.inner.zero(tensor, rows)

    def stack(self, rows, dtype):
        self.calls.append("stack")
        return self.inner.stack(rows, dtype)

    def to_host(self, tensor):
        self.calls.append("to_host")
        return self.inner.to_host(tensor)

    def from_host(self, array, dtype):
        self.calls.append("from_host")
        return self.inner.from_host(array, dtype)


STORAGES = {
    "torch-cpu": lambda: TorchStorage("cpu"),
    "torch-cpu-indices": lambda: TorchStorage("cpu", host_access=False),
    "recording": RecordingStorage,
    "torch-cuda": lambda: TorchStorage("cuda"),
}
STORAGE_PARAMS = [pytest.param(name, marks=CUDA) if "cuda" in name else name for name in STORAGES]


def host(rows: Any) -> np.ndarray:
    """Rows of any storage as float64 on the host."""
    if isinstance(rows, np.ndarray):
        return rows.astype(np.float64)
    return rows.detach().to(torch.float64).cpu().numpy()


def assign(rows: Any, values: np.ndarray) -> None:
    if isinstance(rows, np.ndarray):
        rows[...] = values.astype(rows.dtype)
    else:
        rows.copy_(torch.from_numpy(values).to(rows.dtype))


def raw(cache: rc.RecurrentCache) -> list[bytes]:
    """Every row's bytes, of both kinds (even rows of empty cells)."""
    return [cache.storage.to_host(tensor).tobytes() for tensor in cache.tensors]


def run_model(st: rc.MemoryState, tokens: np.ndarray, layers: tuple[int, ...]) -> None:
    """A model whose states are small integers (exact in f32, f16 and bf16): each group's new row is a
    function of the row it was given and its tokens; the step states too."""
    for ub in st:
        n_seqs, n_seq_tokens = ub.n_seqs, ub.n_seq_tokens
        taken = tokens[np.asarray(ub.batch_index)].reshape(n_seqs, n_seq_tokens).astype(np.float64)
        for il in layers:
            for kind in ("r", "s"):
                rows = getattr(st, kind)(il)
                old = host(rows)
                steps = getattr(st, f"{kind}_steps")(il)
                m = steps.shape[1]
                for j in range(m):
                    assign(steps[:, j], (old * 5 + taken[:, j:j + 1] + il + j) % 241)
                assign(rows, (old * 3 + taken.sum(axis=1, keepdims=True) + il) % 251)


class Lockstep:
    """The same calls on a numpy cache (compiled) and on caches of other storages (and ``engine``),
    compared after each.  ``history_every_step=False`` reads the rollback histories only when
    ``check(history=True)`` asks: reading them files pending step states, so reading them after
    every step would leave the filing a later call does untested."""

    def __init__(self, storages: list[Storage], dtype: str, n_rollback: int, layers: tuple[int, ...] | None,
                 n_layer: int = 3, size: int = 6, engine: str = "compiled", history_every_step: bool = True,
                 n_embd_s: int = 6) -> None:
        options = dict(n_seq_max=size, dtype_r=dtype, dtype_s=dtype, n_rollback=n_rollback, layers=layers)
        self.history_every_step = history_every_step
        self.caches = [rc.RecurrentCache(n_layer, 4, n_embd_s, storage="numpy", engine="compiled", **options)]
        self.caches += [rc.RecurrentCache(n_layer, 4, n_embd_s, storage=storage, engine=engine, **options)
                        for storage in storages]
        self.layers = self.caches[0].layers
        self.prefix = [PrefixCache(cache, max_bytes=3 * 10 * 4 * n_layer * 2, block_size=2) for cache in self.caches]
        self.tokens: dict[int, list[int] | None] = {}   # each sequence's tokens (None: positions scrambled)
        self.steps = 0

    def each(self, call) -> Any:
        """``call(cache, index)`` on every cache: the same result or the same exception type."""
        outcomes = []
        for i, cache in enumerate(self.caches):
            try:
                outcomes.append(("ok", call(cache, i)))
            except rc.RecurrentCacheError as exc:
                outcomes.append(("raised", type(exc)))
        assert all(outcome == outcomes[0] for outcome in outcomes), outcomes
        self.check()
        return outcomes[0][1] if outcomes[0][0] == "ok" else None

    def check(self, history: bool | None = None) -> None:
        """Every cache holds what the first holds; the histories too when ``history`` (default: when
        the lockstep reads them after every step)."""
        self.steps += 1
        first = self.caches[0]
        expected = ([first.cell(i) for i in range(first.size)], first.head, first.used, raw(first),
                    first.state_write())
        if not (self.history_every_step if history is None else history):
            for cache in self.caches[1:]:
                got = ([cache.cell(i) for i in range(cache.size)], cache.head, cache.used, raw(cache),
                       cache.state_write())
                assert got == expected, f"{cache.storage!r} differs after step {self.steps}"
            return
        tags, history = first.memory_core.history()
        for cache in self.caches[1:]:
            got = ([cache.cell(i) for i in range(cache.size)], cache.head, cache.used, raw(cache), cache.state_write())
            assert got == expected, f"{cache.storage!r} differs after step {self.steps}"
            into = bytearray(len(expected[-1]))
            assert cache.state_write_into(into) == len(into) and bytes(into) == expected[-1]
            file = io.BytesIO()
            cache.state_write_into(file)
            assert file.getvalue() == expected[-1]
            other_tags, other_history = cache.memory_core.history()
            np.testing.assert_array_equal(other_tags, tags)
            assert [h.tobytes() for h in other_history] == [h.tobytes() for h in history]

    def batch(self, rng: random.Random) -> None:
        seqs = rng.sample(range(self.caches[0].size), rng.randint(1, 3))
        token, seq_id, pos = [], [], []
        for seq in seqs:
            start = self.caches[0].seq_pos_max(seq) + 1
            n = rng.randint(1, 4)
            new = [rng.randrange(100) for _ in range(n)]
            token += new
            seq_id += [seq] * n
            pos += range(start, start + n)
        batch = rc.Batch(token=token, seq_id=seq_id, pos=pos)
        n_ubatch = rng.randint(1, 8)
        tokens = np.array(token)
        if self.each(lambda cache, i: run_model(cache.init_batch(batch, n_ubatch), tokens, self.layers)) is None \
                and any(self.caches[0].seq_pos_max(s) < p for s, p in zip(seq_id, pos)):
            return
        for seq in seqs:
            known = self.tokens.get(seq, [])
            if known is not None:
                self.tokens[seq] = known + [t for t, s in zip(token, seq_id) if s == seq]

    def operation(self, rng: random.Random) -> None:
        size = self.caches[0].size
        seq, other = rng.randrange(size), rng.randrange(size)
        pos = self.caches[0].seq_pos_max(seq)
        choice = rng.randrange(10)
        if choice == 0:   # a rollback (or a removal when no state is held)
            p0 = max(0, pos - rng.randint(0, 3))
            self.each(lambda cache, i: cache.seq_rm(seq, p0, -1))
            if self.caches[0].seq_pos_max(seq) < 0:
                self.tokens.pop(seq, None)
            elif self.tokens.get(seq) is not None:
                self.tokens[seq] = self.tokens[seq][:self.caches[0].seq_pos_max(seq) + 1]
        elif choice == 1:
            self.each(lambda cache, i: cache.seq_cp(seq, other))
            self.tokens[other] = self.tokens.get(seq)
        elif choice == 2 and rng.random() < 0.3:
            self.each(lambda cache, i: cache.seq_keep(seq))
            self.tokens = {seq: self.tokens.get(seq)}
        elif choice == 3:
            shift = rng.randint(-2, 2)
            self.each(lambda cache, i: cache.seq_add(seq, 0, -1, shift))
            self.tokens[seq] = None
        elif choice == 4:
            d = rng.choice([1, 2])
            self.each(lambda cache, i: cache.seq_div(seq, 0, -1, d))
            self.tokens[seq] = None
        elif choice == 5:   # a blob of one sequence read into another
            blob = self.caches[0].state_write(seq)
            self.each(lambda cache, i: cache.state_write(seq) == blob and cache.state_read(blob, other))
            self.tokens[other] = self.tokens.get(seq) if pos >= 0 else None
        elif choice == 6 and rng.random() < 0.5:   # the whole cache, through bytes
            blob = self.caches[0].state_write()
            self.each(lambda cache, i: cache.state_read(blob))
        elif choice == 7 and pos >= 0:   # a state copied out and placed for another sequence
            def move(cache: rc.RecurrentCache, i: int) -> int:
                r_rows, s_rows = cache.seq_state(seq)
                cache.seq_rm(other)
                return cache.seq_restore(other, pos, r_rows, s_rows)
            self.each(move)
            self.tokens[other] = self.tokens.get(seq)
        elif choice == 8 and self.tokens.get(seq) and pos == len(self.tokens[seq]) - 1:
            tokens = self.tokens[seq]
            self.each(lambda cache, i: self.prefix[i].save(seq, tokens))
            self.each(lambda cache, i: (cache.seq_rm(other), self.prefix[i].restore(other, tokens + [1]))[1])
            self.tokens[other] = tokens if self.caches[0].seq_pos_max(other) >= 0 else None
        elif choice == 9 and rng.random() < 0.1:
            self.each(lambda cache, i: cache.clear())
            self.tokens = {}


def run(storages: list[Storage], dtype: str, n_rollback: int, layers: tuple[int, ...] | None, seed: int,
        n_ops: int = 60, engine: str = "compiled", history_every_step: bool = True, n_embd_s: int = 6) -> Lockstep:
    rng = random.Random(seed)
    lock = Lockstep(storages, dtype, n_rollback, layers, engine=engine, history_every_step=history_every_step,
                    n_embd_s=n_embd_s)
    for _ in range(n_ops):
        if rng.random() < 0.5:
            lock.batch(rng)
        else:
            lock.operation(rng)
    return lock


@pytest.mark.parametrize("layers", [None, (0, 2), ()], ids=["all-layers", "filtered", "no-layer"])
@pytest.mark.parametrize("n_rollback", [0, 3])
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("storage", STORAGE_PARAMS)
def test_every_storage_holds_what_numpy_holds(storage, dtype, n_rollback, layers):
    for seed in range(3):
        lock = run([STORAGES[storage]()], dtype, n_rollback, layers, seed)
        assert lock.steps >= 40   # operations checked (some ops are skipped when they do not apply)


# every storage on the compiled engine; the reference engine on the storages with host memory
ENGINE_PARAMS = [pytest.param(storage, "compiled", marks=CUDA, id=f"{storage}-compiled") if "cuda" in storage
                 else pytest.param(storage, "compiled", id=f"{storage}-compiled") for storage in STORAGES]
ENGINE_PARAMS += [pytest.param(storage, "reference", id=f"{storage}-reference") for storage in ("numpy", "torch-cpu")]


@pytest.mark.parametrize("layers", [None, (0, 2)], ids=["all-layers", "filtered"])
@pytest.mark.parametrize(("storage", "engine"), ENGINE_PARAMS)
def test_histories_read_only_at_the_end_match_too(storage, engine, layers):
    """No history read between steps: step states are filed by whichever later call comes first
    (a sequence operation, a state read, a prefix restore...), and must still land where numpy's do."""
    for seed in range(3):
        made = NumpyStorage() if storage == "numpy" else STORAGES[storage]()
        lock = run([made], "f32", 3, layers, seed, engine=engine, history_every_step=False)
        lock.check(history=True)
        assert lock.steps >= 40


def test_the_scripts_reach_every_kind_of_move():
    """The recording storage sees copies, zeroes, staged reads and step-state filing in these scripts."""
    storage = RecordingStorage()
    run([storage], "f32", 3, None, seed=0, n_ops=120)
    assert {"take", "put", "zero", "from_host", "to_host", "stack"} <= set(storage.calls)


def moves_of_one_apply(n_layer: int, n_moved: int) -> list[str]:
    """The storage calls of the one apply that copies n_moved forked states into their own cells."""
    storage = RecordingStorage()
    cache = rc.RecurrentCache(n_layer, 4, 6, n_seq_max=2 * n_moved + 1, storage=storage)
    run_model(cache.init_batch(rc.Batch(token=[1], seq_id=[0])), np.array([1]), cache.layers)
    for seq in range(1, n_moved + 1):
        cache.seq_cp(0, seq)
    storage.calls.clear()
    batch = rc.Batch(token=[2] * n_moved, seq_id=list(range(1, n_moved + 1)), pos=[1] * n_moved)
    cache.init_batch(batch).apply()
    return list(storage.calls)


def test_a_step_that_moves_rows_makes_calls_that_do_not_grow_with_rows_or_layers():
    calls = moves_of_one_apply(n_layer=1, n_moved=1)
    assert calls and calls.count("take") == 2 and calls.count("put") == 2   # one gather and one scatter per kind
    assert moves_of_one_apply(n_layer=8, n_moved=16) == calls


def test_a_decode_step_without_moves_makes_no_storage_call():
    storage = RecordingStorage()
    cache = rc.RecurrentCache(2, 4, 6, n_seq_max=4, storage=storage)
    batch = rc.Batch(token=[1, 2, 3, 4], seq_id=[0, 1, 2, 3])
    run_model(cache.init_batch(batch), np.array([1, 2, 3, 4]), cache.layers)
    storage.calls.clear()
    step = rc.Batch(token=[5, 6, 7, 8], seq_id=[0, 1, 2, 3], pos=[1, 1, 1, 1])
    run_model(cache.init_batch(step), np.array([5, 6, 7, 8]), cache.layers)
    assert storage.calls == []


@pytest.mark.parametrize("storage", STORAGE_PARAMS)
def test_rows_are_tensors_of_the_storage_and_views_of_the_cache(storage):
    made = STORAGES[storage]()
    cache = rc.RecurrentCache(3, 4, 6, n_seq_max=2, dtype_r="bf16", storage=made, layers=(1, 2))
    assert cache.r[0] is None and cache.storage is made
    kind = type(made.allocate((1,), STATE_TYPES["f32"]))
    assert isinstance(cache.r[1], kind) and tuple(cache.tensors[0].shape) == (2, 2, 4)
    st = cache.init_batch(rc.Batch(token=[1, 2], seq_id=[0, 1]))
    st.apply()
    assign(st.r(2), np.full((2, 4), 7.0))
    assert host(cache.r[2]).tolist() == [[7.0] * 4] * 2
    if storage.startswith("torch"):
        assert cache.r[1].dtype == torch.bfloat16 and cache.s[1].dtype == torch.float32
        assert str(cache.r[1].device).startswith(storage.split("-")[1])


def test_storage_arguments_are_checked():
    with pytest.raises(ConfigError, match="unknown storage 'jax'"):
        rc.RecurrentCache(1, 2, 2, storage="jax")
    with pytest.raises(ConfigError, match="device 'cuda:0' needs storage='torch'"):
        rc.RecurrentCache(1, 2, 2, device="cuda:0")
    with pytest.raises(ConfigError, match="device 'nowhere'"):
        rc.RecurrentCache(1, 2, 2, storage="torch", device="nowhere")
    with pytest.raises(ConfigError, match="a storage object, which has its own device"):
        rc.RecurrentCache(1, 2, 2, storage=NumpyStorage(), device="cpu")
    with pytest.raises(ConfigError, match="not int"):
        rc.RecurrentCache(1, 2, 2, storage=3)
    with pytest.raises(ConfigError, match="host_access=True needs device 'cpu'"):
        TorchStorage("meta", host_access=True)


def test_the_reference_engine_refuses_a_storage_without_host_memory():
    with pytest.raises(ConfigError, match="reference engine moves rows in host memory"):
        rc.RecurrentCache(1, 2, 2, engine="reference", storage=TorchStorage("cpu", host_access=False))
    cache = rc.RecurrentCache(1, 2, 2, engine="reference", storage="torch")   # torch on the CPU: host memory
    assert isinstance(cache.r[0], torch.Tensor)


def test_the_c_api_refuses_a_storage_it_cannot_address():
    from capi_table import table   # the C API's function table (tests/capi_table.py)
    T = table()
    with pytest.raises(ConfigError, match="the C API reads and writes state rows in host memory"):
        T.ctx_new(rc.RecurrentCache(1, 2, 2, storage=TorchStorage("cpu", host_access=False)))
    ctx = T.ctx_new(rc.RecurrentCache(1, 2, 2, storage="torch"))   # torch on the CPU works
    assert T.ctx_free(ctx) == 0


def test_the_deprecated_cell_table_refuses_a_storage_without_host_memory():
    with pytest.raises(rc.ArgumentError, match="cell_table hands out pointers to host rows"):
        assert rc.RecurrentCache(1, 2, 2, storage=TorchStorage("cpu", host_access=False)).cell_table is None
    assert rc.RecurrentCache(1, 2, 2, storage="torch").cell_table is not None


def test_without_torch_asking_for_it_says_how_to_get_it():
    import subprocess
    import sys
    code = ("import sys; sys.modules['torch'] = None\n"
            "import recurrent_cache as rc\n"
            "try:\n    rc.RecurrentCache(1, 2, 2, storage='torch')\n"
            "except rc.ConfigError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert "pip install 'recurrent_cache[torch]'" in out.stdout


@pytest.mark.parametrize("storage", ["numpy"] + STORAGE_PARAMS)
def test_to_host_is_a_copy_and_from_host_round_trips_the_bits(storage):
    made = NumpyStorage() if storage == "numpy" else STORAGES[storage]()
    for name in ("f32", "f16", "bf16"):
        dtype = STATE_TYPES[name]
        values = np.arange(24, dtype=np.float32).reshape(2, 3, 4).astype(dtype.numpy)
        tensor = made.from_host(values, dtype)
        host_copy = made.to_host(tensor)
        made.zero(tensor, np.array([0, 1, 2]))
        assert host_copy.dtype == dtype.numpy and host_copy.tobytes() == values.tobytes()   # not a view
        assert made.to_host(tensor).tobytes() == bytes(values.nbytes)


@pytest.mark.parametrize("storage", STORAGE_PARAMS)
def test_a_store_entry_of_a_torch_cache_is_the_numpy_cache_s(storage):
    from recurrent_cache.stores import Geometry, encode_snapshot, sequence_rows
    entries = []
    for made in ("numpy", STORAGES[storage]()):
        cache = rc.RecurrentCache(2, 3, 4, n_seq_max=2, dtype_r="bf16", dtype_s="f16", storage=made)
        st = cache.init_batch(rc.Batch(token=[1, 2, 3], seq_id=[0, 0, 0]))
        for _ in st:
            for il in range(2):
                assign(st.r(il), np.full((1, 3), 1.5 + il))
                assign(st.s(il), np.full((1, 4), -2.25 * il))
        r_rows, s_rows = sequence_rows(cache, 0)
        assert all(isinstance(row, np.ndarray) for row in r_rows + s_rows)
        entries.append(encode_snapshot("k", [1, 2, 3], r_rows, s_rows, Geometry.of(cache)))
    assert entries[0] == entries[1]
