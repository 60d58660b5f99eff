"""``python -m recurrent_cache generate "def fibonacci(n):"``: one prompt, streamed token by token.

The package's generation loop (``recurrent_cache.generation.Generator``) with
one request on a one-cell cache: the prompt in one ``init_batch`` (split into
ubatches of ``--ubatch`` tokens), then one ``init_batch`` per generated token; the model reads and
writes the sequence's state through ``st.r(il)`` / ``st.s(il)``.  The text
goes to stdout as it is generated; the figures (speed, the cache's cells,
positions and state size) go to stderr at the end, so
``generate ... > out.txt`` keeps only the text.

The model is the shipped byte-level Mamba unless ``--model FILE.gguf`` names
another (its own vocabulary encodes the prompt and decodes the tokens) or
``--random-weights`` asks for the seeded random one.

``--tokens 1,2,3`` gives the prompt as token ids instead of text, each checked
against the model's vocabulary; a model without a vocabulary takes only these,
and its stdout is then the prompt's and the generated token ids.
"""

from __future__ import annotations

import argparse
import os
import codecs
import sys
import time
from typing import Any, TextIO

from ..generation import Generator
from ..models import HybridModel, LanguageModel, ModelError, Sampler
from ..models.sampling import DEFAULT_TEMPERATURE, DEFAULT_TOP_K
from .model_options import add_model_options, add_storage_options, build_model, storage_refusal
from .options import USER_ERROR, OneLineParser, float_in, greedy_refusal, int_in
from .serving import Client, new_cache
from .verification import TOLERANCE, verify

__all__ = ["EXAMPLES", "TextStream", "generate", "main", "parse_args"]

STATE_DTYPES = ("f32", "f16", "bf16")
MAX_SEED = 2**63 - 1

EXAMPLES = """\
examples:
  python -m recurrent_cache generate "def fibonacci(n):"
  python -m recurrent_cache generate "import os" -n 400 --temperature 0.8 --top-k 20 --seed 3
  python -m recurrent_cache generate "class Stack:" --temperature 0 > continuation.txt
  python -m recurrent_cache generate "def main():" --storage torch --device cpu
  python -m recurrent_cache generate --tokens 100,101,102,32 -n 20   # the prompt as token ids
"""

MAX_TOKEN_ID = 2**31 - 2   # a token id is an int32 row of the embedding


def token_ids(text: str) -> list[int]:
    """An argparse ``type``: token ids separated by commas, e.g. "1,2,3"."""
    ids = []
    for part in text.split(","):
        try:
            value = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part.strip()!r} is not a token id (ids are separated by commas, "
                                             f"e.g. 1,2,3)") from None
        if not 0 <= value <= MAX_TOKEN_ID:
            raise argparse.ArgumentTypeError(f"token id {value} is outside [0, {MAX_TOKEN_ID}]")
        ids.append(value)
    return ids


token_ids.__name__ = "token ids"   # how argparse names the type in its error


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options, checked: a bad value exits with one line."""
    parser = OneLineParser(
        prog="python -m recurrent_cache generate",
        description="Continue one prompt with a Mamba model served from a recurrent cache, streaming the text.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("prompt", nargs="?", help="the text to continue")
    prompt.add_argument("--tokens", metavar="IDS", type=token_ids,
                        help="the prompt as token ids of the model's vocabulary instead of text, e.g. 1,2,3; "
                             "a model without a vocabulary takes only these, and prints token ids")
    parser.add_argument("-n", "--n-predict", type=int_in(1, 1_000_000), default=200,
                        help="tokens to generate (default 200)")
    parser.add_argument("--temperature", type=float_in(0.0, 100.0), default=DEFAULT_TEMPERATURE,
                        help=f"0 is greedy; above 0 samples softmax(logits / T) (default {DEFAULT_TEMPERATURE})")
    parser.add_argument("--top-k", type=int_in(0, 1_000_000),
                        help=f"sample from the k most likely tokens only, 0: all (default {DEFAULT_TOP_K})")
    parser.add_argument("--seed", type=int_in(0, MAX_SEED), default=0,
                        help="seed of the sampling and the random weights (default 0)")
    parser.add_argument("--ubatch", type=int_in(1, 65536), default=64,
                        help="n_ubatch: most prompt tokens per ubatch (default 64)")
    parser.add_argument("--dtype", choices=STATE_DTYPES, default="f32", help="state storage type")
    add_model_options(parser)
    add_storage_options(parser)
    options = parser.parse_args(argv)
    problem = greedy_refusal(options.temperature, options.top_k) or storage_refusal(options)
    if problem:
        parser.error(problem)
    options.storage = options.storage or "numpy"
    if options.top_k is None:
        options.top_k = DEFAULT_TOP_K
    return options


class TextStream:
    """Writes token bytes as text as soon as they form whole UTF-8 characters, escaping
    control characters other than newline and tab (they could drive the terminal)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def write(self, data: bytes, final: bool = False) -> None:
        text = self.decoder.decode(data, final)
        self.out.write("".join(c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode()
                               for c in text))
        self.out.flush()


def generate(model: LanguageModel, prompt: list[int], n_predict: int, sampler: Sampler, n_ubatch: int,
             dtype: str, stream: TextStream | None = None) -> tuple[list[int], dict[str, float]]:
    """Run ``prompt`` then generate ``n_predict`` tokens on a fresh one-cell numpy cache.

    Stops early at the vocabulary's end-of-text token (kept as the last token).
    Returns the generated tokens and the figures: seconds of the prompt and of
    the generation, and the cache's state per sequence in bytes.
    """
    client, figures = serve(model, prompt, n_predict, sampler, n_ubatch, dtype, stream)
    return client.tokens, figures


def serve(model: LanguageModel, prompt: list[int], n_predict: int, sampler: Sampler, n_ubatch: int,
              dtype: str, stream: TextStream | None = None, storage: str = "numpy",
              device: str | None = None) -> tuple[Client, dict[str, float]]:
    """``generate`` on a cache in ``storage`` (on ``device``): the served client and the figures.

    One request to the package's ``Generator``, streamed as its tokens come; the cache's figures are
    read while the sequence still holds its state."""
    cache = new_cache(model, 1, dtype, storage=storage, device=device)
    generator = Generator(model, cache, n_ubatch=n_ubatch)
    client = Client(0, prompt, n_predict, sampler)
    request = generator.submit(prompt, max_new_tokens=n_predict, temperature=sampler.temperature,
                               top_k=sampler.top_k, top_p=sampler.top_p, seed=sampler.seed)
    figures: dict[str, float] = {"size": cache.n_seq_max}   # a recurrent cell per sequence (both kinds of cache)
    start = time.perf_counter()
    while not generator.done:
        for event in generator.step():
            if stream is not None and model.vocab is not None:
                stream.write(model.vocab.decode(event.tokens))
        if "prompt_seconds" not in figures and (request.tokens or request.finished):
            figures["prompt_seconds"] = time.perf_counter() - start
            start = time.perf_counter()
        if not request.finished:
            figures.update(state_bytes=cache.state_size(request.seq),
                           cells_used=sum(cache.seq_pos_max(seq) >= 0 for seq in range(cache.n_seq_max)))
    figures["generate_seconds"] = time.perf_counter() - start
    figures["pos_max"] = request.n_cached - 1   # where its state was when it finished
    client.tokens, client.last_logits = request.tokens, request.last_logits
    return client, figures


def main(argv: list[str] | None = None) -> int:
    """Generate from the prompt (text or ``--tokens``) the arguments give; the exit status."""
    options = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        model = build_model(options)
    except (ModelError, ImportError) as exc:
        print(f"generate: {exc}", file=sys.stderr)
        return USER_ERROR
    prompt, problem = encoded_prompt(model, options)
    if problem:
        print(f"generate: {problem}", file=sys.stderr)
        return USER_ERROR

    sampler = Sampler(options.temperature, options.top_k, options.seed)
    if model.vocab is None:   # token ids in, token ids out: no vocabulary gives them text
        client, figures = serve(model, prompt, options.n_predict, sampler, options.ubatch, options.dtype,
                                    storage=options.storage, device=options.device)
        print(" ".join(map(str, prompt + client.tokens)))
    else:
        stream = TextStream(sys.stdout)
        if options.tokens is None:
            sys.stdout.write(options.prompt)
        else:
            stream.write(model.vocab.decode(prompt))   # the ids' text, escaped as generated text is
        client, figures = serve(model, prompt, options.n_predict, sampler, options.ubatch, options.dtype,
                                    stream, options.storage, options.device)
        stream.write(b"", final=True)
        sys.stdout.write("\n")
    sys.stdout.flush()

    name = options.model or ("random weights" if options.random_weights else "shipped byte-level model")
    p = model.hparams
    print(f"\n--- {name}: {p.describe()}, {sampler}", file=sys.stderr)
    print(f"--- prompt {len(prompt)} tokens in {figures['prompt_seconds']:.3f} s "
          f"({len(prompt) / figures['prompt_seconds']:.0f} tokens/s, ubatches of {options.ubatch}); "
          f"generated {len(client.tokens)} tokens in {figures['generate_seconds']:.3f} s "
          f"({len(client.tokens) / figures['generate_seconds']:.0f} tokens/s)", file=sys.stderr)
    if "state_bytes" in figures:
        print(f"--- cache: {figures['cells_used']} of {figures['size']} cell used, holding sequence 0 up to "
              f"position {figures['pos_max']}; its state is {figures['state_bytes']:,} bytes "
              f"({options.dtype}; {state_shape(model)}", file=sys.stderr)
    else:   # nothing to read: the sequence was removed in the step that finished it
        print(f"--- cache: the request finished in its first step (up to position {figures['pos_max']}), "
              f"and its sequence was removed", file=sys.stderr)
    if options.storage != "numpy":
        return verify_against_numpy(model, client, options)
    return 0


def state_shape(model: LanguageModel) -> str:
    """What a sequence's state holds, closing the report's parenthesis: the recurrent rows (the same at
    any length) and, for a hybrid model, the K and V rows of its attention layers (per token)."""
    p: Any = model.hparams
    if not isinstance(model, HybridModel):
        return f"{p.n_layer} layers x (conv {p.n_embd_r} + ssm {p.n_embd_s}) values) whatever the length"
    params = p.attention
    kv = (f"; K and V rows of {len(p.attn_layers)} attention layers x {params.n_embd_k} values per token"
          if params is not None and p.attn_layers else "")
    return f"{len(p.recr_layers)} recurrent layers x (conv {p.n_embd_r} + ssm {p.n_embd_s}) values{kv})"


def encoded_prompt(model: LanguageModel, options: argparse.Namespace) -> tuple[list[int], str]:
    """The prompt as token ids: ``--tokens`` checked against the model's vocabulary, or the text
    encoded by it; and "" or why there is no prompt to run."""
    n_vocab = model.hparams.n_vocab
    if options.tokens is not None:
        outside = [token for token in options.tokens if token >= n_vocab]
        if outside:
            return [], (f"--tokens: {outside[0]} is not a token of the model, whose vocabulary has the ids "
                        f"0 to {n_vocab - 1}")
        return options.tokens, ""
    if model.vocab is None:
        where = ("has no tokenizer.json: copy the checkpoint's tokenizer.json into it, or"
                 if options.model is not None and os.path.isdir(options.model)
                 else "has no vocabulary (no tokenizer.ggml.tokens):")
        return [], (f"{options.model} {where} give the prompt as token ids (0 to {n_vocab - 1}) with --tokens; "
                    f"text cannot be encoded")
    try:
        prompt = model.vocab.encode(options.prompt)
    except ValueError as exc:
        return [], f"the prompt cannot be encoded: {exc}"
    return prompt, "" if prompt else "the prompt is empty"


def verify_against_numpy(model: LanguageModel, client: Client, options: argparse.Namespace) -> int:
    """A run on another storage checked against the numpy forward run alone: the exit status."""
    problems, worst = verify(model, [client], options.dtype)
    if problems:   # on stderr: stdout holds the text
        print(f"\n*** VERIFICATION FAILED: the {options.storage} run differs from the numpy forward ***",
              file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    print(f"--- verified: the numpy forward alone gives the same {len(client.tokens)} tokens and last logits "
          f"within {worst:.1e} relative (tolerance {TOLERANCE[options.dtype]:g})", file=sys.stderr)
    return 0

