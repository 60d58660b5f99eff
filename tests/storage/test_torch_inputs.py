"""Torch tensors of every flavour on every surface that takes them, on both paths of a torch cache.

Each input is given to two caches that differ only in their path: ``TorchStorage("cpu")`` (the core moves
rows in host memory) and ``TorchStorage("cpu", host_access=False)`` (the index path a GPU runs).  Both must
answer alike: the same resulting cells and bytes for an input they take, the same package exception for
one they refuse, with the cache (cells, rows, state bytes) exactly as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache.storage import TorchStorage
from rows import host

torch = pytest.importorskip("torch")

PATHS = {"host": lambda: TorchStorage("cpu"), "index": lambda: TorchStorage("cpu", host_access=False)}
N_EMBD_R, N_EMBD_S = 3, 4
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def served_cache(storage: TorchStorage, dtype: str = "f32") -> rc.RecurrentCache:
    """A cache whose sequences 0 and 1 hold states written by a torch 'model' (rows of distinct values);
    sequences 2 and 3 hold no cell."""
    cache = rc.RecurrentCache(n_layer=2, n_embd_r=N_EMBD_R, n_embd_s=N_EMBD_S, n_seq_max=4, dtype_r=dtype,
                              dtype_s=dtype, n_rollback=2, engine="compiled", storage=storage)
    step(cache, rc.Batch(token=[1, 2, 3, 4], seq_id=[0, 0, 1, 1], pos=[0, 1, 0, 1]))
    return cache


def step(cache: rc.RecurrentCache, batch: rc.Batch) -> None:
    """A ubatch-by-ubatch torch 'model': each state row adds its group's index plus one."""
    st = cache.init_batch(batch)
    for ub in st:
        for il in cache.layers:
            bump = torch.arange(1, ub.n_seqs + 1, dtype=torch.float32)[:, None]
            st.r(il).add_(bump.to(st.r(il).dtype))
            st.s(il).add_((2 * bump).to(st.s(il).dtype))


def everything(cache: rc.RecurrentCache) -> tuple[Any, ...]:
    """Cells, every row (free cells' too) and the state bytes: what a refused call must leave alone."""
    return ([cache.cell(i) for i in range(cache.size)], [host(t).tobytes() for t in cache.tensors],
            cache.state_write())


def outcome(path: str, call: Callable[[rc.RecurrentCache], Any]) -> tuple[Any, ...]:
    """What ``call`` does to a served cache on ``path``: ("ok", cells and bytes after), or
    (the exception's class, its message) after checking that the cache is unchanged."""
    cache = served_cache(PATHS[path]())
    before = everything(cache)
    try:
        call(cache)
    except Exception as exc:
        assert everything(cache) == before, f"{path}: a refused call changed the cache"
        return type(exc), str(exc)
    cache.check()
    assert not any(t.requires_grad or t.grad_fn is not None for t in cache.tensors)
    return "ok", everything(cache)


def same_on_both_paths(call: Callable[[rc.RecurrentCache], Any]) -> tuple[Any, ...]:
    on_host, on_index = outcome("host", call), outcome("index", call)
    assert on_host == on_index
    return on_host


# -- rows of every flavour, given to seq_restore ----------------------------------------------------------

def row_values(width: int) -> Any:
    return torch.linspace(-1.5, 2.5, width)


def inference_row(width: int) -> Any:
    with torch.inference_mode():
        return row_values(width)


TAKEN = {   # rows the cache reads (their values: row_values)
    "plain": row_values,
    "requires_grad": lambda width: row_values(width).requires_grad_(),
    "with_grad_fn": lambda width: row_values(width).requires_grad_() * 1.0,
    "parameter": lambda width: torch.nn.Parameter(row_values(width)),
    "inference": inference_row,
    "non_contiguous": lambda width: torch.stack([row_values(width), -row_values(width)], 1)[:, 0],
    "transposed": lambda width: torch.stack([row_values(width), -row_values(width)]).T[:, 0],
    "stride_0": lambda width: torch.tensor(0.75).expand(width),
}

REFUSED = {   # rows it cannot read or that are not rows of its tensors: an ArgumentError naming them
    "sparse_coo": lambda width: row_values(width).to_sparse(),
    "sparse_csr": lambda width: row_values(width)[None].to_sparse_csr(),   # (CSR has no 1-D rows)
    "meta": lambda width: row_values(width).to("meta"),
    "float64": lambda width: row_values(width).double(),
    "float16": lambda width: row_values(width).half(),
    "too_long": lambda width: row_values(width + 1),
    "2-D": lambda width: row_values(width)[None],
    "0-D": lambda width: torch.tensor(1.0),
    "int32": lambda width: torch.arange(width, dtype=torch.int32),
}


def restore_with(make: Callable[[int], Any]) -> Callable[[rc.RecurrentCache], Any]:
    """seq_restore of sequence 2 with r_rows[1] made by ``make`` (the other rows plain)."""
    def call(cache: rc.RecurrentCache) -> int:
        r_rows = [row_values(N_EMBD_R) + 10, make(N_EMBD_R)]
        s_rows = [row_values(N_EMBD_S) + 20, row_values(N_EMBD_S) + 30]
        return cache.seq_restore(2, 5, r_rows, s_rows)
    return call


@pytest.mark.parametrize("flavour", list(TAKEN))
def test_rows_of_every_readable_flavour_are_restored_alike_on_both_paths(flavour):
    result = same_on_both_paths(restore_with(TAKEN[flavour]))
    assert result[0] == "ok"
    cache = served_cache(PATHS["index"]())
    cache.seq_restore(2, 5, [torch.zeros(N_EMBD_R), TAKEN[flavour](N_EMBD_R).detach()],
                      [torch.zeros(N_EMBD_S)] * 2)
    assert torch.equal(cache.r[1][cache.seq_cell(2)], TAKEN[flavour](N_EMBD_R).detach())


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("flavour", list(REFUSED))
def test_rows_that_cannot_be_read_are_refused_alike_changing_nothing(flavour):
    kind, message = same_on_both_paths(restore_with(REFUSED[flavour]))
    assert kind is rc.ArgumentError and "seq_restore: r_rows[1]" in message


def test_a_row_that_is_a_view_of_the_cache_itself_is_copied_on_both_paths():
    def call(cache: rc.RecurrentCache) -> int:
        cell = cache.seq_cell(1)
        return cache.seq_restore(2, 5, [cache.r[il][cell] for il in cache.layers],
                                 [cache.s[il][cell] for il in cache.layers])
    same_on_both_paths(call)
    cache = served_cache(PATHS["index"]())
    call(cache)
    assert [host(t[:, cache.seq_cell(2)]).tobytes() for t in cache.tensors] == \
        [host(t[:, cache.seq_cell(1)]).tobytes() for t in cache.tensors]


@pytest.mark.parametrize("path", list(PATHS))
def test_a_row_that_requires_grad_leaves_no_graph_in_the_cache(path):
    cache = served_cache(PATHS[path]())
    weight = torch.nn.Parameter(torch.ones(N_EMBD_R))
    cache.seq_restore(2, 5, [weight * 2, weight * 3], [torch.ones(N_EMBD_S, requires_grad=True)] * 2)
    step(cache, rc.Batch(token=[1, 2], seq_id=[2, 0], pos=[6, 2]))   # a later model step, in grad mode
    for tensor in cache.tensors:
        assert tensor.grad_fn is None and not tensor.requires_grad
    assert cache.r[0][cache.seq_cell(2)].tolist() == [3.0] * N_EMBD_R   # 2, plus the group's bump


@CUDA
@pytest.mark.parametrize("path", list(PATHS))
def test_rows_on_another_device_are_moved_to_the_cache_s(path):
    result = outcome(path, restore_with(lambda width: row_values(width).to("cuda")))
    assert result == outcome(path, restore_with(row_values))


# -- inference mode, both directions ----------------------------------------------------------------------

def serve_script(cache: rc.RecurrentCache) -> bytes:
    """Decode, a fork that moves on (copy on write), a rollback, a restore and a prefix-cache round trip."""
    step(cache, rc.Batch(token=[5], seq_id=[0], pos=[2]))
    cache.seq_cp(0, 3)
    step(cache, rc.Batch(token=[1, 1], seq_id=[0, 3], pos=[3, 3]))
    step(cache, rc.Batch(token=[1, 2, 3], seq_id=[1] * 3, pos=[2, 3, 4]))
    assert cache.seq_rm(1, 4, -1)
    r_rows, s_rows = cache.seq_state(0)
    cache.seq_rm(0, -1, -1)
    cache.seq_restore(0, 3, r_rows, s_rows)
    pc = rc.PrefixCache(cache, 1 << 12, block_size=2)
    assert pc.save(1, [1, 2, 3, 4])
    assert pc.restore(2, [1, 2, 3, 4, 9]) == 4
    return cache.state_write()


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("made, used", [(True, False), (False, True)], ids=["made_inside", "used_inside"])
def test_a_cache_made_inside_inference_mode_works_outside_and_the_other_way(path, made, used):
    expected = serve_script(served_cache(PATHS[path]()))
    with torch.inference_mode(made):
        cache = served_cache(PATHS[path]())
    with torch.inference_mode(used):
        assert serve_script(cache) == expected
    assert not any(t.is_inference() for t in cache.tensors)


# -- devices torch cannot serve ------------------------------------------------------------------------

UNSERVED = ["xpu", "hpu", "meta", "garbage", "cuda:99"]
if not torch.cuda.is_available():
    UNSERVED.append("cuda")


@pytest.mark.parametrize("device", UNSERVED)
def test_a_device_torch_cannot_serve_is_a_config_error_with_torch_s_reason(device):
    if device == "xpu" and torch.xpu.is_available():
        pytest.skip("this torch has an XPU device")
    for make in (lambda: TorchStorage(device), lambda: rc.RecurrentCache(1, 2, 2, storage="torch", device=device)):
        with pytest.raises(rc.ConfigError, match=f"device '{device}'") as info:
            make()
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("value", [torch.tensor([1, 0]), np.float64(1.0), "yes", 2])
def test_host_access_must_be_a_flag(value):
    with pytest.raises(rc.ConfigError, match="host_access must be True or False"):
        TorchStorage("cpu", host_access=value)


# -- constructor arguments of the wrong kind ------------------------------------------------------------

ODD = {"tensor_0d_float": torch.tensor(2.5), "tensor_1d": torch.tensor([1, 2]), "tensor_0d_bool": torch.tensor(True),
       "numpy_float": np.float64(2.0), "numpy_bool": np.bool_(True), "numpy_0d": np.array(1),
       "huge": 10**26, "uint64": np.uint64(2**63), "float": 2.5, "object": object()}


@pytest.mark.parametrize("argument", ["n_layer", "n_embd_r", "n_embd_s", "n_seq_max", "size", "dtype_r", "dtype_s",
                                      "n_rollback", "engine", "layers", "storage", "device"])
@pytest.mark.parametrize("name", list(ODD))
def test_recurrent_cache_arguments_of_the_wrong_kind_are_package_errors(argument, name):
    given = {"n_layer": 2, "n_embd_r": 3, "n_embd_s": 4, "storage": "torch", argument: ODD[name]}
    try:
        rc.RecurrentCache(**given)
    except rc.RecurrentCacheError:
        pass   # refused by the package; a value it reads as a valid one is fine too


@pytest.mark.parametrize("argument", ["max_bytes", "block_size", "store", "namespace", "cache"])
@pytest.mark.parametrize("name", list(ODD))
def test_prefix_cache_arguments_of_the_wrong_kind_are_package_errors(argument, name):
    given = {"cache": rc.RecurrentCache(2, 3, 4, storage="torch"), "max_bytes": 1 << 12, argument: ODD[name]}
    try:
        rc.PrefixCache(**given)
    except rc.RecurrentCacheError:
        pass


@pytest.mark.parametrize("max_bytes", [2**62, 10**26])
@pytest.mark.parametrize("path", list(PATHS))
def test_a_prefix_cache_too_big_to_allocate_is_a_config_error_naming_its_size(path, max_bytes):
    cache = served_cache(PATHS[path]())
    with pytest.raises(rc.ConfigError, match=f"max_bytes={max_bytes}: [0-9]+ snapshots of 56 bytes"):
        rc.PrefixCache(cache, max_bytes)


@pytest.mark.parametrize("storage", ["numpy", "torch"])
def test_a_cache_too_big_to_allocate_is_a_config_error_naming_its_size(storage):
    with pytest.raises(rc.ConfigError, match="cannot allocate the cache \\(size=2147483647: [0-9]+ bytes"):
        rc.RecurrentCache(2, 3, 4, size=2**31 - 1, storage=storage)
    with pytest.raises(rc.ConfigError, match="n_rollback=1073741824"):
        rc.RecurrentCache(2, 3, 4, n_rollback=2**30, storage=storage)


def test_kv_section_must_be_a_flag():
    blob = served_cache(PATHS["host"]()).state_write()
    call = (lambda cache: cache.state_read(blob, kv_section=torch.tensor([1, 0])))
    kind, message = same_on_both_paths(call)
    assert kind is rc.ArgumentError and "kv_section must be True or False" in message


def test_a_tensor_is_not_a_state_blob_on_either_path():
    blob = served_cache(PATHS["host"]()).state_write()
    as_tensor = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    kind, message = same_on_both_paths(lambda cache: cache.state_read(as_tensor))
    assert kind is rc.ArgumentError and "got Tensor" in message


@pytest.mark.parametrize("path", list(PATHS))
def test_a_prefix_cache_restores_rows_given_with_grad_as_plain_rows(path):
    cache = served_cache(PATHS[path]())
    cache.seq_restore(2, 3, [torch.ones(N_EMBD_R, requires_grad=True)] * 2, [torch.ones(N_EMBD_S) * 2] * 2)
    pc = rc.PrefixCache(cache, 1 << 12, block_size=2)
    assert pc.save(2, [7, 7, 7, 7])
    assert pc.restore(3, [7, 7, 7, 7, 1]) == 4
    assert torch.equal(cache.s[1][cache.seq_cell(3)], torch.full((N_EMBD_S,), 2.0))
    assert not any(t.requires_grad or t.grad_fn is not None for t in (*cache.tensors, *cache.seq_state(3)[0]))
