"""llama.cpp's KV cell placement as recorded in ``tests/data/llamacpp_kv/placement.json``.

``tools/record_llamacpp_kv.py`` ran scripts of sequence operations through llama.cpp and read
its cells after every step and every ubatch from its own debug prints (see the data's README).
The KV engine's placement test replays these scripts; this test checks that the file is what
its schema says and agrees with itself: each step's cells with the sequence positions llama.cpp
printed, each decode's cells with its ubatches, each ubatch with its batch and the head after it,
and each other step's cells with what its operation does to the cells before it.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data" / "llamacpp_kv"
RECORDING = json.loads((DATA / "placement.json").read_text(encoding="utf-8"))
SCENARIOS = {scenario["name"]: scenario for scenario in RECORDING["scenarios"]}
OPS = {"decode": {"batch", "ok", "rc", "ubatches", "cells_per_ubatch", "heads_per_ubatch"},
       "seq_rm": {"seq", "p0", "p1", "ok"}, "seq_cp": {"src", "dst", "p0", "p1"}, "seq_keep": {"seq"},
       "seq_add": {"seq", "p0", "p1", "delta"}, "seq_div": {"seq", "p0", "p1", "d"}, "clear": set()}
END = 2**31 - 1   # a negative p1 means "to the end" (llama.cpp's std::numeric_limits<llama_pos>::max())


def _range(step):
    return max(step["p0"], 0), END if step["p1"] < 0 else step["p1"]


def _steps():
    for name, scenario in SCENARIOS.items():
        for n, step in enumerate(scenario["steps"]):
            yield pytest.param(name, n, id=f"{name}[{n}]-{step['op']}")


def _before(scenario, n):
    """The cells and head before step n (an empty cache at head 0 before the first)."""
    if n == 0:
        return [None] * scenario["kv_size"], 0
    previous = scenario["steps"][n - 1]
    return previous["cells"], previous["head"]


def test_the_file_is_small_and_names_its_llama_cpp():
    assert (DATA / "placement.json").stat().st_size < 300_000
    assert RECORDING["llama_cpp"] == "0.3.36"
    ops = Counter(step["op"] for scenario in SCENARIOS.values() for step in scenario["steps"])
    assert set(ops) == set(OPS)   # every operation is recorded somewhere
    models = {scenario["model"] for scenario in SCENARIOS.values()}
    assert models == {"llama", "jamba", "granite_swa"}   # attention only, a hybrid, sliding-window layers
    assert any(scenario["n_swa"] for scenario in SCENARIOS.values())


@pytest.mark.parametrize("name", SCENARIOS)
def test_a_scenario_has_the_schemas_fields(name):
    scenario = SCENARIOS[name]
    assert {"name", "kv_size", "n_seq_max", "n_ubatch", "n_swa", "swa_type", "unified", "steps"} <= set(scenario)
    assert scenario["swa_type"] in ("none", "standard", "chunked", "symmetric")
    assert isinstance(scenario["unified"], bool) and scenario["kv_size"] >= 16 and scenario["n_ubatch"] >= 1
    for step in scenario["steps"]:
        assert set(step) == {"op", "cells", "head", "seq_pos"} | OPS[step["op"]]
        assert len(step["cells"]) == scenario["kv_size"]
        assert isinstance(step["head"], int) and 0 <= step["head"] <= scenario["kv_size"]
        for cell in step["cells"]:
            if cell is not None:
                pos, seqs = cell
                assert pos >= 0 and seqs == sorted(set(seqs)) and seqs
                assert all(0 <= seq < scenario["n_seq_max"] - 1 for seq in seqs)   # the last is the probe's


@pytest.mark.parametrize("name,n", list(_steps()))
def test_cells_agree_with_the_positions_llama_cpp_printed(name, n):
    step = SCENARIOS[name]["steps"][n]
    positions: dict[str, list[int]] = {}
    for cell in step["cells"]:
        if cell is not None:
            for seq in cell[1]:
                positions.setdefault(str(seq), []).append(cell[0])
    assert {seq: [min(p), max(p)] for seq, p in positions.items()} == step["seq_pos"]


@pytest.mark.parametrize("name,n", [param for param in _steps() if param.id.endswith("decode")])
def test_a_decodes_cells_hold_its_tokens_ubatch_by_ubatch(name, n):
    scenario = SCENARIOS[name]
    step = scenario["steps"][n]
    cells, _ = _before(scenario, n)
    if not step["ok"]:   # refused: llama.cpp restores every cell
        assert step["rc"] == 1 and step["cells"] == cells
        assert step["ubatches"] == step["cells_per_ubatch"] == step["heads_per_ubatch"] == []
        return
    assert step["rc"] == 0
    # the ubatches are the batch, each token once, none larger than n_ubatch
    placed = [tuple(map(json.dumps, entry)) for ubatch in step["ubatches"] for entry in ubatch]
    assert Counter(placed) == Counter(tuple(map(json.dumps, entry)) for entry in step["batch"])
    assert all(1 <= len(ubatch) <= scenario["n_ubatch"] for ubatch in step["ubatches"])
    assert len(step["ubatches"]) == len(step["cells_per_ubatch"]) == len(step["heads_per_ubatch"])
    for ubatch, after, head in zip(step["ubatches"], step["cells_per_ubatch"], step["heads_per_ubatch"],
                                   strict=True):
        changed = [i for i in range(len(after)) if after[i] != cells[i]]
        # every token went to a cell that was empty (or held a token out of its sequence's window:
        # llama.cpp's is_masked_swa, standard), and nothing else changed
        last_pos = {}
        for cell in cells:
            for seq in cell[1] if cell else ():
                last_pos[seq] = max(last_pos.get(seq, -1), cell[0])
        n_swa = scenario["n_swa"]
        assert all(cells[i] is None or (n_swa and len(cells[i][1]) == 1
                                        and last_pos[cells[i][1][0]] + 1 - cells[i][0] >= n_swa) for i in changed)
        assert sorted((after[i][0], after[i][1]) for i in changed) == sorted(
            (token[1], sorted(token[2])) for token in ubatch)
        last = next(i for i in changed if after[i] == [ubatch[-1][1], sorted(ubatch[-1][2])])
        assert head == last + 1   # find_slot's head: after the last cell of the ubatch
        cells = after
    assert step["cells"] == cells and step["head"] == step["heads_per_ubatch"][-1]


def test_the_sliding_window_cache_wraps_and_reuses_cells_out_of_the_window():
    scenario = next(scenario for scenario in SCENARIOS.values() if scenario["n_swa"])
    reused = wrapped = 0
    cells = [None] * scenario["kv_size"]
    for step in scenario["steps"]:
        for after, head in zip(step["cells_per_ubatch"], step["heads_per_ubatch"], strict=True):
            reused += sum(before is not None and before != now for before, now in zip(cells, after, strict=True))
            wrapped += head < scenario["kv_size"] and any(
                before is None and now is not None for before, now in zip(cells[head:], after[head:], strict=True))
            cells = after
    assert reused and wrapped


def _expected(step, cells, head):
    """What a step other than decode does to the cells and head (src/llama-kv-cache.cpp)."""
    op, after, freed = step["op"], [None if c is None else [c[0], list(c[1])] for c in cells], []
    if op == "clear":
        return [None] * len(cells), 0
    if op == "seq_rm" and not step["ok"]:
        return after, head
    for i, cell in enumerate(after):
        if cell is None:
            continue
        pos, seqs = cell
        if op in ("seq_rm", "seq_cp", "seq_add", "seq_div"):
            p0, p1 = _range(step)
            seq = step["seq"] if op != "seq_cp" else step["src"]
            if seq not in seqs or not p0 <= pos < p1:
                continue
            if op == "seq_rm":
                seqs.remove(seq)
            elif op == "seq_cp":
                seqs.append(step["dst"])
                seqs.sort()
            elif op == "seq_add":
                cell[0] = pos + step["delta"]
                if cell[0] < 0:
                    seqs.clear()
            else:
                cell[0] = pos // step["d"]
        elif op == "seq_keep" and step["seq"] in seqs:
            seqs[:] = [step["seq"]]
        elif op == "seq_keep":
            seqs.clear()
        if not seqs:
            after[i] = None
            freed.append(i)
    if op == "seq_add":   # seq_add restarts the search at the first cell it freed, else at 0
        return after, freed[0] if freed else 0
    return after, min([head, *freed[:1]])


@pytest.mark.parametrize("name,n", [param for param in _steps() if not param.id.endswith("decode")])
def test_an_operation_changes_the_cells_it_names(name, n):
    scenario = SCENARIOS[name]
    step = scenario["steps"][n]
    cells, head = _before(scenario, n)
    assert _expected(step, cells, head) == (step["cells"], step["head"])
