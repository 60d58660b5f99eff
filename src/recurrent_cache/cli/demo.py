"""``python -m recurrent_cache demo``: a Mamba model serving many clients from one cache.

In the spirit of llama.cpp's ``llama-parallel -np 5 -ns 8``: ``--clients``
clients, each with a prompt (the start of a held-out standard-library file, or
one written by hand), are served by ``--parallel`` sequence slots with
continuous batching (``recurrent_cache.generation.Generator``).  ``--fork`` instead runs one prompt
and forks it (``seq_cp``) into ``--parallel`` sequences that continue with
different sampling seeds.  ``--prefix-cache`` (``demo_prefix``) and
``--speculative K`` (``demo_speculative``) are the other modes; ``--write-model``
writes the model and exits.  A mode refuses, in one line, every option it
would not use (``refusal``).

Afterwards every client is run again alone, from a zero state, through the
plain reference forward (no cache): its tokens must be identical and its last
logits equal within ``TOLERANCE``.  Any difference is reported loudly and the
exit status is 1.

The model is the byte-level Mamba shipped with the package (numpy only);
``--random-weights`` gives the seeded random one, ``--model FILE.gguf`` any
Mamba-1 GGUF (its own vocabulary encodes the prompts and decodes the text).
"""

from __future__ import annotations

import argparse
import sys
import time

from ..generation import Generator, Stats
from ..models import LanguageModel, ModelError, write_gguf
from ..models.sampling import DEFAULT_TEMPERATURE, DEFAULT_TOP_K
from . import demo_prefix, demo_speculative
from .clients import make_clients, print_clients
from .model_options import (add_model_options, add_storage_options, build_model, model_name, storage_refusal,
                            where_states_live)
from .options import USER_ERROR, OneLineParser, float_in, greedy_refusal, int_in, text
from .serving import Client, new_cache, progress_bar, serve
from .verification import TOLERANCE, fail, verify

__all__ = ["DEFAULTS", "EXAMPLES", "main", "parse_args", "refusal"]

MAX_SEED = 2**63 - 1

EXAMPLES = """\
examples:
  python -m recurrent_cache demo                                   # 8 clients on 5 slots, verified
  python -m recurrent_cache demo --clients 16 --parallel 4 --temperature 0
  python -m recurrent_cache demo --fork --parallel 3 --n-predict 64
  python -m recurrent_cache demo --prefix-cache --store /tmp/states  # run it twice
  python -m recurrent_cache demo --speculative 4
  python -m recurrent_cache demo --storage torch                   # states and model on torch (cpu)
  python -m recurrent_cache demo --random-weights --write-model random.gguf
"""

# The defaults of the options a mode may refuse: they are None after parsing unless given.
DEFAULTS = {"clients": 8, "parallel": 5, "n_predict": 32, "ubatch": 16, "temperature": DEFAULT_TEMPERATURE,
            "top_k": DEFAULT_TOP_K, "dtype": "f32", "seed": 0, "storage": "numpy"}

# What each mode reads besides --model / --random-weights / --compute / --quiet; any other option
# given with it is refused.  ("seed" of --write-model: only with --random-weights, see refusal.)
SERVING = {"parallel", "n_predict", "ubatch", "dtype", "seed", "corrupt_step", "storage", "device"}
READS = {
    "": SERVING | {"clients", "temperature", "top_k"},
    "--fork": SERVING | {"fork", "temperature", "top_k"},
    "--prefix-cache": SERVING | {"prefix_cache", "store", "clients"},
    "--speculative": SERVING | {"speculative", "clients"},
    "--write-model": {"write_model", "seed"},
}
WHY = {
    "--fork": "it serves --parallel forks of one prompt",
    "--prefix-cache": "it decodes greedily, with and without the prefix cache",
    "--speculative": "it decodes greedily, with and without speculation",
    "--write-model": "it writes the model and exits",
}
ALWAYS = {"model", "random_weights", "compute", "quiet"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options, checked: a bad value or a combination the mode cannot serve exits with one line."""
    parser = OneLineParser(
        prog="python -m recurrent_cache demo",
        description="Serve clients with a Mamba model from one recurrent cache (continuous batching),\n"
                    "then check every client against a solo run.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(parser)
    parser.add_argument("--clients", type=int_in(1, 10_000), help="clients to serve (default 8)")
    parser.add_argument("--parallel", type=int_in(1, 1024), help="sequence slots / cache cells (default 5)")
    parser.add_argument("--n-predict", type=int_in(1, 100_000), help="tokens each client generates (default 32)")
    parser.add_argument("--ubatch", type=int_in(1, 65536), help="n_ubatch: most tokens per ubatch (default 16)")
    parser.add_argument("--seed", type=int_in(0, MAX_SEED),
                        help="seed of the prompt order, the samplers and the random weights (default 0)")
    parser.add_argument("--temperature", type=float_in(0.0, 100.0),
                        help=f"0 is greedy; above 0 samples softmax(logits / T) (default {DEFAULT_TEMPERATURE})")
    parser.add_argument("--top-k", type=int_in(0, 1_000_000),
                        help=f"sample from the k most likely tokens only, 0: all (default {DEFAULT_TOP_K})")
    parser.add_argument("--dtype", choices=sorted(TOLERANCE), help="state storage type (default f32)")
    add_storage_options(parser)
    modes = parser.add_argument_group("modes (one at a time; each refuses the options it does not use)")
    modes.add_argument("--fork", action="store_true",
                       help="one prompt forked with seq_cp into --parallel sampled continuations")
    modes.add_argument("--speculative", type=int_in(1, 64), metavar="K",
                       help="speculative decoding: draft K tokens by prompt lookup, verify them in one "
                            "batch, roll the rejected ones back (greedy; compared with plain decoding)")
    modes.add_argument("--prefix-cache", action="store_true",
                       help="conversations sharing system prompts, served with and without rc.PrefixCache (greedy)")
    modes.add_argument("--store", metavar="DIR_OR_URL", type=text("store"),
                       help="with --prefix-cache (implied): a shared state store behind it, a directory or "
                            "a redis:// / unix:// URL; run twice, the second run restores the first's prefixes")
    modes.add_argument("--write-model", metavar="GGUF", type=text("path"),
                       help="write the model as a GGUF file and exit")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    # Testing only: overwrite a live state after this step; the verification must then fail.
    parser.add_argument("--corrupt-step", type=int_in(0, 2**31 - 1), help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    problem = refusal(options)
    if problem:
        parser.error(problem)
    for name, value in DEFAULTS.items():
        if getattr(options, name) is None:
            setattr(options, name, value)
    options.prefix_cache = options.prefix_cache or options.store is not None
    return options


def refusal(options: argparse.Namespace) -> str:
    """Why the parsed options cannot be served together ("" when they can): two modes, or an
    option the chosen mode would silently ignore."""
    flags = {name: f"--{name.replace('_', '-')}" for name in vars(options)}
    given = {name for name, value in vars(options).items() if value is not None and value is not False}
    modes = [flag for flag, names in (("--fork", {"fork"}), ("--prefix-cache", {"prefix_cache", "store"}),
                                      ("--speculative", {"speculative"}), ("--write-model", {"write_model"}))
             if given & names]
    if len(modes) > 1:
        return f"{modes[0]} and {modes[1]} are different modes: choose one"
    mode = modes[0] if modes else ""
    reads = READS[mode] | ALWAYS
    if mode in ("--prefix-cache", "--speculative") and options.temperature == 0:
        reads = reads | {"temperature"}   # greedy, as asked
    if mode == "--write-model" and not options.random_weights:
        reads = reads - {"seed"}          # only random weights have a seed
    ignored = [flags[name] for name in sorted(given - reads)]
    if ignored:
        shown = ", ".join(ignored[:-1]) + " and " + ignored[-1] if len(ignored) > 1 else ignored[0]
        return f"{shown} would be ignored by {mode}: {WHY[mode]}"
    return greedy_refusal(options.temperature, options.top_k) or storage_refusal(options)


def main(argv: list[str] | None = None) -> int:
    """The demo: parse, build the model, run the mode; the exit status."""
    options = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        model = build_model(options)
        if options.write_model:
            write_gguf(model, options.write_model, name="recurrent-cache-random-mamba" if options.random_weights
                       else "recurrent-cache-byte-mamba")
            print(f"wrote {options.write_model}: {model.hparams.describe()}")
            return 0
    except (ImportError, OSError, ModelError) as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return USER_ERROR
    if options.prefix_cache:
        return demo_prefix.run(options, model)
    if options.speculative:
        return demo_speculative.run(options, model)
    return serve_clients(options, model)


def serve_clients(options: argparse.Namespace, model: LanguageModel) -> int:
    """Continuous batching of ``--clients`` clients (or ``--fork``), the report and the verification."""
    count = options.parallel if options.fork else options.clients
    clients = make_clients(model, count, options.n_predict, options.temperature, options.top_k, options.seed,
                           same_prompt=options.fork)
    cache = new_cache(model, options.parallel, options.dtype, storage=options.storage, device=options.device)
    progress = progress_bar(sum(client.n_predict for client in clients), options.quiet)
    generator = Generator(model, cache, n_ubatch=options.ubatch)
    start = time.perf_counter()
    served = serve(generator, clients, progress, options.corrupt_step, fork=options.fork)
    seconds = time.perf_counter() - start
    progress.close()

    report(options, model, clients, generator.stats, seconds, cache.n_seq_max)
    if served.corruption:
        print(f"testing          {served.corruption}")
    problems, worst = verify(model, clients, options.dtype)
    if problems:
        return fail(f": {len(problems)} mismatches with the solo runs",
                    "the cache served states that differ from running each client alone", problems)
    print(f"verification     PASSED: {len(clients)} of {len(clients)} clients equal their solo runs "
          f"(tokens identical, last logits within {worst:.1e} relative, tolerance {TOLERANCE[options.dtype]:g})")
    return 0


def report(options: argparse.Namespace, model: LanguageModel, clients: list[Client], stats: Stats,
           seconds: float, cells: int) -> None:
    """What was served, how fast, and where the time went."""
    processed = stats.prompt_tokens + stats.decode_tokens
    generated = sum(len(client.tokens) for client in clients)
    shares = {what: 100.0 * spent / seconds for what, spent in stats.seconds.items()}
    mode = f"1 prompt forked into {len(clients)} sequences" if options.fork else \
        f"{len(clients)} ({options.parallel} at a time)"
    print(f"model            {model.hparams.describe()} ({model_name(options)})")
    print(f"cache            {cells} cells, {options.dtype} states{where_states_live(options)}, "
          f"n_ubatch {options.ubatch}")
    print(f"clients          {mode}")
    print_clients(model, clients, samplers=True)
    print(f"tokens           {processed} processed ({stats.prompt_tokens} prompt + {stats.decode_tokens} decode), "
          f"{generated} generated")
    print(f"steps            {stats.steps} init_batch, {stats.ubatches} ubatches")
    print(f"throughput       {processed / seconds:.0f} tokens/s ({seconds:.2f} s)")
    # a recurrent cache gives each running sequence one cell
    print(f"peak cells used  {stats.peak_sequences} of {cells}")
    print(f"time             cache {shares['cache']:.1f}% (init_batch, seq ops) · "
          f"model {shares['model']:.1f}% (apply and forward) · "
          f"other {100.0 - shares['cache'] - shares['model']:.1f}%")
