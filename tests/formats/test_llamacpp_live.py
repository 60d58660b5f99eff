"""Current llama.cpp, live: it reloads the recordings in ``tests/data/llamacpp_current`` and a new
recording reproduces them.

Marked ``llamacpp_live`` and skipped unless ``llama_cpp`` (``pip install llama-cpp-python``, which
compiles llama.cpp) and ``gguf`` import; ``pytest -m llamacpp_live`` runs only these.  Through
``tools/record_llamacpp.py``, the script that made the recordings: llama.cpp loads every blob and
file it wrote there into a fresh context and continues each sequence to the recorded logits,
recording again with the same llama.cpp gives the same layouts and logits, llama.cpp refuses the
June-2025 framings, and the states the package computes itself (both engines), framed by hand as
llama.cpp frames them, continue in llama.cpp to its logits.
"""

from __future__ import annotations

import importlib.util
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.llamacpp_live

llama_cpp = pytest.importorskip("llama_cpp", reason="needs llama-cpp-python")
pytest.importorskip("gguf", reason="the recorder writes the hybrid GGUF with gguf")

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "llamacpp_current"


def _recorder():
    spec = importlib.util.spec_from_file_location("record_llamacpp", ROOT / "tools" / "record_llamacpp.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up there
    spec.loader.exec_module(module)
    module.quiet_logs()
    return module


recorder = _recorder()
RECORDS = recorder.load_records(DATA)
RECORDED_VERSION = next(iter(RECORDS.values()))["llama_cpp"]


def _same_state_versions() -> None:
    if (llama_cpp.LLAMA_SESSION_VERSION, llama_cpp.LLAMA_STATE_SEQ_VERSION) != (
            RECORDED_VERSION["session_version"], RECORDED_VERSION["state_seq_version"]):
        pytest.skip(f"this llama.cpp writes session/sequence versions {llama_cpp.LLAMA_SESSION_VERSION}/"
                    f"{llama_cpp.LLAMA_STATE_SEQ_VERSION}, the recording has {RECORDED_VERSION}")


def test_llamacpp_reloads_every_recorded_blob_and_file_and_continues_to_the_recorded_logits():
    _same_state_versions()
    report, ok = recorder.check(DATA, DATA, tolerance=2e-4)
    for name, record in RECORDS.items():
        results = report["scenarios"][name]
        seqs = [seq["seq_id"] for seq in record["sequences"]]
        expected = {f"seq{s}.blob" for s in seqs} | {f"seq{s}.ggsq" for s in seqs} | {"context.blob", "session.ggsn"}
        assert set(results) == expected, (name, sorted(results))
        for file, result in results.items():
            assert result["accepted"], (name, file, result)
            assert result["within_tolerance"], (name, file, result["max_abs_diff"])
    assert ok


def test_a_new_recording_reproduces_the_committed_one(tmp_path):
    if llama_cpp.__version__ != RECORDED_VERSION["llama_cpp_python"]:
        pytest.skip(f"llama-cpp-python {llama_cpp.__version__}, the recording is from "
                    f"{RECORDED_VERSION['llama_cpp_python']}")
    fresh = {item["scenario"]: item for item in recorder.record(tmp_path)}
    assert set(fresh) == set(RECORDS)
    for name, old in RECORDS.items():
        new = fresh[name]
        assert new["model_sha256"] == old["model_sha256"], name   # the hybrid GGUF is written from a fixed seed
        assert len(new["ops"]) == len(old["ops"]) and len(_artifacts(new)) == len(_artifacts(old))
        for old_op, new_op in zip(old["ops"], new["ops"]):
            assert {**new_op, "logits": None} == {**old_op, "logits": None}
            if old_op["op"] == "decode":
                assert np.abs(np.subtract(new_op["logits"], old_op["logits"])).max() <= 1e-5, name
        for old_seq, new_seq in zip(old["sequences"], new["sequences"]):
            assert {**new_seq, "continuation_logits": None} == {**old_seq, "continuation_logits": None}
            assert np.abs(np.subtract(new_seq["continuation_logits"], old_seq["continuation_logits"])).max() <= 1e-5
        for old_item, new_item in zip(_artifacts(old), _artifacts(new)):
            assert new_item["file"] == old_item["file"] and new_item["n_bytes"] == old_item["n_bytes"]
            # every section at the same offset with the same header values (a layout holds no row bytes)
            assert new_item["layout"] == old_item["layout"], new_item["file"]
        for check in new["checks"]:
            assert check["accepted"] and check["max_abs_diff"] <= 1e-5, (name, check)


def _artifacts(record: dict) -> list[dict]:
    """A record's blobs and files in a fixed order."""
    return [*record["seq_blobs"], record["context_blob"], *record["seq_files"], record["session_file"]]


def test_llamacpp_refuses_the_june_2025_framings(tmp_path):
    """What docs/llamacpp_formats.md says current llama.cpp does with the framings the package writes today."""
    _same_state_versions()
    recorder.quiet_logs()   # llama.cpp has one log callback: another test module in this process may have set its own
    recorded, june = DATA / "mamba", tmp_path / "mamba"
    june.mkdir()
    seq_file = bytearray((recorded / "seq1.ggsq").read_bytes())
    seq_file[4:8] = (2).to_bytes(4, "little")                                              # ggsq version 2
    (june / "seq1.ggsq").write_bytes(seq_file)
    (june / "seq0.blob").write_bytes((recorded / "seq0.blob").read_bytes()[8:])           # no 8-byte header
    (june / "context.blob").write_bytes((recorded / "context.blob").read_bytes()[9:])     # no arch string
    session = bytearray((recorded / "session.ggsn").read_bytes())
    session[4:8] = (9).to_bytes(4, "little")                                               # ggsn version 9
    (june / "session.ggsn").write_bytes(session)
    report, ok = recorder.check(tmp_path, DATA, tolerance=2e-4)
    results = report["scenarios"]["mamba"]
    expected = {"seq1.ggsq": "unknown (magic, version) for sequence state file: 67677371, 00000002",
                "seq0.blob": "wrong sequence state magic",
                "context.blob": "wrong model arch",
                "session.ggsn": "unknown (magic, version) for session file: 6767736e, 00000009"}
    assert set(results) == set(expected) and not ok
    for name, message in expected.items():
        assert not results[name]["accepted"], name
        assert any(message in line for line in results[name]["llama_errors"]), (name, results[name]["llama_errors"])


def _framed(prefix: bytes, tokens: list[int], body: bytes) -> bytes:
    """A ggsq/ggsn header (prefix = magic and version) with its tokens, then body."""
    return prefix + struct.pack(f"<I{len(tokens)}i", len(tokens), *tokens) + body


def _replayed(record, rc):
    """A cache holding the states the package's own forward computes for ``record``'s operations."""
    from recurrent_cache.models import load_gguf

    model = load_gguf(ROOT / record["model_file"])
    cache = model.new_cache(n_seq_max=record["context"]["n_seq_max"], engine=rc.ENGINE)
    for op in record["ops"]:
        if op["op"] == "seq_cp":
            cache.seq_cp(op["src"], op["dst"], op["p0"], op["p1"])
            continue
        token, pos, seq, wants = zip(*op["tokens"])
        batch = rc.Batch(token=list(token), pos=list(pos), seq_id=[[s] for s in seq], logits=[bool(w) for w in wants])
        model.forward(cache.init_batch(batch, n_ubatch=record["context"]["n_ubatch"]))
    return cache


def _assert_llamacpp_continues(directory, record):
    """llama.cpp accepts every file in ``directory``/mamba and continues each to its recorded logits."""
    report, ok = recorder.check(directory, DATA, tolerance=1e-3)
    results = report["scenarios"]["mamba"]
    assert len(results) == 2 * len(record["sequences"]) + 2
    for name, result in results.items():
        assert result["accepted"] and result["within_tolerance"], (name, result.get("max_abs_diff"))
    assert ok


def test_states_the_package_computes_continue_in_llamacpp(rc, tmp_path):
    """The package's own Mamba forward decodes the recorded batches; its state bytes, framed here by hand
    as current llama.cpp frames them, load in llama.cpp and continue to llama.cpp's recorded logits."""
    _same_state_versions()
    record = RECORDS["mamba"]
    cache = _replayed(record, rc)
    out = tmp_path / "mamba"
    out.mkdir()
    for seq in record["sequences"]:
        s, state = seq["seq_id"], bytes(cache.state_write(seq["seq_id"]))
        (out / f"seq{s}.blob").write_bytes(struct.pack("<Ii", 0xAF143CD8, s) + state)
        (out / f"seq{s}.ggsq").write_bytes(_framed(struct.pack("<II", 0x67677371, 3), seq["tokens"], state))
    whole = struct.pack("<I", 5) + b"mamba" + bytes(cache.state_write(-1))
    (out / "context.blob").write_bytes(whole)
    (out / "session.ggsn").write_bytes(_framed(struct.pack("<II", 0x6767736E, 10), record["sequences"][0]["tokens"],
                                               whole))
    _assert_llamacpp_continues(tmp_path, record)


def test_files_the_package_writes_load_in_llamacpp(rc, tmp_path):
    """The package's own writers — ``state_write(framing="llama")`` for sequence and whole-context
    blobs, ``save_seq_file`` (ggsq version 3) and ``save_session_file`` (ggsn version 10) — give
    files llama.cpp loads and continues to its recorded logits, from states the package computed."""
    _same_state_versions()
    from recurrent_cache import save_seq_file, save_session_file
    record = RECORDS["mamba"]
    cache = _replayed(record, rc)
    out = tmp_path / "mamba"
    out.mkdir()
    for seq in record["sequences"]:
        s = seq["seq_id"]
        (out / f"seq{s}.blob").write_bytes(cache.state_write(s, framing="llama"))
        save_seq_file(out / f"seq{s}.ggsq", cache, s, seq["tokens"])
    (out / "context.blob").write_bytes(cache.state_write(-1, framing="llama", arch=record["arch"]))
    save_session_file(out / "session.ggsn", cache, record["sequences"][0]["tokens"], record["arch"])
    _assert_llamacpp_continues(tmp_path, record)
