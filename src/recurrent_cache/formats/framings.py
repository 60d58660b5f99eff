"""The framings around a memory section, found from the bytes: ``read_framing`` and ``unframe``.

A state is a bare memory section (what this package wrote before, and what llama.cpp's memory
itself writes), or that section after a framing (``formats.layouts``): a state file's header
and tokens, llama_state_seq_get_data's ``SEQ_BLOB_HEADER``, llama_state_get_data's
architecture string (June 2025: then the output block), and a hybrid's attention KV section.
``read_framing`` reads every framing field up to the memory section; where two readings are
possible both are parsed whole, and a state both fit is refused.  The engines read only the
bare memory section it hands on.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ArgumentError, StateError
from .blob import MemoryReader, blob_view, parse_any_filter, parse_section
from .geometry import Geometry
from .kv import read_kv_section
from .layouts import (ARCH_CHARS, ARCH_LENGTH, BARE, CONTEXT_BLOB, CONTEXT_BLOB_V9, FILE_FORMATS, FILE_HEADER, GGSN,
                      GGSN_V9, GGSQ, GGSQ_V2, MAX_ARCH, MAX_TOKENS, MIN_ARCH, OUTPUT_BUFFER, OUTPUT_COUNT,
                      READ_FRAMINGS, SEQ_BLOB, SEQ_BLOB_HEADER, SEQ_BLOB_MAGIC, SeqFileFormat)
from .messages import (arch_mismatch, arch_not_a_name, file_header_truncated, file_version, negative_output_position,
                       negative_outputs, not_a_state_file, output_buffer_size, seq_blob_magic, stream_goes_on,
                       tokens_truncated, too_many_outputs, too_many_tokens, trailing, wrong_seq_id_for_framing)
from .streams import FileReader, truncation

__all__ = ["read_seq_file_header", "file_magic", "Outputs", "Framing", "read_framing", "Unframed", "unframe",
           "in_section"]


def read_seq_file_header(reader: Any, max_tokens: int = MAX_TOKENS) -> tuple[np.ndarray, SeqFileFormat]:
    """The tokens and framing of a state file's header (one of ``FILE_FORMATS``); leaves the
    reader after the tokens."""
    header = FILE_HEADER
    head = reader.take(header.size, lambda at, n, length: file_header_truncated(length, header.size))
    fields = dict(zip(header.names, header.unpack(head), strict=True))
    magic, version, n_tokens = fields["magic"], fields["version"], fields["n_token_count"]
    same_magic = [framing for framing in FILE_FORMATS if framing.magic == magic]
    if not same_magic:
        raise not_a_state_file(magic, header.offset("magic"))
    framing = next((framing for framing in same_magic if framing.version == version), None)
    if framing is None:
        raise file_version(magic, version, header.offset("version"), [known.version for known in same_magic])
    count_at = header.offset("n_token_count")
    if n_tokens > max_tokens:
        raise too_many_tokens(n_tokens, count_at, max_tokens)
    tokens = reader.take(4 * n_tokens, lambda at, n, length: tokens_truncated(n_tokens, count_at, n, length - at))
    return np.frombuffer(tokens, dtype="<i4").astype(np.int32), framing


def file_magic(head: bytes) -> bool:
    """Whether a file's first bytes are a state file's magic (its first field, a u32)."""
    return len(head) == 4 and any(head == framing.magic.to_bytes(4, "little") for framing in FILE_FORMATS)


def _arch_name(reader: Any) -> str | None:
    """The architecture name when the cursor is at an architecture string, else None.

    Its length is peeked first and its characters only if it is a name's: a stream is never
    asked for bytes the string does not claim (a FIFO would block for them)."""
    head = reader.peek(ARCH_LENGTH.size)
    if len(head) < ARCH_LENGTH.size:
        return None
    (length,) = ARCH_LENGTH.unpack_from(head)
    if not MIN_ARCH <= length <= MAX_ARCH:
        return None
    name = bytes(reader.peek(ARCH_LENGTH.size + length))[ARCH_LENGTH.size:]
    if len(name) != length or not set(name) <= ARCH_CHARS:
        return None
    return name.decode("ascii")


def _read_arch(reader: Any, arch: str | None) -> str:
    """The architecture string at the cursor (it must be one), checked against ``arch``."""
    at = reader.offset
    name = _arch_name(reader)
    if name is None:
        (length,), _ = reader.unpack(ARCH_LENGTH, "architecture string length")
        raise arch_not_a_name(at, length)
    if arch is not None and name != arch:
        raise arch_mismatch(name, at, arch)
    reader.take(ARCH_LENGTH.size + len(name), truncation("architecture string"))
    return name


@dataclass(frozen=True)
class Outputs:
    """June-2025 llama.cpp's output block (``OUTPUT_COUNT``, ``OUTPUT_BUFFER``): the batch position
    of each output row, and how many logits and embedding values follow them."""

    positions: tuple[int, ...]
    n_logits: int
    n_embd: int

    @property
    def n_outputs(self) -> int:
        return len(self.positions)


def _read_output_buffer(reader: Any, name: str, n_outputs: int, count_at: int) -> int:
    """One of the output block's u64-counted float runs (``name`` "logits" or "embeddings");
    its count must be a multiple of n_outputs (n_outputs x the width), 0 without outputs."""
    (size,), at = reader.unpack(OUTPUT_BUFFER, f"{name} size")
    if (size % n_outputs) if n_outputs else size:
        raise output_buffer_size(name, size, at, n_outputs, count_at)
    reader.step_over(4 * size, f"{size} {name} (f32)")
    return int(size)


def _read_outputs(reader: Any, max_tokens: int) -> Outputs:
    """The output block at the cursor (see ``OUTPUT_COUNT``), checked field by field; an output
    is a token of the batch, so there are at most ``max_tokens`` of them."""
    (n_outputs,), count_at = reader.unpack(OUTPUT_COUNT, "output block n_outputs")
    if n_outputs < 0:
        raise negative_outputs(n_outputs, count_at)
    if n_outputs > max_tokens:
        raise too_many_outputs(n_outputs, count_at, max_tokens)
    positions, at = reader.ids(n_outputs, f"{n_outputs} output positions")
    for i, position in enumerate(positions):
        if position < 0:
            raise negative_output_position(i, position, at + 4 * i)
    n_logits = _read_output_buffer(reader, "logits", n_outputs, count_at)
    n_embd = _read_output_buffer(reader, "embeddings", n_outputs, count_at)
    return Outputs(positions, n_logits, n_embd)


@dataclass(frozen=True)
class Framing:
    """What came before the memory section: the framing's name (``BARE``, ``SEQ_BLOB``,
    ``CONTEXT_BLOB``, ``CONTEXT_BLOB_V9`` or a ``SeqFileFormat``'s name), the tokens of a file,
    the source seq id of a llama sequence blob, the architecture name, June-2025's output
    block, the attention KV section's span and whether its cells carry ``KV_CELL_EXT``."""

    name: str
    tokens: np.ndarray | None = None
    source_seq_id: int | None = None
    arch: str | None = None
    kv_offset: int | None = None        # where a hybrid's KV section starts (None: not read)
    section_offset: int = 0             # where the recurrent memory section starts
    outputs: Outputs | None = None
    kv_cell_ext: bool | None = None     # None: no KV section was read
    other_readings: str | None = None   # the defects of the framings the bytes might have been

    @property
    def whole(self) -> bool | None:
        """True when the framing holds the whole cache, False one sequence, None: the bytes say neither."""
        if self.name in (SEQ_BLOB, GGSQ.name, GGSQ_V2.name):
            return False
        if self.name in (CONTEXT_BLOB, CONTEXT_BLOB_V9, GGSN.name, GGSN_V9.name):
            return True
        return None


def _check_whole(name: str, seq_id: int | None) -> None:
    """A framing of the whole cache is read with seq_id -1, one of a sequence with a seq_id >= 0."""
    whole = Framing(name).whole
    if seq_id is None or whole is None or whole == (seq_id < 0):
        return
    raise wrong_seq_id_for_framing(name, name in (format.name for format in FILE_FORMATS), whole)


def _read_prefix(reader: Any, prefix: str, arch: str | None,
                 max_tokens: int) -> tuple[int | None, str | None, Outputs | None]:
    """The fields of a blob framing ``prefix`` at the cursor: (source seq id, arch, outputs)."""
    if prefix == SEQ_BLOB:
        (magic, source), at = reader.unpack(SEQ_BLOB_HEADER, "sequence blob header (magic and seq id)")
        if magic != SEQ_BLOB_MAGIC:
            raise seq_blob_magic(magic, at)
        return source, None, None
    if prefix == CONTEXT_BLOB:
        return None, _read_arch(reader, arch), None
    if prefix == CONTEXT_BLOB_V9:
        name = _read_arch(reader, arch)
        return None, name, _read_outputs(reader, max_tokens)
    return None, None, None


# -- telling framings apart: every candidate parsed whole --------------------------------

class _Recording:
    """A stream as a file for a trial parse: reads through the reader (its peeked bytes first)
    and keeps what it read, to be handed back (``give_back``) so the real read sees it again."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self.read_bytes = bytearray()

    def read(self, n: int) -> bytes:
        piece: bytes = self.reader.read_up_to(n)
        self.read_bytes += piece
        return piece

    def seekable(self) -> bool:
        return False

    def give_back(self) -> None:
        self.reader.pending = bytes(self.read_bytes) + self.reader.pending


def _discard(piece: bytes) -> None:
    """A trial's rows consumer: a stream's rows are recorded by ``_Recording``, not kept twice."""


def _at_end(reader: Any) -> bool:
    """Whether the reader's cursor is the end of the data."""
    if isinstance(reader, MemoryReader) or reader.length is not None:
        return bool(reader.offset == reader.length)
    return not reader.read_up_to(1)


@dataclass(frozen=True)
class _Attempt:
    """A candidate's trial parse: whether its framing's own fields fitted, where the memory
    section started, and the defect that stopped it (None: all of it fitted exactly)."""

    framing_parsed: bool
    section_offset: int
    error: StateError | None

    @property
    def parsed(self) -> bool:
        return self.error is None


def _attempt(reader: Any, prefix: str, ext: bool | None, arch: str | None, seq_id: int | None,
             cache: Geometry | None, layers: Sequence[int] | None, watch: Any, max_tokens: int) -> _Attempt:
    """Parse everything from the cursor as framing ``prefix`` (KV cells with ``ext``; None: no KV
    section) without moving the reader: a copy of the cursor in memory, a file read again from
    the same position, or a stream whose bytes are handed back.  ``watch.trial()`` (optional)
    is a fresh watch for the parse: its checks stop a stream's read where the real read would."""
    recording = None
    if isinstance(reader, MemoryReader):
        trial: Any = MemoryReader(reader.data[reader.offset:])
    elif reader.length is not None:
        here = reader.file.tell()
        reader.file.seek(here - len(reader.pending))
        trial = FileReader(reader.file, reader.op)
    else:
        recording = _Recording(reader)
        trial = FileReader(recording, reader.op, rows=_discard)
    framing_parsed, section_at = False, 0
    try:
        _check_whole(prefix, seq_id)
        _read_prefix(trial, prefix, arch, max_tokens)
        framing_parsed = True
        if ext is not None:
            read_kv_section(trial, seq_id, ext, cache, max_tokens)
        section_at = trial.offset
        trial_watch = None if watch is None else watch.trial()
        if cache is None and layers is None:   # which layers hold state is not known: any filter fits
            parse_any_filter(trial, trial_watch)
        else:
            parse_section(trial, cache, -1 if seq_id is None else seq_id, trial_watch, layers)
        if not _at_end(trial):
            raise trailing(trial.offset, trial.length) if trial.length is not None else stream_goes_on(trial.offset)
        return _Attempt(True, section_at, None)
    except StateError as exc:
        return _Attempt(framing_parsed, section_at, exc)
    finally:
        if recording is not None:
            recording.give_back()
        elif not isinstance(reader, MemoryReader):
            reader.file.seek(here)


def _candidate_name(prefix: str, ext: bool | None, exts: Sequence[bool | None]) -> str:
    if len(exts) == 1:
        return prefix
    return f"{prefix} with KV cells {'with' if ext else 'without'} the extended position"


def _pick(reader: Any, prefixes: Sequence[str], exts: Sequence[bool | None], arch: str | None,
          seq_id: int | None, cache: Geometry | None, layers: Sequence[int] | None,
          watch: Any, max_tokens: int) -> tuple[str, bool | None, str | None]:
    """The one candidate (framing prefix, KV cell ext) whose parse fits the bytes exactly, and
    the defects of the other readings that got past their framing's fields (or None).

    Candidates are parsed whole, the last of ``prefixes`` (the default: current llama.cpp's
    framing) last: when every other one fails, the default is the only reading left and the
    section's reader checks it (no second parse, so a stream is read once); the others'
    defects are kept for its message.  Two readings that fit are refused; when none fits and
    more than one got past its framing's fields, the ``StateError`` gives each reading's
    defect (offsets from the cursor); when only one did, it is read, to report its defect.
    """
    combos = [(prefix, ext) for prefix in prefixes for ext in exts]
    if len(combos) == 1:
        return combos[0][0], combos[0][1], None
    default = prefixes[-1]
    attempts: dict[tuple[str, bool | None], _Attempt] = {}
    for prefix, ext in sorted(combos, key=lambda combo: combo[0] == default):
        if prefix == default and len(exts) == 1 and not any(a.parsed for a in attempts.values()):
            others = "; ".join(f"as a {_candidate_name(other, other_ext, exts)}: {attempt.error}"
                               for (other, other_ext), attempt in attempts.items() if attempt.framing_parsed)
            return prefix, ext, others or None
        attempts[prefix, ext] = _attempt(reader, prefix, ext, arch, seq_id, cache, layers, watch, max_tokens)
    fitting = [combo for combo in combos if attempts[combo].parsed]
    if len({(prefix, attempts[prefix, ext].section_offset) for prefix, ext in fitting}) > 1:
        names = " and ".join(f"a {_candidate_name(prefix, ext, exts)}" for prefix, ext in fitting)
        hints = []
        if len({prefix for prefix, _ in fitting}) > 1:
            keys = dict.fromkeys(next((key for key, value in READ_FRAMINGS.items() if value == prefix), "llama")
                                 for prefix, _ in fitting)
            hints.append("framing= (" + " or ".join(map(repr, keys)) + ")")
        if len({ext for _, ext in fitting}) > 1:
            hints.append("kv_cell_ext= (True or False)")
        raise StateError(f"the state is ambiguous: it parses whole as {names}; pass {' and '.join(hints)} "
                         f"to say which")
    if fitting:
        return fitting[0][0], fitting[0][1], None
    started = sorted((combo for combo in combos if attempts[combo].framing_parsed),
                     key=lambda combo: (combo[0] != default, bool(combo[1])))
    if len(started) == 1:
        return started[0][0], started[0][1], None
    if not started:   # every framing failed in its own fields: the first reading's defect
        return combos[0][0], combos[0][1], None
    where = f" from byte {reader.offset}" if reader.offset else ""
    readings = "; ".join(f"as a {_candidate_name(prefix, ext, exts)}: {attempts[prefix, ext].error}"
                         for prefix, ext in started)
    raise StateError(f"the state{where} fits no framing: read {readings}")


def _framing_hint(framing: Any, seq_id: int | None) -> str | None:
    """The framing prefix ``state_read(framing=...)`` names (None: detect it)."""
    if framing is None:
        return None
    if not isinstance(framing, str) or framing not in READ_FRAMINGS:
        raise ArgumentError(f"unknown framing {framing!r} (None to detect it, or one of "
                            f"{', '.join(map(repr, READ_FRAMINGS))})")
    prefix = READ_FRAMINGS[framing]
    if prefix is None:   # current llama.cpp: the sequence header or the architecture string
        if seq_id is None:
            raise ArgumentError("framing='llama' needs a seq_id: a sequence's header or the whole cache's "
                                "architecture string")
        return SEQ_BLOB if seq_id >= 0 else CONTEXT_BLOB
    return prefix


def read_framing(reader: Any, seq_id: int | None, arch: str | None = None, kv_section: bool = False,
                 max_tokens: int = MAX_TOKENS, sequence_file: bool | None = None, cache: Geometry | None = None,
                 framing: str | None = None, kv_cell_ext: bool | None = None,
                 layers: Sequence[int] | None = None, watch: Any = None) -> Framing:
    """Read every framing field up to the recurrent memory section (see ``Framing``).

    ``seq_id`` None: any framing (``inspect``); -1: one of the whole cache; >= 0: one of a
    sequence.  ``sequence_file`` True: a state file is required, False: a blob, None: either.
    ``framing``: a key of ``READ_FRAMINGS`` instead of detecting.  ``kv_cell_ext``: whether a
    KV section's cells carry ``KV_CELL_EXT`` (None: found from the bytes).  ``watch`` (``inspect``'s):
    its ``trial()`` checks every trial parse's memory section (``parse_section``), and it sees the
    KV section's streams as they are read (``read_kv_section``).

    Detection: a state file by its magic and version; a llama sequence blob by its magic; an
    architecture string by its characters (see ``MIN_ARCH``), anything else is a bare section.
    After an architecture string (a blob's; a 'ggsn' file's version says) the i32 is current
    llama.cpp's cell count or June-2025's n_outputs: both readings are parsed whole (``cache``
    and ``layers`` shape the memory section), and the state is read only if exactly one fits
    its length (``_pick``).
    """
    if kv_cell_ext is not None and not isinstance(kv_cell_ext, bool):
        raise ArgumentError(f"kv_cell_ext must be True, False or None (found from the bytes), got {kv_cell_ext!r}")
    tokens = None
    hinted = _framing_hint(framing, seq_id)
    if hinted is not None:
        prefixes = [hinted]
        label = hinted
    else:
        head = reader.peek(4)
        if sequence_file or (sequence_file is None and file_magic(head)):
            tokens, file_format = read_seq_file_header(reader, max_tokens)
            label = file_format.name
            prefixes = [CONTEXT_BLOB_V9 if file_format.outputs else CONTEXT_BLOB if file_format.arch_string
                        else BARE]
        elif len(head) == 4 and struct.unpack("<I", head)[0] == SEQ_BLOB_MAGIC:
            prefixes = [SEQ_BLOB]
        elif _arch_name(reader) is not None:
            prefixes = [CONTEXT_BLOB_V9, CONTEXT_BLOB]
        else:
            prefixes = [BARE]
    exts: list[bool | None] = [None] if not kv_section else [False, True] if kv_cell_ext is None else [kv_cell_ext]
    prefix, ext, others = _pick(reader, prefixes, exts, arch, seq_id, cache, layers, watch, max_tokens)
    if tokens is None:
        label = prefix
    _check_whole(label, seq_id)
    source, name, outputs = _read_prefix(reader, prefix, arch, max_tokens)
    kv_at = None
    if ext is not None:
        kv_at = reader.offset
        read_kv_section(reader, seq_id, ext, cache, max_tokens, watch=watch)
    return Framing(label, tokens, source, name, kv_at, reader.offset, outputs, ext, others)


@dataclass(frozen=True)
class Unframed:
    """A blob or file in memory split at its memory section: ``framing`` and ``section``
    (a zero-copy view of the recurrent memory section)."""

    framing: Framing
    section: memoryview


def unframe(data: Any, seq_id: int | None = None, arch: str | None = None, kv_section: bool = False,
            max_tokens: int = MAX_TOKENS, framing: str | None = None, cache: Geometry | None = None,
            kv_cell_ext: bool | None = None) -> Unframed:
    """Find the framing of ``data`` (any of them, see ``read_framing``) without being told which;
    ``StateError`` naming the field and byte offset of a damaged header.  ``kv_section``: the
    state is a hybrid model's, whose memory begins with an attention KV section (skipped).
    ``framing``: a key of ``READ_FRAMINGS``; "bare": ``data`` is a memory section, nothing is
    detected.  ``cache``: the geometry the section is read into (it decides which readings fit)."""
    reader = MemoryReader(blob_view(data))
    if framing == "bare" and not kv_section:
        return Unframed(Framing(BARE), reader.data)
    found = read_framing(reader, seq_id, arch, kv_section, max_tokens, cache=cache, framing=framing,
                         kv_cell_ext=kv_cell_ext)
    return Unframed(found, reader.data[reader.offset:])


def in_section(exc: StateError, framing: Framing) -> StateError:
    """A defect of the memory section, placed in the framed bytes (with the other readings'
    defects when another framing was possible)."""
    others = f" (read otherwise it fails too: {framing.other_readings})" if framing.other_readings else ""
    if not framing.section_offset:
        return StateError(f"{exc}{others}") if others else exc
    return StateError(f"the state blob at byte {framing.section_offset}: {exc}{others}")

