"""Every file the package writes is written whole or not at all (``recurrent_cache.atomic_write``).

A write that fails part-way - here a file-size limit (``RLIMIT_FSIZE``, what a full disk
looks like to the writer: ``EFBIG`` after some bytes) in a child interpreter - must leave
the previous file exactly as it was and no temporary file behind: sequence and session
files, GGUF files (``write_gguf``, ``convert``) and store entries.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

from recurrent_cache.atomic_write import atomic_write
from recurrent_cache.errors import ModelError

resource = pytest.importorskip("resource", reason="RLIMIT_FSIZE is POSIX")

LIMIT = 4096        # bytes a child may write to one file; every new file below is larger
OLD = b"the previous content, which must survive"

# Each child writes a file larger than LIMIT over ``path`` and prints what the write raised.
WRITERS = {
    "save_seq_file": """
        cache = rc.RecurrentCache(1, 4096, 1, n_seq_max=1)
        list(cache.init_batch(rc.Batch(token=[1], pos=[0], seq_id=[0])))
        rc.save_seq_file(path, cache, 0, [1])
    """,
    "save_session_file": """
        cache = rc.RecurrentCache(1, 4096, 1, n_seq_max=1)
        list(cache.init_batch(rc.Batch(token=[1], pos=[0], seq_id=[0])))
        rc.save_session_file(path, cache, [1], "mamba")
    """,
    "write_gguf": """
        from recurrent_cache.models import random_model, write_gguf
        write_gguf(random_model(seed=0, n_vocab=100, n_embd=16, n_layer=1, d_state=4), path)
    """,
}

PRELUDE = """
import os, resource, signal, sys
import numpy as np
import recurrent_cache as rc
path = sys.argv[1]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
try:
{body}
except OSError as exc:
    print("failed:", exc)
else:
    print("written")
"""


def run_limited(body: str, path: Path) -> str:
    """``body`` in a child interpreter whose files may not grow past LIMIT bytes; its output."""
    script = PRELUDE.format(limit=LIMIT, body=textwrap.indent(textwrap.dedent(body), "    "))
    result = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_write_that_fails_part_way_leaves_the_old_file_and_no_temporary(tmp_path, writer):
    if writer == "write_gguf":
        pytest.importorskip("gguf", reason="writing GGUF files needs the gguf package")
    path = tmp_path / "target"
    path.write_bytes(OLD)
    assert run_limited(WRITERS[writer], path).startswith("failed:")
    assert path.read_bytes() == OLD
    assert [item.name for item in tmp_path.iterdir()] == ["target"]


def test_a_store_put_that_fails_part_way_keeps_the_previous_entry(tmp_path):
    directory = tmp_path / "store"
    script = f"""
import resource, signal, sys
import numpy as np
from recurrent_cache.formats.geometry import Geometry
from recurrent_cache.stores import DirectoryStore, encode_snapshot, snapshot_key
geometry = Geometry(1, 4096, 1)
key = snapshot_key("atomic", geometry, [1])

def entry(value):
    return encode_snapshot(key, [1], [np.full(4096, value, np.float32)], [np.zeros(1, np.float32)], geometry)

store = DirectoryStore(sys.argv[1])
assert store.put(key, entry(1.0))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, ({LIMIT}, {LIMIT}))
assert not store.put(key, entry(2.0))   # EFBIG: logged, counted, nothing changed
assert store.get_many([key])[0] == entry(1.0)
assert store.stats()["errors"] == 1
"""
    result = subprocess.run([sys.executable, "-c", script, str(directory)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    names = sorted(item.name for item in directory.iterdir())
    assert len(names) == 2 and not any(name.endswith(".tmp") for name in names), names   # the link and its file


def test_the_block_that_raises_leaves_the_target_and_no_temporary(tmp_path):
    path = tmp_path / "target"
    path.write_bytes(OLD)
    with pytest.raises(KeyboardInterrupt), atomic_write(str(path)) as temporary:
        Path(temporary).write_bytes(b"half of the new")
        raise KeyboardInterrupt
    assert path.read_bytes() == OLD
    assert [item.name for item in tmp_path.iterdir()] == ["target"]
    with atomic_write(str(path)) as temporary:
        Path(temporary).write_bytes(b"new")
    assert path.read_bytes() == b"new"
    assert [item.name for item in tmp_path.iterdir()] == ["target"]


# -- f16 cannot hold every finite weight ----------------------------------------------------------

def test_an_f16_file_refuses_a_weight_beyond_f16_naming_it_and_writes_nothing(tmp_path):
    pytest.importorskip("gguf", reason="writing GGUF files needs the gguf package")
    from recurrent_cache.models import random_model, write_gguf
    model = random_model(seed=0, n_vocab=100, n_embd=16, n_layer=1, d_state=4)
    model.layers[0].ssm_in[2, 3] = 70000.0      # finite, beyond f16's 65504
    path = tmp_path / "out.gguf"
    path.write_bytes(OLD)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # no numpy overflow warning leaks
        with pytest.raises(ModelError, match=r"tensor blk\.0\.ssm_in\.weight: value 70000\.0 at index .* f16"):
            write_gguf(model, path, file_type="f16")
    assert path.read_bytes() == OLD
    assert [item.name for item in tmp_path.iterdir()] == ["out.gguf"]
    write_gguf(model, path, file_type="f32")    # f32 holds it
    from recurrent_cache.models import load_gguf
    assert load_gguf(path).layers[0].ssm_in[2, 3] == 70000.0


def test_values_that_round_to_f16s_largest_are_kept(tmp_path):
    """65519 rounds to 65504 (f16's largest): not an overflow; 65520 rounds to infinity: one."""
    pytest.importorskip("gguf", reason="writing GGUF files needs the gguf package")
    from recurrent_cache.models import load_gguf, random_model, write_gguf
    model = random_model(seed=0, n_vocab=100, n_embd=16, n_layer=1, d_state=4)
    model.layers[0].ssm_out[0, 0] = -65519.0
    write_gguf(model, tmp_path / "ok.gguf", file_type="f16")
    assert load_gguf(tmp_path / "ok.gguf").layers[0].ssm_out[0, 0] == -65504.0
    model.layers[0].ssm_out[0, 0] = -65520.0
    with pytest.raises(ModelError, match=r"ssm_out\.weight: value -65520\.0"):
        write_gguf(model, tmp_path / "bad.gguf", file_type="f16")
    assert not (tmp_path / "bad.gguf").exists()
    assert np.isfinite(load_gguf(tmp_path / "ok.gguf").layers[0].ssm_out).all()
