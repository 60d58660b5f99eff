"""Token ids <-> bytes: the byte vocabulary, and a GGUF file's own (``tokenizer.ggml.*``).

A ``Vocabulary`` knows the bytes every token stands for.  Decoding joins them;
encoding is a greedy longest match over the bytes of the text (exact for the
byte vocabulary; for a BPE vocabulary it finds *a* valid tokenization, not
always the one the model's merges would give, which is good enough for a
prompt).  Three kinds of pieces are understood:

* ``bytes`` — 256 tokens, token ``b`` is byte ``b`` (the shipped byte-level
  model; a GGUF with ``tokenizer.ggml.model = "no_vocab"`` and 256 tokens);
* ``gpt2`` — byte-level BPE, as llama.cpp's converter writes it for Mamba
  models (GPT-NeoX tokenizer): each byte of a piece is stored as one
  printable unicode character (GPT-2's ``bytes_to_unicode``, "Ġ" is a space);
* ``llama`` — SentencePiece pieces: "▁" is a space, ``<0xAB>`` a raw byte.

Control and unused tokens (``tokenizer.ggml.token_type`` 3 and 5, e.g. ``<|endoftext|>``, padding)
decode to nothing and are never produced by ``encode``, as in llama.cpp's
detokenizer without ``special``.

A Hugging Face ``tokenizer.json`` gives the same three things — pieces, types,
BPE merges — as llama.cpp's converter reads them (``TokenizerTable``); with
the ``tokenizers`` package installed, ``encode`` is then the tokenizer's own.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ._untrusted import short_repr

__all__ = ["TokenizerTable", "Vocabulary", "escape", "gpt2_byte_decoder"]

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
_NOT_ENCODED = {TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_UNUSED}
_SILENT = {TOKEN_CONTROL, TOKEN_UNUSED}   # decode to nothing, as llama.cpp's token_to_piece without special
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
MAX_TOKEN_ID = 2**31 - 1   # llama.cpp's token ids are int32


def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` reversed: the character that stands for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:  # control characters, space and a few others move above U+00FF
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {char: b for b, char in chars.items()}


class Vocabulary:
    """The bytes of every token id, and text -> ids by greedy longest match.

    ``pieces[i]`` is what token ``i`` decodes to (b"" for control tokens);
    ``encodable[i]`` says whether ``encode`` may produce it.
    """

    def __init__(self, kind: str, pieces: Sequence[bytes], encodable: Sequence[bool] | None = None,
                 eos: int | None = None, encoder: Callable[[str], list[int]] | None = None) -> None:
        self.kind = kind
        # text -> ids by the model's own tokenizer (tokenizer.json through ``tokenizers``); None: greedy match
        self.encoder = encoder
        # the end-of-text token (tokenizer.ggml.eos_token_id): generation stops there; None: never
        self.eos = eos if eos is not None and 0 <= eos < len(pieces) else None
        self.pieces = list(pieces)
        self.encodable = [True] * len(self.pieces) if encodable is None else list(encodable)
        if len(self.encodable) != len(self.pieces):
            raise ValueError(f"{len(self.encodable)} encodable flags for {len(self.pieces)} pieces")
        self._ids: dict[bytes, int] = {}
        for token, piece in enumerate(self.pieces):
            if self.encodable[token] and piece and piece not in self._ids:  # the lowest id wins, as in a BPE vocab
                self._ids[piece] = token
        self._longest = max(map(len, self._ids), default=0)

    @classmethod
    def of_bytes(cls) -> "Vocabulary":
        """The byte vocabulary: 256 tokens, token ``b`` is byte ``b``."""
        return cls("bytes", [bytes([b]) for b in range(256)])

    @classmethod
    def from_gguf_tokens(cls, model: str, tokens: Sequence[str], token_types: Sequence[int] | None = None,
                         eos: int | None = None) -> "Vocabulary":
        """From ``tokenizer.ggml.model``, ``.tokens``, ``.token_type`` and ``.eos_token_id``."""
        types = list(token_types) if token_types is not None else [TOKEN_NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise ValueError(f"{len(types)} token types for {len(tokens)} tokens")
        if model == "gpt2":
            decoder = gpt2_byte_decoder()

            def piece_of(text: str, kind: int) -> bytes:
                if all(char in decoder for char in text):
                    return bytes(decoder[char] for char in text)
                return text.encode("utf-8")  # an added token stored as plain text
        elif model == "llama":
            def piece_of(text: str, kind: int) -> bytes:
                byte = _BYTE_PIECE.fullmatch(text)
                if byte and kind == TOKEN_BYTE:
                    return bytes([int(byte.group(1), 16)])
                return text.replace("\u2581", " ").encode("utf-8")
        else:
            raise ValueError(f"tokenizer model {model!r} is not supported (gpt2 and llama are)")
        pieces = [b"" if kind in _SILENT else piece_of(text, kind) for text, kind in zip(tokens, types)]
        return cls(model, pieces, [kind not in _NOT_ENCODED for kind in types], eos)

    def padded(self, n_vocab: int) -> "Vocabulary":
        """This vocabulary with ids up to ``n_vocab`` (the extra ones decode to nothing, never encoded)."""
        extra = n_vocab - len(self.pieces)
        return Vocabulary(self.kind, self.pieces + [b""] * extra, self.encodable + [False] * extra, self.eos,
                          self.encoder)

    def __len__(self) -> int:
        return len(self.pieces)

    def decode(self, ids: Iterable[int]) -> bytes:
        """The bytes of ``ids`` joined (ids outside the vocabulary raise ``IndexError``)."""
        pieces = self.pieces
        out = []
        for token in ids:
            if not 0 <= token < len(pieces):
                raise IndexError(f"token id {token} is outside the vocabulary [0, {len(pieces)})")
            out.append(pieces[token])
        return b"".join(out)

    def encode(self, data: bytes | str) -> list[int]:
        """``data`` (str: as UTF-8) as token ids, taking the longest known piece at each position."""
        if self.encoder is not None:
            return self.encoder(data if isinstance(data, str) else data.decode("utf-8"))
        if isinstance(data, str):
            data = data.encode("utf-8")
        if self.kind == "bytes":
            return list(data)
        ids = []
        at = 0
        while at < len(data):
            for length in range(min(self._longest, len(data) - at), 0, -1):
                token = self._ids.get(data[at:at + length])
                if token is not None:
                    ids.append(token)
                    at += length
                    break
            else:
                raise ValueError(f"byte {data[at]:#04x} at offset {at} has no token in this vocabulary")
        return ids


@dataclass(frozen=True)
class TokenizerTable:
    """A ``tokenizer.json``'s tokens as llama.cpp's converter writes them (``tokenizer.ggml.*``)."""

    model: str                # "gpt2" (byte-level BPE) or "llama" (SentencePiece-style pieces)
    tokens: list[str]         # by id; ids the file skips are "[PAD<id>]" of type UNUSED
    token_types: list[int]
    merges: list[str]         # BPE merges, "left right"

    @classmethod
    def from_json(cls, data: Any) -> "TokenizerTable":
        """The table of a parsed ``tokenizer.json`` (ValueError naming the key and the value that are wrong).

        Token ids are integers in ``[0, MAX_TOKEN_ID]``; pieces and merges are strings.
        """
        model = data.get("model") if isinstance(data, dict) else None
        if not isinstance(model, dict):
            raise ValueError("no 'model' object")
        ids: dict[int, str] = {}
        vocab = model.get("vocab")
        if isinstance(vocab, dict):          # BPE, WordPiece, WordLevel: {piece: id}
            for piece, token_id in vocab.items():
                ids[_token_id(token_id, f"model.vocab[{short_repr(piece)}]")] = piece
        elif isinstance(vocab, list):        # Unigram: [[piece, score], ...]
            for token_id, entry in enumerate(vocab):
                if not isinstance(entry, list) or not entry or not isinstance(entry[0], str):
                    raise ValueError(f"model.vocab[{token_id}] = {short_repr(entry)} is not [piece, score]")
                ids[token_id] = entry[0]
        else:
            raise ValueError("model.vocab is neither an object nor a list")
        types = {i: TOKEN_NORMAL for i in ids}
        added_tokens = data.get("added_tokens") or []
        if not isinstance(added_tokens, list):
            raise ValueError(f"added_tokens = {short_repr(added_tokens)} is not a list")
        for at, added in enumerate(added_tokens):
            content = added.get("content") if isinstance(added, dict) else None
            if not isinstance(content, str):
                raise ValueError(f"added_tokens[{at}] = {short_repr(added)} is not a token with a string content")
            token_id = _token_id(added.get("id"), f"added_tokens[{at}].id")
            ids[token_id] = content
            types[token_id] = TOKEN_CONTROL if added.get("special") else TOKEN_USER_DEFINED
        if not ids:
            raise ValueError("no tokens")
        n_tokens = max(ids) + 1
        if n_tokens > 2 * len(ids) + 1024:   # a hostile id would make the padded list huge
            raise ValueError(f"token id {n_tokens - 1} for {len(ids)} tokens")
        tokens = [ids.get(i, f"[PAD{i}]") for i in range(n_tokens)]
        token_types = [types.get(i, TOKEN_UNUSED) for i in range(n_tokens)]
        merges = [_merge(m, f"model.merges[{at}]") for at, m in enumerate(_list(model.get("merges"), "model.merges"))]
        kind = "gpt2" if _mentions_byte_level(data.get("decoder")) else "llama"
        if kind == "llama":
            token_types = [TOKEN_BYTE if kind_ == TOKEN_NORMAL and _BYTE_PIECE.fullmatch(t) else kind_
                           for t, kind_ in zip(tokens, token_types)]
        return cls(kind, tokens, token_types, merges)

    def padded(self, n_vocab: int) -> "TokenizerTable":
        """The table with ``[PAD<id>]`` tokens of type UNUSED up to ``n_vocab``, as llama.cpp's converter pads
        it (llama.cpp takes the token count as the vocabulary size, which must match ``token_embd``)."""
        extra = range(len(self.tokens), n_vocab)
        return TokenizerTable(self.model, self.tokens + [f"[PAD{i}]" for i in extra],
                              self.token_types + [TOKEN_UNUSED] * len(extra), self.merges)

    def vocabulary(self, eos: int | None = None, encoder: Callable[[str], list[int]] | None = None) -> Vocabulary:
        """The ``Vocabulary`` of these tokens (decoding as llama.cpp would), encoding with ``encoder`` if given."""
        vocab = Vocabulary.from_gguf_tokens(self.model, self.tokens, self.token_types, eos)
        return Vocabulary(vocab.kind, vocab.pieces, vocab.encodable, vocab.eos, encoder)


def _token_id(value: Any, key: str) -> int:
    """``value`` as a token id, or ValueError naming ``key``: an integer (not a bool) in ``[0, MAX_TOKEN_ID]``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKEN_ID:
        raise ValueError(f"{key} = {short_repr(value)} is not a token id (an integer in [0, 2**31))")
    return value


def _list(value: Any, key: str) -> list[Any]:
    """``value`` when it is a list, [] when it is missing or null; ValueError naming ``key`` otherwise."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError(f"{key} = {short_repr(value)} is not a list")
    return value


def _merge(merge: Any, key: str) -> str:
    """A BPE merge as ``"left right"``: tokenizer.json writes it so, or (tokenizers >= 0.20) as a pair."""
    if isinstance(merge, str):
        return merge
    if isinstance(merge, list) and len(merge) == 2 and all(isinstance(side, str) for side in merge):
        return " ".join(merge)
    raise ValueError(f"{key} = {short_repr(merge)} is not a merge (\"left right\" or [left, right])")


def _mentions_byte_level(decoder: Any) -> bool:
    """Whether a tokenizer.json decoder (possibly a Sequence of them) is GPT-2's ByteLevel."""
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    decoders = decoder.get("decoders")
    return isinstance(decoders, list) and any(_mentions_byte_level(d) for d in decoders)


def escape(data: bytes) -> str:
    """``data`` as one printable line: UTF-8 text, with ``\\n``, ``\\t``, ``\\\\`` and ``\\xNN``
    (a byte that is not UTF-8) escapes as in a Python string literal."""
    text = data.decode("utf-8", "surrogateescape")
    return "".join(char if char.isprintable() and char != "\\" else _escaped(char) for char in text)


def _escaped(char: str) -> str:
    if "\udc80" <= char <= "\udcff":  # surrogateescape's stand-in for an undecodable byte
        return f"\\x{ord(char) - 0xDC00:02x}"
    return char.encode("unicode_escape").decode("ascii")
