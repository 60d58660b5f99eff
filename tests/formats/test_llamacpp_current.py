"""Current llama.cpp's state framings (docs/llamacpp_formats.md), read and written by the package.

The recordings in ``tests/data/llamacpp_current`` come from llama.cpp 0c1e57098 (llama-cpp-python
0.3.36).  Pure Mamba (``mamba``): every blob and file loads, without being told its framing, into a
cache shaped for the shipped model, and the package's model continues each sequence to llama.cpp's
recorded logits; read back and written in llama.cpp's framing, every one is byte for byte the
recording.  Hybrids (``jamba``, ``jamba_fa_unified``, ``nemotron_h_unified``): the attention KV
section is skipped and the recurrent section found where the recorder's own parse (the ``layout``
of each record) puts it, checked here by an independent struct parse.  Damaged headers of every
framing are refused with the cache unchanged.
"""

from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from recurrent_cache import load_seq_file, load_session_file, save_seq_file, save_session_file
from recurrent_cache.blob_report import describe
from recurrent_cache.errors import ArgumentError, StateError
from recurrent_cache.models import trained_model
from recurrent_cache.formats.framings import unframe

DATA = Path(__file__).resolve().parents[1] / "data" / "llamacpp_current"
RECORDS = {record["scenario"]: record for record in
           map(json.loads, gzip.open(DATA / "records.jsonl.gz", "rt", encoding="utf-8"))}
MAMBA = RECORDS["mamba"]
HYBRIDS = [name for name, record in RECORDS.items() if record["shape"]["attention_layers"]]

# The package's float64 forward of the f16 byte model against llama.cpp's (f16 weights times
# f16-rounded activations), both from llama.cpp's state: at most 4.32e-4 of the largest logit over
# every recorded continuation (measured on the recordings); 5e-4 allows that and no more.
TOLERANCE = 5e-4


@pytest.fixture(scope="module")
def model():
    return trained_model(np.float64)


def _continue(rc, model, cache, seq):
    """The logits of continuing ``seq`` (a record's sequence) in ``cache``, one token per decode."""
    logits = []
    for k, token in enumerate(seq["continuation"]):
        batch = rc.Batch(token=[token], pos=[seq["next_pos"] + k], seq_id=[[seq["seq_id"]]], logits=[True])
        logits.append(model.forward(cache.init_batch(batch))[0])
    return np.array(logits)


def _relative_diff(logits, seq):
    reference = np.array(seq["continuation_logits"])
    return float(np.abs(logits - reference).max() / np.abs(reference).max())


def _new_cache(rc, model):
    """The model's cache on the variant under test (its engine, and its storage: torch runs the torch forward)."""
    p = model.hparams
    return rc.RecurrentCache(p.n_layer, p.n_embd_r, p.n_embd_s, n_seq_max=MAMBA["context"]["n_seq_max"])


def _states(cache):
    """Everything a read could change: the whole cache's bytes."""
    return bytes(cache.state_write(-1))


def _load(cache, file, seq_id):
    """Load one recorded file by the call its framing is read with; the tokens of a file."""
    path = DATA / "mamba" / file
    if file.endswith(".ggsq"):
        return load_seq_file(path, cache, seq_id).tolist()
    if file.endswith(".ggsn"):
        return load_session_file(path, cache, arch="mamba").tolist()
    cache.state_read(path.read_bytes(), seq_id, arch="mamba" if seq_id < 0 else None)
    return None


def _mamba_files():
    seqs = [seq["seq_id"] for seq in MAMBA["sequences"]]
    return ([(f"seq{s}.blob", s) for s in seqs] + [(f"seq{s}.ggsq", s) for s in seqs]
            + [("context.blob", -1), ("session.ggsn", -1)])


@pytest.mark.parametrize("file,seq_id", _mamba_files())
def test_every_mamba_recording_loads_and_continues_to_llamacpps_logits(rc, model, file, seq_id):
    cache = _new_cache(rc, model)
    tokens = _load(cache, file, seq_id)
    sequences = [seq for seq in MAMBA["sequences"] if seq_id in (-1, seq["seq_id"])]
    if file.endswith(".ggsq"):
        assert tokens == sequences[0]["tokens"]
    if file.endswith(".ggsn"):
        assert tokens == MAMBA["sequences"][0]["tokens"]
    for seq in sequences:
        assert _relative_diff(_continue(rc, model, cache, seq), seq) <= TOLERANCE, (file, seq["seq_id"])


def test_a_sequence_blob_goes_to_the_seq_id_it_is_read_into(rc, model):
    """llama.cpp ignores the source seq id of a sequence blob: seq i's blob into the empty seq id."""
    empty = MAMBA["empty_seq_id"]
    for seq in MAMBA["sequences"]:
        cache = _new_cache(rc, model)
        cache.state_read((DATA / "mamba" / f"seq{seq['seq_id']}.blob").read_bytes(), empty)
        moved = {**seq, "seq_id": empty}
        assert _relative_diff(_continue(rc, model, cache, moved), seq) <= TOLERANCE


def test_the_continuations_tell_a_state_from_none(rc, model):
    """The tolerance is far below what a wrong state gives: from an empty sequence, the continuation
    misses llama.cpp's by more than 20 times the tolerance."""
    for seq in MAMBA["sequences"]:
        cache = _new_cache(rc, model)
        assert _relative_diff(_continue(rc, model, cache, seq), seq) > 20 * TOLERANCE


@pytest.mark.parametrize("seq_id", range(MAMBA["context"]["n_seq_max"]))
def test_sequence_blobs_written_back_are_llamacpps_bytes(rc, model, seq_id):
    recorded = (DATA / "mamba" / f"seq{seq_id}.blob").read_bytes()
    cache = _new_cache(rc, model)
    assert cache.state_read(recorded, seq_id) == len(recorded)
    assert cache.state_size(seq_id, framing="llama") == len(recorded)
    assert cache.state_write(seq_id, framing="llama") == recorded
    # the bare section is what follows llama_state_seq_get_data's 8-byte header
    assert cache.state_write(seq_id) == recorded[8:]
    target = bytearray(len(recorded) + 3)
    assert cache.state_write_into(target, seq_id, framing="llama") == len(recorded)
    assert target == recorded + bytes(3)


def test_the_whole_context_blob_written_back_is_llamacpps_bytes(rc, model):
    recorded = (DATA / "mamba" / "context.blob").read_bytes()
    cache = _new_cache(rc, model)
    assert cache.state_read(recorded, -1, arch="mamba") == len(recorded)
    assert cache.state_write(-1, framing="llama", arch="mamba") == recorded
    assert cache.state_size(-1, framing="llama", arch="mamba") == len(recorded)
    target = bytearray(len(recorded))
    assert cache.state_write_into(target, -1, framing="llama", arch="mamba") == len(recorded)
    assert target == recorded
    with pytest.raises(ArgumentError, match="needs arch="):
        cache.state_write(-1, framing="llama")
    with pytest.raises(ArgumentError, match="unknown framing 'gguf'"):
        cache.state_size(0, framing="gguf")


def test_files_written_back_are_llamacpps_bytes(rc, model, tmp_path):
    cache = _new_cache(rc, model)
    for seq in MAMBA["sequences"]:
        recorded = (DATA / "mamba" / f"seq{seq['seq_id']}.ggsq").read_bytes()
        tokens = load_seq_file(DATA / "mamba" / f"seq{seq['seq_id']}.ggsq", cache, seq["seq_id"])
        path = tmp_path / f"seq{seq['seq_id']}.ggsq"
        assert save_seq_file(path, cache, seq["seq_id"], tokens) == len(recorded)
        assert path.read_bytes() == recorded
    recorded = (DATA / "mamba" / "session.ggsn").read_bytes()
    tokens = load_session_file(DATA / "mamba" / "session.ggsn", cache)
    path = tmp_path / "session.ggsn"
    assert save_session_file(path, cache, tokens, "mamba") == len(recorded)
    assert path.read_bytes() == recorded


def test_state_read_from_a_file_finds_the_framing_too(rc, model, tmp_path):
    for file, seq_id in (("seq1.blob", 1), ("context.blob", -1)):
        recorded = (DATA / "mamba" / file).read_bytes()
        cache = _new_cache(rc, model)
        with open(DATA / "mamba" / file, "rb") as handle:
            assert cache.state_read_from(handle, seq_id) == len(recorded)
        framing = {"framing": "llama", "arch": "mamba"} if seq_id < 0 else {"framing": "llama"}
        assert cache.state_write(seq_id, **framing) == recorded


@pytest.mark.parametrize("file,framing,extra", [
    ("seq1.blob", "llama sequence blob", {"source_seq_id": 1}),
    ("context.blob", "llama context blob", {"arch": "mamba"}),
    ("seq1.ggsq", "'ggsq' version 3", {}),
    ("session.ggsn", "'ggsn' version 10", {"arch": "mamba"}),
])
def test_inspect_names_the_framing(file, framing, extra):
    report = describe((DATA / "mamba" / file).read_bytes())
    assert report["framing"] == framing
    assert {key: report[key] for key in extra} == extra
    assert report["n_layer"] == MAMBA["shape"]["n_layer"]


def _seq_blob():
    return bytearray((DATA / "mamba" / "seq1.blob").read_bytes())


def _context_blob():
    return bytearray((DATA / "mamba" / "context.blob").read_bytes())


def _with(data, offset, fmt, value):
    struct.pack_into(fmt, data, offset, value)
    return data


@pytest.mark.parametrize("make,seq_id,arch,message", [
    # the magic damaged: the bytes are a bare section whose cell_count is huge
    (lambda: _with(_seq_blob(), 0, "<I", 0xAF143CD9), 1, None, "has 2937339097 cells at byte 0"),
    (lambda: _seq_blob()[:6], 1, None, "sequence blob header (magic and seq id) needs 8 bytes"),
    (lambda: _seq_blob(), -1, None, "llama sequence blob holds one sequence"),
    (lambda: _with(_seq_blob(), 8, "<I", 2), 1, None, "the state blob at byte 8: sequence state blob has 2 cells"),
    (lambda: _seq_blob()[:-1], 1, None, "the state blob at byte 8: state blob truncated"),
    (lambda: _context_blob(), -1, "rwkv6", "architecture 'mamba' (string at byte 0), the caller's model is 'rwkv6'"),
    (lambda: _context_blob(), 0, None, "llama context blob holds the whole cache"),
    # a length that is not the name's: no architecture string, a bare section of 6 cells
    (lambda: _with(_context_blob(), 0, "<I", 6), -1, None, "state blob has 6 cells at byte 0, more than the cache's 5"),
    (lambda: _context_blob() + b"\0", -1, "mamba", "the state blob at byte 9: state blob has 1 trailing bytes"),
])
def test_damaged_blob_framings_are_refused_and_the_cache_is_unchanged(rc, model, make, seq_id, arch, message):
    cache = _new_cache(rc, model)
    _load(cache, "context.blob", -1)
    before = _states(cache)
    with pytest.raises(StateError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cache.state_read(bytes(make()), seq_id, arch)
    assert _states(cache) == before


@pytest.mark.parametrize("file,damage,message", [
    ("seq1.ggsq", lambda data: _with(data, 4, "<I", 4), "sequence file version 4 at byte 4, expected 3 or 2"),
    ("seq1.ggsq", lambda data: _with(data, 0, "<I", 0x6767736D), "magic 0x6767736d at byte 0"),
    ("seq1.ggsq", lambda data: data[:-1], "the state blob at byte 40: state blob truncated"),
    ("session.ggsn", lambda data: _with(data, 4, "<I", 8), "session file version 8 at byte 4, expected 10 or 9"),
    # a version 10 file relabelled 9: the memory section is read as June-2025's output block
    ("session.ggsn", lambda data: _with(data, 4, "<I", 9),
     r"truncated at byte 65 of \d+: \d+ logits \(f32\) needs \d+ bytes"),
    ("session.ggsn", lambda data: _with(data, 32, "<B", ord("M")),
     "the architecture string at byte 32 is not a name"),
    # one token fewer: the last token is read as the architecture string's length
    ("session.ggsn", lambda data: _with(data, 8, "<I", 4), "the architecture string at byte 28 is not a name"),
])
def test_damaged_files_are_refused_and_the_cache_is_unchanged(rc, model, tmp_path, file, damage, message):
    cache = _new_cache(rc, model)
    _load(cache, "context.blob", -1)
    before = _states(cache)
    path = tmp_path / file
    path.write_bytes(bytes(damage(bytearray((DATA / "mamba" / file).read_bytes()))))
    with pytest.raises(StateError, match=message):
        if file.endswith(".ggsq"):
            load_seq_file(path, cache, 1)
        else:
            load_session_file(path, cache)
    assert _states(cache) == before


def test_a_session_file_of_another_architecture_is_refused(rc, model):
    cache = _new_cache(rc, model)
    before = _states(cache)
    with pytest.raises(StateError, match="architecture 'mamba' .* the caller's model is 'jamba'"):
        load_session_file(DATA / "mamba" / "session.ggsn", cache, arch="jamba")
    assert _states(cache) == before


def test_version_2_files_are_still_read_and_written_on_request(rc, model, tmp_path):
    recorded = bytearray((DATA / "mamba" / "seq2.ggsq").read_bytes())
    old = tmp_path / "old.ggsq"
    old.write_bytes(bytes(_with(recorded.copy(), 4, "<I", 2)))
    cache = _new_cache(rc, model)
    tokens = load_seq_file(old, cache, 2)
    again = tmp_path / "again.ggsq"
    save_seq_file(again, cache, 2, tokens, version=2)
    assert again.read_bytes() == old.read_bytes()
    with pytest.raises(ArgumentError, match="unknown sequence file version 1"):
        save_seq_file(again, cache, 2, tokens, version=1)


# -- hybrids: the KV section skipped, the recurrent section found -------------------------------

def _hybrid_artifacts():
    for name in HYBRIDS:
        record = RECORDS[name]
        items = [*record["seq_blobs"], record["context_blob"], *record["seq_files"], record["session_file"]]
        for item in items:
            yield pytest.param(name, item, id=f"{name}/{item['file']}")


def _parse_recurrent_section(section, n_recurrent, n_embd_r, n_embd_s):
    """An independent parse of a recurrent section of ``n_recurrent`` filtered-in layers: the cells,
    n_layer, and the (type, row bytes, offset of the rows) of every r then s section."""
    at = 0

    def take(fmt):
        nonlocal at
        values = struct.unpack_from(fmt, section, at)
        at += struct.calcsize(fmt)
        return values

    (cell_count,) = take("<I")
    cells = []
    for _ in range(cell_count):
        pos, n_seq_id = take("<iI")
        cells.append((pos, take(f"<{n_seq_id}i")))
    s_trans, n_layer = take("<II")
    assert s_trans == 0
    tensors = []
    for row_elements in [n_embd_r] * n_recurrent + [n_embd_s] * n_recurrent:
        type_id, row_bytes = take("<iQ")
        assert (type_id, row_bytes) == (0, 4 * row_elements)   # llama.cpp's recurrent memory is f32
        tensors.append((type_id, row_bytes, at))
        at += cell_count * row_bytes
    assert at == len(section)
    return cells, n_layer, tensors


@pytest.mark.parametrize("name,item", list(_hybrid_artifacts()))
def test_a_hybrids_kv_section_is_skipped_and_its_recurrent_section_found(name, item):
    record = RECORDS[name]
    shape = record["shape"]
    data = (DATA / item["file"]).read_bytes()
    seq_id = item.get("seq_id", -1)
    partial = item.get("flags", 0) & 1   # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: no KV section
    unframed = unframe(data, seq_id, arch=record["arch"], kv_section=not partial)
    layout = {entry[0]: entry for entry in item["layout"]}
    # where the recorder's parse puts the KV section and the recurrent section
    assert unframed.framing.section_offset == layout["rs cell_count"][1]
    assert unframed.framing.kv_offset == (None if partial else layout["kv n_stream"][1])
    section = unframed.section
    assert len(section) == len(data) - unframed.framing.section_offset
    cells, n_layer, tensors = _parse_recurrent_section(section, len(shape["recurrent_layers"]), shape["n_embd_r"],
                                                       shape["n_embd_s"])
    assert n_layer == shape["n_layer"] == layout["rs s_trans, n_layer"][3][1]
    base = unframed.framing.section_offset
    for i, (pos, ids) in enumerate(cells):
        assert [pos, len(ids)] == layout[f"rs cell {i} pos, n_seq_id"][3]
    k = len(shape["recurrent_layers"])
    for j, (type_id, row_bytes, rows_at) in enumerate(tensors):
        which = f"r[{j}]" if j < k else f"s[{j - k}]"
        assert layout[f"rs {which} type, row bytes"][3] == [type_id, row_bytes]
        assert layout[f"rs {which} rows"][1] == base + rows_at


@pytest.mark.parametrize("name", HYBRIDS)
def test_a_hybrids_recurrent_section_equals_its_partial_blob(name):
    """llama.cpp's PARTIAL_ONLY blob is the recurrent section alone: the full blob with its KV
    section skipped must hold exactly those bytes."""
    record = RECORDS[name]
    for item in record["seq_blobs"]:
        if not item.get("flags"):
            continue
        full = (DATA / item["file"].replace(".partial", "")).read_bytes()
        partial = (DATA / item["file"]).read_bytes()
        with_kv = unframe(full, item["seq_id"], kv_section=True)
        alone = unframe(partial, item["seq_id"])
        assert bytes(with_kv.section) == bytes(alone.section) == partial[8:]


def _kv_blob():
    return bytearray((DATA / "jamba" / "seq1.blob").read_bytes())


@pytest.mark.parametrize("damage,message", [
    (lambda data: _with(data, 24, "<I", 2), "KV section stream 1 cell 0 has n_seq_id 2 at byte 24"),
    (lambda data: _with(data, 104, "<I", 3), "KV section stream 1 v_trans is 3 at byte 104"),
    # 9 streams: the recurrent section is read as stream 4, whose cell lists no seq id
    (lambda data: _with(data, 8, "<I", 9), "KV section stream 4 cell 0 has n_seq_id 0 at byte 624"),
    (lambda data: data[:300], "KV section stream 1 layer 1 K rows needs 112 bytes"),
])
def test_a_damaged_kv_section_is_refused_naming_the_field(damage, message):
    with pytest.raises(StateError, match=message):
        unframe(bytes(damage(_kv_blob())), 1, kv_section=True)


def test_a_caller_given_bare_framing_overrides_the_guess(rc):
    """The one ambiguity of the detection (docs/llamacpp_formats.md): a bare whole-cache section of
    4 cells whose cell 0 sits at the position spelling "mamb" reads like an architecture string.
    ``framing="bare"`` reads it as what it is; at any ordinary position the guess is bare anyway."""
    for pos, guessed in ((int.from_bytes(b"mamb", "little"), "llama context blob"), (7, "bare")):
        cache = rc.RecurrentCache(1, 2, 3, n_seq_max=4)
        batch = rc.Batch(token=[0] * 4, pos=[pos, pos + 1, pos + 2, pos + 3], seq_id=[[0], [1], [2], [3]])
        for _ in cache.init_batch(batch):
            pass
        blob = cache.state_write(-1)
        assert struct.unpack_from("<I", blob)[0] == 4
        assert unframe(blob, -1).framing.name == guessed
        copy = rc.RecurrentCache(1, 2, 3, n_seq_max=4)
        assert copy.state_read(blob, -1, framing="bare") == len(blob)
        assert copy.state_write(-1) == blob


@pytest.mark.parametrize("name", HYBRIDS)
def test_a_hybrids_recordings_load_into_a_filtered_cache_and_write_back(rc, name):
    """With the layer filter: every sequence blob and file of a hybrid loads (its KV section
    skipped) and writes back, in llama.cpp's framing, as llama.cpp's PARTIAL_ONLY blob of that
    sequence; the whole-context blob loads and writes back its own recurrent section."""
    record = RECORDS[name]
    shape = record["shape"]
    cache = rc.RecurrentCache(shape["n_layer"], shape["n_embd_r"], shape["n_embd_s"],
                              layers=shape["recurrent_layers"], n_seq_max=record["context"]["n_seq_max"])
    partial = {item["seq_id"]: (DATA / item["file"]).read_bytes() for item in record["seq_blobs"] if item.get("flags")}
    for item in record["seq_blobs"]:
        if item.get("flags") or item["seq_id"] not in partial:
            continue
        cache.state_read((DATA / item["file"]).read_bytes(), item["seq_id"], kv_section=True)
        assert cache.state_write(item["seq_id"], framing="llama") == partial[item["seq_id"]]
    for item in record["seq_files"]:
        tokens = load_seq_file(DATA / item["file"], cache, item["seq_id"], kv_section=True)
        assert tokens.tolist() == item["tokens"]
        assert cache.state_write(item["seq_id"], framing="llama") == partial[item["seq_id"]]
    context = (DATA / record["context_blob"]["file"]).read_bytes()
    cache.state_read(context, -1, arch=record["arch"], kv_section=True)
    section_at = unframe(context, -1, kv_section=True).framing.section_offset
    assert cache.state_write(-1) == context[section_at:]
