"""examples/capi/hybrid/: a hybrid model's decode loop in C (docs/c-api.md, "Hybrid memories"), built
with its own setup.py, leaves the cells and every K, V, r and s row exactly as the same loop through
the Python API, and reads the same masks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from recurrent_cache import Batch
from recurrent_cache.hybrid import HybridCache

from capi_hybrid import small_hybrid
from hybrid_model import same, snapshot

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "capi"


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    pytest.importorskip("setuptools")
    spec = importlib.util.spec_from_file_location("capi_build", EXAMPLES / "build.py")
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    return builder.load(builder.build_example("hybrid", tmp_path_factory.mktemp("hybrid")))


def python_decode(cache: HybridCache, n_seqs: int, n_steps: int) -> int:
    """The example's loop through the Python API; the visible mask entries."""
    visible = 0
    for _ in range(n_steps):
        pos = [cache.seq_pos_max(seq) + 1 for seq in range(n_seqs)]
        st = cache.init_batch(Batch(token=[0] * n_seqs, seq_id=list(range(n_seqs)), pos=pos), n_ubatch=4)
        for ub in st:
            values = [float(seq + 8 * p) for seq, p in zip(ub.seq_owner.tolist(), ub.pos.tolist())]
            for il in cache.attn_layers:
                for cell, value in zip(st.kv_cells.tolist(), values):
                    st.k(il)[cell] = value
                    if cache.v_trans:
                        st.v(il)[:, cell] = -value
                    else:
                        st.v(il)[cell] = -value
            for il in cache.recr_layers:
                st.r(il)[...] = np.array(values, dtype=np.float32)[:, None]
                st.s(il)[...] = -np.array(values, dtype=np.float32)[:, None]
            visible += int((st.kv_mask() == 0).sum())
    return visible


@pytest.mark.parametrize("config", [dict(), dict(v_trans=False), dict(attn_layers=[1], recr_layers=[0, 2])],
                         ids=["v_trans", "v_rows", "other_layers"])
def test_the_c_example_decodes_as_the_python_api(example, config):
    in_c, python = small_hybrid(kv_size=32, **config), small_hybrid(kv_size=32, **config)
    visible = example.decode(in_c, 4, 6)
    assert visible == python_decode(python, 4, 6) > 0
    assert same(snapshot(in_c), snapshot(python))
    assert in_c.kv_used == 24 and in_c.state_write() == python.state_write()


def test_the_c_example_reports_a_full_kv_cache_in_the_python_api_words(example):
    cache = small_hybrid(kv_size=8)
    with pytest.raises(RuntimeError, match="fit nowhere in the KV cache"):
        example.decode(cache, 4, 3)
    assert cache.kv_used == 8
