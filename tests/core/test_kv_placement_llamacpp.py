"""KV placement equal to llama.cpp's, cell for cell: tests/data/llamacpp_kv/placement.json replayed.

The recording (written by tools of the kv-bytes work from llama-cpp-python 0.3.36 with a small
hybrid GGUF) lists scenarios: a KV size, the sequences, the sliding window, and steps — each
decode as llama.cpp split it into ubatches, each sequence operation — with llama.cpp's cells
(``null`` or ``[pos, [seq ids]]`` per cell) and ``head`` after every step (after every ubatch
for a decode).  Both tables replay every unified scenario and must hold exactly those cells and
that head after every step.  A ``seq_rm`` llama.cpp's hybrid memory refused (``"ok": false``:
its recurrent half refused a partial removal) never reached its KV cache, so it is not replayed.

Each scenario is replayed twice: placing each ubatch in turn (``place``), and as llama.cpp decodes
— ``prepare`` of all the decode's ubatches, which must change nothing, then ``apply`` of each at
the slot prepare gave; a decode llama.cpp refused for want of cells must get no slots.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from recurrent_cache import kv_reference
from recurrent_cache._kv_cells import KVCells as CompiledCells

RECORDING = Path(__file__).resolve().parents[1] / "data" / "llamacpp_kv" / "placement.json"
TABLES = {"compiled": CompiledCells, "reference": kv_reference.KVCells}


def recorded_cells(cells):
    return [None if cell is None else (cell[0], tuple(sorted(cell[1]))) for cell in cells]


def recorded_arrays(ubatch):
    """A recorded ubatch's tokens in place_arrays's encoding."""
    offsets = np.zeros(len(ubatch) + 1, np.int32)
    np.cumsum([len(token[2]) for token in ubatch], out=offsets[1:])
    flat = np.asarray([seq for token in ubatch for seq in token[2]], np.int32)
    return np.asarray([token[1] for token in ubatch], np.int32), flat, offsets


def prepared_slots(table, step, n_ubatch):
    """prepare of the decode's ubatches (a refused decode's batch cut at n_ubatch: its split was not
    recorded): the slots, or a message when prepare disagrees with llama.cpp or changed the table."""
    ubatches = step["ubatches"] or [step["batch"][start:start + n_ubatch]
                                    for start in range(0, len(step["batch"]), n_ubatch)]
    before = (table.cells(), table.head, table.used)
    slots = table.prepare([recorded_arrays(ubatch) for ubatch in ubatches])
    if (table.cells(), table.head, table.used) != before:
        return "prepare changed the table"
    if (slots is None) != (not step["ok"]):
        return f"prepare gave {slots}, llama.cpp's decode returned {step['rc']}"
    return slots


def replay(table_class, scenario, prepared=False):
    """Replay one scenario (decodes through prepare and apply when ``prepared``); the first
    disagreement with llama.cpp as a message, or None."""
    table = table_class(scenario["kv_size"], scenario["n_seq_max"], scenario["n_swa"], scenario["swa_type"])
    for number, step in enumerate(scenario["steps"]):
        where = f"{scenario['name']}: step {number} ({step['op']})"
        if step["op"] == "decode":
            slots = prepared_slots(table, step, scenario["n_ubatch"]) if prepared else None
            if isinstance(slots, str):
                return f"{where}: {slots}"
            for u, (ubatch, cells) in enumerate(zip(step["ubatches"], step["cells_per_ubatch"])):
                pos, seq_ids = [token[1] for token in ubatch], [token[2] for token in ubatch]
                if slots is None:
                    slot = table.place(pos, seq_ids)
                else:
                    slot = slots[u]
                    table.apply(slot, pos, seq_ids)
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


@pytest.mark.parametrize("prepared", [False, True], ids=["place", "prepare then apply"])
@pytest.mark.parametrize("engine", sorted(TABLES))
def test_every_unified_scenario_places_as_llamacpp(recording, engine, prepared):
    unified = [scenario for scenario in recording["scenarios"] if scenario["unified"]]
    assert unified, "the recording has no unified (single-stream) scenario"
    failures = [message for scenario in unified if (message := replay(TABLES[engine], scenario, prepared))]
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


def test_the_prepared_replay_notices_slots_llamacpp_did_not_find(recording):
    """A decode llama.cpp refused, recorded as placed: prepare's None is reported at that step."""
    scenario = copy.deepcopy(next(s for s in recording["scenarios"]
                                  if any(step["op"] == "decode" and not step["ok"] for step in s["steps"])))
    number, step = next((n, step) for n, step in enumerate(scenario["steps"]) if step["op"] == "decode"
                        and not step["ok"])
    step["ok"], step["rc"] = True, 0
    message = replay(CompiledCells, scenario, prepared=True) or ""
    assert f"step {number} (decode): prepare gave None" in message
