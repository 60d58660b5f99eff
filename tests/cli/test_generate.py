"""``python -m recurrent_cache generate``: text equal to a plain greedy loop, streamed token by token."""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np

from recurrent_cache.cli import generate as generate_command
from recurrent_cache.cli.generate import TextStream, generate
from recurrent_cache.models import ReferenceRun, Sampler, random_model, trained_model


def plain_greedy(model, prompt: bytes, n: int) -> bytes:
    run = ReferenceRun(model)
    logits = run.feed(list(prompt))[-1]
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = run.feed(out[-1:])[-1]
    return bytes(out)


def test_prints_prompt_and_greedy_continuation_then_figures(capsys):
    assert generate_command.main(["def fibonacci(n):", "-n", "30", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    expected = io.StringIO()
    TextStream(expected).write(plain_greedy(trained_model(), b"def fibonacci(n):", 30), final=True)
    assert captured.out == "def fibonacci(n):" + expected.getvalue() + "\n"
    assert "generated 30 tokens" in captured.err and "tokens/s" in captured.err
    # 17 prompt + 29 generated tokens fed back
    assert "1 of 1 cell used" in captured.err and "up to position 45" in captured.err


def test_text_is_written_as_each_token_arrives():
    class Recorder(io.StringIO):
        flushes = 0

        def flush(self) -> None:
            self.flushes += 1

    out = Recorder()
    model = random_model(seed=0)
    tokens, _ = generate(model, list(b"abc"), 25, Sampler(), n_ubatch=2, dtype="f32", stream=TextStream(out))
    assert len(tokens) == 25 and out.flushes == 25


def test_stream_joins_utf8_split_across_tokens_and_escapes_control_bytes():
    out = io.StringIO()
    stream = TextStream(out)
    for piece in [b"\xe2", b"\x82", b"\xac", b" ", b"\x1b", b"\n", b"\xff"]:
        stream.write(piece)
    stream.write(b"", final=True)
    assert out.getvalue() == "€ \\x1b\n\ufffd"


def test_sampled_generation_is_reproducible_from_its_seed(capsys):
    args = ["import os", "-n", "40", "--temperature", "0.9", "--top-k", "10", "--seed", "5"]
    assert generate_command.main(args) == 0
    first = capsys.readouterr().out
    assert generate_command.main(args) == 0
    assert capsys.readouterr().out == first
    assert generate_command.main(args[:-1] + ["6"]) == 0
    assert capsys.readouterr().out != first


def test_streams_in_a_real_process():
    result = subprocess.run([sys.executable, "-m", "recurrent_cache", "generate", "class Stack:", "-n", "20"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("class Stack:") and len(result.stdout) > len("class Stack:") + 10
    assert "Traceback" not in result.stderr and "cache:" in result.stderr
