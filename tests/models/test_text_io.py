"""Text in, text out: vocabularies (byte, GPT-2 BPE, SentencePiece), escaping, sampling, GGUF vocabularies."""

from __future__ import annotations

import io

import numpy as np
import pytest

from recurrent_cache.models import Sampler, Vocabulary, escape, load_gguf, random_model, write_gguf
from recurrent_cache.models.vocab import TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, gpt2_byte_decoder

# -- vocabularies ----------------------------------------------------------------------------


def test_byte_vocabulary_round_trips_every_byte():
    vocab = Vocabulary.of_bytes()
    data = bytes(range(256)) + "naïve € 😀".encode()
    assert vocab.encode(data) == list(data)
    assert vocab.decode(vocab.encode(data)) == data
    assert vocab.encode("é") == [0xC3, 0xA9]


def test_gpt2_byte_mapping_is_a_bijection_with_printable_characters():
    decoder = gpt2_byte_decoder()
    assert sorted(decoder.values()) == list(range(256))
    assert all(char.isprintable() and not char.isspace() for char in decoder)
    assert decoder["Ġ"] == 0x20 and decoder["Ċ"] == 0x0A and decoder["!"] == 0x21


def gpt2_vocabulary() -> tuple[list[str], list[int]]:
    """A small GPT-2 style vocabulary: a control token, every single byte, and some merges."""
    by_byte = {b: c for c, b in gpt2_byte_decoder().items()}
    merges = ["def", "Ġf", "ib", "(n", "):", "ĊĠĠĠ", "ĠĠĠĠ", "Ġreturn", "é"]
    tokens = ["<|endoftext|>"] + [by_byte[b] for b in range(256)] + merges
    return tokens, [TOKEN_CONTROL] + [TOKEN_NORMAL] * (len(tokens) - 1)


def test_gpt2_vocabulary_encodes_greedily_and_decodes_exactly():
    tokens, types = gpt2_vocabulary()
    vocab = Vocabulary.from_gguf_tokens("gpt2", tokens, types)
    text = "def fib(n):\n    return é\x00\xff".encode("utf-8", "surrogateescape")
    ids = vocab.encode(text)
    assert vocab.decode(ids) == text
    # longest match: "def", "Ġf", "ib", "(n", "):" are single tokens
    assert [tokens[i] for i in ids[:5]] == ["def", "Ġf", "ib", "(n", "):"]
    assert vocab.decode([0]) == b""          # control tokens decode to nothing ...
    assert 0 not in vocab.encode("<|endoftext|>")  # ... and are never produced by encode
    # each id's bytes are the piece's characters mapped back through GPT-2's table
    decoder = gpt2_byte_decoder()
    for token in ids:
        assert vocab.decode([token]) == bytes(decoder[c] for c in tokens[token])


def test_sentencepiece_vocabulary_spaces_and_byte_tokens():
    tokens = ["<s>", "</s>", "<0x0A>", "<0xFF>", "▁def", "▁", "f", "(", ")", ":"]
    types = [TOKEN_CONTROL, TOKEN_CONTROL, TOKEN_BYTE, TOKEN_BYTE] + [TOKEN_NORMAL] * 6
    vocab = Vocabulary.from_gguf_tokens("llama", tokens, types)
    ids = vocab.encode(b" def f():\n\xff")
    assert [tokens[i] for i in ids] == ["▁def", "▁", "f", "(", ")", ":", "<0x0A>", "<0xFF>"]
    assert vocab.decode(ids) == b" def f():\n\xff"


def test_a_byte_the_vocabulary_cannot_encode_is_named():
    vocab = Vocabulary.from_gguf_tokens("gpt2", ["a", "b"])
    with pytest.raises(ValueError, match="byte 0x63 at offset 1"):
        vocab.encode("ac")


def test_unsupported_tokenizer_model_is_rejected():
    with pytest.raises(ValueError, match="'bert'"):
        Vocabulary.from_gguf_tokens("bert", ["a"])


@pytest.mark.parametrize("data, shown", [
    (b"def f():\n\treturn 1", "def f():\\n\\treturn 1"),
    (b"a\\b", "a\\\\b"),
    (b"\xff\x00\x1b[31m", "\\xff\\x00\\x1b[31m"),
    ("é €".encode(), "é €"),
])
def test_escape_keeps_text_on_one_printable_line(data, shown):
    assert escape(data) == shown


# -- a GGUF file's vocabulary -----------------------------------------------------------------


def test_gguf_vocabulary_is_read_and_padding_decodes_to_nothing(tmp_path):
    pytest.importorskip("gguf", reason="writing GGUF files needs the gguf package")
    tokens, types = gpt2_vocabulary()
    n_vocab = -(len(tokens) // -8) * 8 + 8  # padded past the token list, as llama.cpp's converter does
    model = random_model(seed=1, n_vocab=n_vocab, n_embd=16, n_layer=1, d_state=4)
    path = tmp_path / "bpe.gguf"
    write_gguf(model, path, tokens=tokens, token_types=types)
    loaded = load_gguf(path)
    assert loaded.vocab.kind == "gpt2" and len(loaded.vocab) == n_vocab
    text = b"def fib(n):\n    return 0"
    assert loaded.vocab.decode(loaded.vocab.encode(text)) == text
    assert loaded.vocab.decode([n_vocab - 1]) == b""
    assert load_gguf(tmp_path / "bpe.gguf").vocab.encode(text) == loaded.vocab.encode(text)


def test_model_without_vocabulary_of_256_tokens_is_byte_level(tmp_path):
    pytest.importorskip("gguf")
    write_gguf(random_model(seed=2, n_embd=16, n_layer=1, d_state=4), tmp_path / "bytes.gguf")
    assert load_gguf(tmp_path / "bytes.gguf").vocab.kind == "bytes"
    write_gguf(random_model(seed=2, n_vocab=100, n_embd=16, n_layer=1, d_state=4), tmp_path / "ids.gguf")
    assert load_gguf(tmp_path / "ids.gguf").vocab is None


# -- sampling -----------------------------------------------------------------------------------


LOGITS = np.log(np.array([0.05, 0.4, 0.1, 0.3, 0.15]))


def test_greedy_is_argmax():
    assert Sampler()(LOGITS) == 1
    assert Sampler(temperature=2.0, top_k=1, seed=5)(LOGITS) == 1


def draws(sampler: Sampler, n: int = 4000) -> np.ndarray:
    return np.bincount([sampler(LOGITS) for _ in range(n)], minlength=len(LOGITS))


def test_sampling_follows_the_softmax_of_the_top_k():
    draws_ = draws(Sampler(1.0, 3, seed=7))
    assert draws_[[0, 2]].sum() == 0, "tokens outside the top 3 are never drawn"
    expected = np.array([0, 0.4, 0, 0.3, 0.15]) / 0.85
    assert np.abs(draws_ / draws_.sum() - expected).max() < 0.03


def test_temperature_sharpens_and_flattens():
    cold = draws(Sampler(0.25, 0, seed=1)) / 4000
    hot = draws(Sampler(4.0, 0, seed=1)) / 4000
    exact = {t: np.exp(LOGITS / t) / np.exp(LOGITS / t).sum() for t in (0.25, 4.0)}
    assert np.abs(cold - exact[0.25]).max() < 0.03 and np.abs(hot - exact[4.0]).max() < 0.03


def test_same_seed_same_draws_and_fresh_restarts():
    sampler = Sampler(1.0, 0, seed=(3, 1))
    first = [sampler(LOGITS) for _ in range(50)]
    again = sampler.fresh()
    assert [again(LOGITS) for _ in range(50)] == first
    other = Sampler(1.0, 0, seed=(3, 2))
    assert [other(LOGITS) for _ in range(50)] != first


@pytest.mark.parametrize("kwargs", [{"temperature": -1.0}, {"temperature": float("nan")},
                                    {"temperature": float("inf")}, {"top_k": -1}, {"top_k": 1.5}])
def test_bad_sampler_settings_are_named(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Sampler(**kwargs)


def test_commands_speak_through_a_bpe_vocabulary(tmp_path, capsys):
    """A llama.cpp-style Mamba GGUF with GPT-2 pieces: generate encodes the prompt with them and
    prints the decoded continuation; demo serves text prompts and passes its verification."""
    pytest.importorskip("gguf")
    from recurrent_cache.cli import demo, generate
    tokens, types = gpt2_vocabulary()
    model = random_model(seed=4, n_vocab=-(len(tokens) // -8) * 8, n_embd=16, n_layer=2, d_state=4)
    path = str(tmp_path / "bpe.gguf")
    write_gguf(model, path, tokens=tokens, token_types=types)
    loaded = load_gguf(path, dtype=np.float32)

    assert generate.main(["def fib(n):", "--model", path, "-n", "12", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    prompt = loaded.vocab.encode("def fib(n):")
    expected, _ = generate.generate(loaded, prompt, 12, Sampler(), n_ubatch=64, dtype="f32")
    shown = io.StringIO()
    generate.TextStream(shown).write(loaded.vocab.decode(expected), final=True)
    assert out == "def fib(n):" + shown.getvalue() + "\n"
    assert demo.main(["--model", path, "--clients", "3", "--parallel", "2", "--n-predict", "4", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "PASSED: 3 of 3" in out and out.count('" -> "') == 3


def test_generation_stops_at_the_files_end_of_text_token(tmp_path):
    pytest.importorskip("gguf")
    from recurrent_cache.cli.generate import generate
    tokens, types = gpt2_vocabulary()
    model = random_model(seed=6, n_vocab=len(tokens), n_embd=16, n_layer=1, d_state=4)
    prompt = list(range(1, 9))
    free, _ = generate(model, prompt, 6, Sampler(), n_ubatch=64, dtype="f32")
    eos = free[2]  # make the third greedy token the end of text
    write_gguf(model, tmp_path / "eos.gguf", tokens=tokens, token_types=types, eos=eos)
    loaded = load_gguf(tmp_path / "eos.gguf")
    assert loaded.vocab.eos == eos
    stopped, _ = generate(loaded, prompt, 6, Sampler(), n_ubatch=64, dtype="f32")
    assert stopped == free[:free.index(eos) + 1]
