"""The compiled KV table out of memory: prepare, load_seq and load raise MemoryError and leave the
table as it was.  Run in a child process whose address space is capped (RLIMIT_AS) just above what
it holds once the table is filled, so the journal, or the pairs' pool, cannot grow."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent('''
    import resource
    import numpy as np
    from recurrent_cache._kv_cells import KVCells

    size = 1 << 21
    # a sliding window: a token reusing a cell may purge its whole sequence, so the journal must
    # make room for every cell of it first
    table = KVCells(size, 2, 4, "standard")
    chunk = 1 << 14
    for start in range(0, size, chunk):
        table.place_arrays(np.arange(start, start + chunk, dtype=np.int32), np.zeros(chunk, np.int32),
                           np.arange(chunk + 1, dtype=np.int32))
    # two ubatches: the first is placed (and undone) for the second to see, which takes the journal's room
    prepare_args = [(np.asarray([size], np.int32), np.zeros(1, np.int32), np.arange(2, dtype=np.int32)),
                    (np.asarray([size + 1], np.int32), np.zeros(1, np.int32), np.arange(2, dtype=np.int32))]
    load_args = (np.arange(size, dtype=np.int32), np.tile(np.asarray([0, 1], np.int32), size),
                 np.arange(0, 2 * size + 1, 2, dtype=np.int32))          # twice the pairs the table holds

    def state():
        return (table.used, table.head, table.used_max_p1, table.seq_pos_min(0), table.seq_pos_max(0),
                table.seq_pos_min(1), table.cell(0), table.cell(size // 2), table.cell(size - 1))

    before = state()
    held = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (held + (16 << 20), resource.RLIM_INFINITY))
    for name, call in [("prepare", lambda: table.prepare(prepare_args)), ("load_seq", lambda: table.load_seq(0, [5])),
                       ("load", lambda: table.load(*load_args))]:
        try:
            call()
        except MemoryError:
            assert state() == before, name
            print(name, "refused")
        else:
            print(name, "did not run out of memory")
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    table.check()
    assert state() == before
    assert [slot.tolist() for slot in table.prepare(prepare_args)] == [[0], [1]]
''')


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="caps the address space through RLIMIT_AS and "
                    "reads /proc/self/status: Linux only")
def test_running_out_of_memory_changes_nothing():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:3] == ["prepare refused", "load_seq refused", "load refused"], done.stdout
