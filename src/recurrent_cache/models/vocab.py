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

Control tokens (``tokenizer.ggml.token_type`` 3, e.g. ``<|endoftext|>``)
decode to nothing and are never produced by ``encode``, as in llama.cpp's
detokenizer without ``special``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

__all__ = ["Vocabulary", "escape", "gpt2_byte_decoder"]

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
_NOT_ENCODED = {TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_UNUSED}
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


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
                 eos: int | None = None) -> None:
        self.kind = kind
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
        pieces = [b"" if kind == TOKEN_CONTROL else piece_of(text, kind) for text, kind in zip(tokens, types)]
        return cls(model, pieces, [kind not in _NOT_ENCODED for kind in types], eos)

    def padded(self, n_vocab: int) -> "Vocabulary":
        """This vocabulary with ids up to ``n_vocab`` (the extra ones decode to nothing, never encoded)."""
        extra = n_vocab - len(self.pieces)
        return Vocabulary(self.kind, self.pieces + [b""] * extra, self.encodable + [False] * extra, self.eos)

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


def escape(data: bytes) -> str:
    """``data`` as one printable line: UTF-8 text, with ``\\n``, ``\\t``, ``\\\\`` and ``\\xNN``
    (a byte that is not UTF-8) escapes as in a Python string literal."""
    text = data.decode("utf-8", "surrogateescape")
    return "".join(char if char.isprintable() and char != "\\" else _escaped(char) for char in text)


def _escaped(char: str) -> str:
    if "\udc80" <= char <= "\udcff":  # surrogateescape's stand-in for an undecodable byte
        return f"\\x{ord(char) - 0xDC00:02x}"
    return char.encode("unicode_escape").decode("ascii")
