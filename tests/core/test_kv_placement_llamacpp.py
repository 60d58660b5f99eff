"""KV placement equal to llama.cpp's, cell for cell: tests/data/llamacpp_kv/placement.json replayed.

The recording (written by tools of the kv-bytes work from llama-cpp-python 0.3.36 with a small
hybrid GGUF) lists scenarios: a KV size, the sequences, the sliding window, and steps — each
decode as llama.cpp split it into ubatches, each sequence operation — with llama.cpp's cells
(``null`` or ``[pos, [seq ids]]`` per cell) and ``head`` after every step (after every ubatch
for a decode).  Both tables replay every unified scenario and must hold exactly those cells and
that head after every step.  A ``seq_rm`` llama.cpp's hybrid memory refused (``"ok": false``:
its recurrent half refused a partial removal) never reached its KV cache, so it is not replayed.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from recurrent_cache import kv_reference
from recurrent_cache._kv_cells import KVCells as CompiledCells

RECORDING = Path(__file__).resolve().parents[1] / "data" / "llamacpp_kv" / "placement.json"
TABLES = {"compiled": CompiledCells, "reference": kv_reference.KVCells}


def recorded_cells(cells):
    return [None if cell is None else (cell[0], tuple(sorted(cell[1]))) for cell in cells]


def replay(table_class, scenario):
    """Replay one scenario; the first disagreement with llama.cpp as a message, or None."""
    table = table_class(scenario["kv_size"], scenario["n_seq_max"], scenario["n_swa"], scenario["swa_type"])
    for number, step in enumerate(scenario["steps"]):
        where = f"{scenario['name']}: step {number} ({step['op']})"
        if step["op"] == "decode":
            for u, (ubatch, cells) in enumerate(zip(step["ubatches"], step["cells_per_ubatch"])):
                slot = table.place([token[1] for token in ubatch], [token[2] for token in ubatch])
                if slot is None:
                    return f"{where}, ubatch {u}: no slot found, llama.cpp placed it"
                if table.cells() != recorded_cells(cells):
                    return f"{where}, ubatch {u}: cells {table.cells()} != llama.cpp's {recorded_cells(cells)}"
        elif step["op"] == "seq_rm":
            if step["ok"]:
                table.seq_rm(step["seq"], step["p0"], step["p1"])
        elif step["op"] == "seq_cp":
            table.seq_cp(step["src"], step["dst"], step["p0"], step["p1"])
        elif step["op"] == "seq_keep":
            table.seq_keep(step["seq"])
        elif step["op"] == "seq_add":
            table.seq_add(step["seq"], step["p0"], step["p1"], step["delta"])
        elif step["op"] == "seq_div":
            table.seq_div(step["seq"], step["p0"], step["p1"], step["d"])
        elif step["op"] == "clear":
            table.clear()
        else:
            return f"{where}: unknown operation"
        table.check()
        if table.cells() != recorded_cells(step["cells"]):
            return f"{where}: cells {table.cells()} != llama.cpp's {recorded_cells(step['cells'])}"
        if table.head != step["head"]:
            return f"{where}: head {table.head} != llama.cpp's {step['head']}"
    return None


def scenarios():
    if not RECORDING.exists():
        return []
    return json.loads(RECORDING.read_text(encoding="utf-8"))["scenarios"]


@pytest.fixture(scope="module")
def recording():
    if not RECORDING.exists():
        pytest.skip(f"{RECORDING.relative_to(RECORDING.parents[3])} is not recorded yet (the kv-bytes work "
                    "records it from llama-cpp-python 0.3.36; the branches meet at the merge)")
    return json.loads(RECORDING.read_text(encoding="utf-8"))


@pytest.mark.parametrize("engine", sorted(TABLES))
def test_every_unified_scenario_places_as_llamacpp(recording, engine):
    unified = [scenario for scenario in recording["scenarios"] if scenario["unified"]]
    assert unified, "the recording has no unified (single-stream) scenario"
    failures = [message for scenario in unified if (message := replay(TABLES[engine], scenario))]
    assert failures == []


def test_the_replay_notices_a_cell_llamacpp_did_not_hold(recording):
    """The comparison can fail: one recorded cell's position changed, the replay reports that step."""
    scenario = copy.deepcopy(next(s for s in recording["scenarios"] if s["unified"] and s["steps"]))
    last = scenario["steps"][-1]
    cells = last["cells"]
    used = [i for i, cell in enumerate(cells) if cell is not None]
    if used:
        cells[used[0]][0] += 1
    else:
        cells[0] = [0, [0]]
    message = replay(kv_reference.KVCells, scenario)
    assert message is not None and f"step {len(scenario['steps']) - 1}" in message


def test_the_replay_notices_a_wrong_head(recording):
    scenario = copy.deepcopy(next(s for s in recording["scenarios"] if s["unified"] and s["steps"]))
    scenario["steps"][-1]["head"] += 1
    assert "head" in (replay(CompiledCells, scenario) or "")
