"""Decode speed of 130m-shaped Mamba-1 and Mamba-2 models: the package next to llama.cpp and transformers, one run.

    python bench/model_speed.py            # a few minutes on 2 cores; writes bench/results/model_speed.md
    python bench/model_speed.py --quick    # small models, a few tokens: the script works (writes nothing)
    python bench/model_speed.py --before /tmp/before/src/recurrent_cache/models   # a former forward beside

The models have mamba-130m's shapes (n_embd 768, 24 layers, vocab 50,280,
d_inner 1,536; Mamba-1 d_state 16; Mamba-2 d_state 128 in heads of 64) and
seeded random weights, since only the arithmetic matters here.  Everything
computes in float32: the package's model (``dtype=np.float32``, f32 states) on
numpy storage and on torch storage (CPU: the numpy math over the tensors' memory,
``forward``'s default there, and torch's own ops, ``native=True``); llama.cpp (llama-cpp-python, when it
imports) on the f32 GGUF file the package writes of the same model, with
``n_threads`` 2; transformers' ``MambaForCausalLM`` / ``Mamba2ForCausalLM``
built from the same weights (when installed).  Each decodes ``--tokens`` greedy
tokens after a short prompt, for one sequence and for 8 together; the table gives
generated tokens per second (summed over the sequences) and the ratio to llama.cpp.

``--threads`` (default 2) is llama.cpp's ``n_threads``, torch's thread count and
that of the package's compiled products (``models.set_num_threads``: one to eight
rows, a decode step); numpy's BLAS, which takes more rows, takes
``OPENBLAS_NUM_THREADS`` (or ``OMP_NUM_THREADS``) from the environment.  On a
loaded machine a thread count equal to the cores makes every engine wait for
its slowest thread: llama.cpp's 2-thread figures then swing tenfold from run
to run; the load average is printed with the table.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.quick import NOTE, add_quick_option  # noqa: E402

import recurrent_cache as rc  # noqa: E402
from recurrent_cache.models import (RecurrentModel, random_mamba2_model, random_model, set_num_threads,  # noqa: E402
                                    write_gguf)

RESULTS = Path(__file__).resolve().parent / "results" / "model_speed.md"
PROMPT = [17, 424, 93, 100, 7]   # a few token ids, the same for every engine
THREADS = 2

# mamba-130m's shapes; --quick shrinks them
FULL_SHAPE = dict(n_vocab=50280, n_embd=768, n_layer=24)
QUICK_SHAPE = dict(n_vocab=1000, n_embd=128, n_layer=2)

Decoder = Callable[[int, int], float]   # (n_seqs, n_tokens) -> generated tokens per second


def build_models(quick: bool, models: Any = None) -> dict[str, RecurrentModel]:
    """The two 130m-shaped models (``models``: the package's ``models`` module to build them with)."""
    shape = QUICK_SHAPE if quick else FULL_SHAPE
    if models is None:
        return {"Mamba-1": random_model(0, **shape, d_state=16, dtype=np.float32),
                "Mamba-2": random_mamba2_model(0, **shape, d_state=16 if quick else 128,
                                               head_dim=32 if quick else 64, dtype=np.float32)}
    return {"Mamba-1": models.random_model(0, **shape, d_state=16, dtype=np.float32),
            "Mamba-2": models.random_mamba2_model(0, **shape, d_state=16 if quick else 128,
                                                  head_dim=32 if quick else 64, dtype=np.float32)}


def former_models(directory: Path) -> Any:
    """A former copy of ``src/recurrent_cache/models`` (``git archive``), imported beside this one as
    ``recurrent_cache._models_before``: the same seeded weights, its own forward (a before/after in one run)."""
    name = "recurrent_cache._models_before"

    class FormerModules(importlib.abc.MetaPathFinder):
        """Its modules from ``directory`` (ahead of the editable install's finder, which maps the package's)."""

        def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
            if not fullname.startswith(name + "."):
                return None
            return importlib.machinery.PathFinder.find_spec(fullname, [str(directory)])
    sys.meta_path.insert(0, FormerModules())
    spec = importlib.util.spec_from_file_location(name, directory / "__init__.py",
                                                  submodule_search_locations=[str(directory)])
    if spec is None or spec.loader is None:
        raise SystemExit(f"--before {directory}: no models package there")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def package_decoder(model: RecurrentModel, storage: str, native: bool = False) -> Decoder:
    """The package's forward on a cache of ``storage`` ("numpy" or "torch"), greedy; ``native``: torch's own ops
    on the CPU rather than the numpy math over the tensors' memory (``LanguageModel.forward``)."""
    def greedy(cache: rc.RecurrentCache, batch: rc.Batch, n_ubatch: int) -> list[int]:
        st = cache.init_batch(batch, n_ubatch)
        logits = model.forward(st, native=True) if native else model.forward(st)   # (a --before model: no native)
        return [int(i) for i in logits.argmax(1)]

    def rate(n_seqs: int, n_tokens: int) -> float:
        cache = model.new_cache(n_seq_max=n_seqs, storage=storage)
        seq_ids = list(range(n_seqs))
        n = len(PROMPT)
        tokens = greedy(cache, rc.Batch(token=PROMPT * n_seqs, pos=list(range(n)) * n_seqs,
                                        seq_id=[s for s in seq_ids for _ in PROMPT],
                                        logits=([0] * (n - 1) + [1]) * n_seqs), 512)
        start = time.perf_counter()
        for step in range(n_tokens):
            tokens = greedy(cache, rc.Batch(token=tokens, pos=[n + step] * n_seqs, seq_id=seq_ids,
                                            logits=[1] * n_seqs), n_seqs)
        return n_seqs * n_tokens / (time.perf_counter() - start)
    return rate


def llamacpp_decoder(gguf_path: Path) -> Decoder | str:
    """llama.cpp on ``gguf_path`` through llama-cpp-python's C API, or why not."""
    try:
        import llama_cpp as lc
    except ImportError:
        return "skipped: llama-cpp-python is not installed"
    lc.llama_log_set(_QUIET_LOGS, ctypes.c_void_p())
    params = lc.llama_model_default_params()
    params.n_gpu_layers = 0
    model = lc.llama_model_load_from_file(str(gguf_path).encode(), params)
    if not model:
        return f"skipped: llama.cpp could not load {gguf_path.name}"
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    _KEEP.append(model)

    def rate(n_seqs: int, n_tokens: int) -> float:
        cparams = lc.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = 512, 512, 512
        cparams.n_seq_max = n_seqs
        cparams.n_threads = cparams.n_threads_batch = THREADS
        ctx = lc.llama_init_from_model(model, cparams)
        batch = lc.llama_batch_init(len(PROMPT) * n_seqs, 0, 1)

        def decode(entries: list[tuple[int, int, int, bool]]) -> list[int]:
            for i, (token, pos, seq, wants) in enumerate(entries):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, wants
            batch.n_tokens = len(entries)
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            return [int(np.argmax(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,))))
                    for i, entry in enumerate(entries) if entry[3]]
        try:
            n = len(PROMPT)
            tokens = decode([(t, i, s, i == n - 1) for s in range(n_seqs) for i, t in enumerate(PROMPT)])
            start = time.perf_counter()
            for step in range(n_tokens):
                tokens = decode([(t, n + step, s, True) for s, t in enumerate(tokens)])
            return n_seqs * n_tokens / (time.perf_counter() - start)
        finally:
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)
    return rate


_KEEP: list[Any] = []   # llama.cpp models, loaded for the whole run


def _ignore_log(_level: int, _text: bytes, _user: Any) -> None:
    """llama.cpp's log lines would bury the table."""


def _quiet_logs() -> Any:
    try:
        import llama_cpp as lc
    except ImportError:
        return None
    return lc.llama_log_callback(_ignore_log)


_QUIET_LOGS = _quiet_logs()   # kept alive: llama.cpp calls it later


def transformers_decoder(model: RecurrentModel) -> Decoder | str:
    """transformers' Mamba / Mamba2ForCausalLM with ``model``'s weights, or why not."""
    try:
        import torch
        import transformers
    except ImportError:
        return "skipped: transformers (or torch) is not installed"
    transformers.logging.set_verbosity_error()   # its notes on missing CUDA kernels would bury the table
    p: Any = model.hparams
    tensors: dict[str, np.ndarray] = {"backbone.embeddings.weight": model.token_embd,
                                      "backbone.norm_f.weight": model.output_norm, "lm_head.weight": model.output}
    common = dict(vocab_size=p.n_vocab, hidden_size=p.n_embd, state_size=p.d_state, num_hidden_layers=p.n_layer,
                  conv_kernel=p.d_conv, expand=p.d_inner // p.n_embd, layer_norm_epsilon=p.rms_eps,
                  tie_word_embeddings=model.tied, use_bias=False, use_conv_bias=True)
    mamba2 = hasattr(p, "n_head")
    if mamba2:
        config: Any = transformers.Mamba2Config(**common, num_heads=p.n_head, head_dim=p.head_dim,
                                                n_groups=p.n_group)
        hf: Any = transformers.Mamba2ForCausalLM(config)
    else:
        config = transformers.MambaConfig(**common, intermediate_size=p.d_inner, time_step_rank=p.dt_rank)
        hf = transformers.MambaForCausalLM(config)
    for il, layer in enumerate(model.layers):
        prefix = f"backbone.layers.{il}."
        tensors |= {prefix + "norm.weight": layer.attn_norm, prefix + "mixer.in_proj.weight": layer.ssm_in,
                    prefix + "mixer.conv1d.weight": layer.ssm_conv1d[:, None, :],
                    prefix + "mixer.conv1d.bias": layer.ssm_conv1d_b, prefix + "mixer.A_log": np.log(-layer.ssm_a),
                    prefix + "mixer.D": layer.ssm_d, prefix + "mixer.out_proj.weight": layer.ssm_out}
        if mamba2:
            tensors |= {prefix + "mixer.dt_bias": layer.ssm_dt_b, prefix + "mixer.norm.weight": layer.ssm_norm}
        else:
            tensors |= {prefix + "mixer.x_proj.weight": layer.ssm_x, prefix + "mixer.dt_proj.weight": layer.ssm_dt,
                        prefix + "mixer.dt_proj.bias": layer.ssm_dt_b}
    hf.load_state_dict({name: torch.from_numpy(np.ascontiguousarray(array, np.float32))
                        for name, array in tensors.items()})
    hf.eval()

    def rate(n_seqs: int, n_tokens: int) -> float:
        prompt = torch.tensor([PROMPT] * n_seqs)
        with torch.inference_mode():
            start = time.perf_counter()
            hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n_tokens,
                        min_new_tokens=n_tokens, do_sample=False, pad_token_id=0)
            return n_seqs * n_tokens / (time.perf_counter() - start)
    return rate


def best_rates(decoders: dict[str, Decoder], batches: list[int], n_tokens: int, rounds: int) -> dict[str, list[float]]:
    """Each decoder's tokens per second at each batch size: the best of ``rounds`` rounds, in each of which every
    decoder runs in turn — a burst of load on a shared machine then falls on one round of one engine, not on all of
    one engine's figures (each decoder is warmed up first: weights on the device, first-call costs)."""
    for decoder in decoders.values():
        decoder(1, 2)
    best = {engine: [0.0] * len(batches) for engine in decoders}
    for _ in range(rounds):
        for engine, decoder in decoders.items():
            for i, n_seqs in enumerate(batches):
                best[engine][i] = max(best[engine][i], decoder(n_seqs, n_tokens))
    return best


def set_threads(n_threads: int) -> None:
    """llama.cpp's, torch's and the package's compiled products' thread count."""
    global THREADS
    THREADS = n_threads
    set_num_threads(n_threads)
    if torch_available():
        import torch

        torch.set_num_threads(n_threads)


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_quick_option(parser, "2-layer models of n_embd 128, 4 tokens")
    parser.add_argument("--tokens", type=int, help="greedy tokens per sequence (default 64; 4 with --quick)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="sequences decoding together")
    parser.add_argument("--threads", type=int, default=THREADS,
                        help="llama.cpp's, torch's and the compiled products' threads (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every engine in turn; the best counts")
    parser.add_argument("--before", type=Path, metavar="DIR",
                        help="a former src/recurrent_cache/models (e.g. git archive REV src/recurrent_cache/models "
                             "| tar -x -C /tmp/before): its numpy and torch rows beside this one's, in the same run")
    options = parser.parse_args()
    before = build_models(options.quick, former_models(options.before)) if options.before else {}
    set_threads(options.threads)
    if options.quick:
        print(NOTE)
    n_tokens = options.tokens or (4 if options.quick else 64)
    load_before = os.getloadavg()
    lines = ["| model | engine | " + " | ".join(f"{b} seq tok/s | ×llama.cpp" for b in options.batches) + " |",
             "| --- | --- | " + " | ".join("---: | ---:" for _ in options.batches) + " |"]
    notes = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, model in build_models(options.quick).items():
            gguf_path = Path(tmp) / f"{label}.gguf"
            write_gguf(model, gguf_path, file_type="f32")
            engines: dict[str, Decoder | str] = {"llama.cpp": llamacpp_decoder(gguf_path),
                                                 "package, numpy": package_decoder(model, "numpy")}
            engines["package, torch CPU"] = (package_decoder(model, "torch") if torch_available()
                                             else "skipped: torch is not installed")
            if torch_available():
                engines["package, torch CPU, torch's ops"] = package_decoder(model, "torch", native=True)
            if label in before:
                engines["package, numpy (before)"] = package_decoder(before[label], "numpy")
                if torch_available():
                    engines["package, torch CPU (before)"] = package_decoder(before[label], "torch")
            engines["transformers"] = transformers_decoder(model)
            runnable = {engine: decoder for engine, decoder in engines.items() if not isinstance(decoder, str)}
            notes += [f"{label}, {engine}: {decoder}" for engine, decoder in engines.items() if engine not in runnable]
            rates = best_rates(runnable, options.batches, n_tokens, 1 if options.quick else options.rounds)
            reference = rates.get("llama.cpp")
            for engine, row in rates.items():
                cells = [f"{r:,.1f} | " + (f"{r / reference[i]:.2f}" if reference else "—") for i, r in enumerate(row)]
                lines.append(f"| {label} | {engine} | " + " | ".join(cells) + " |")
            print(f"{label}: {model.hparams.describe()}", flush=True)
    load_after = os.getloadavg()
    lines += ["", f"{n_tokens} greedy tokens per sequence after a {len(PROMPT)}-token prompt, float32 everywhere, "
              f"llama.cpp and torch with {options.threads} threads, best of {options.rounds} rounds; "
              f"load average (1 min) {load_before[0]:.2f} before, "
              f"{load_after[0]:.2f} after; {os.cpu_count()} CPUs"] + notes
    report = "\n".join(lines)
    print(report)
    if not options.quick:
        RESULTS.write_text("# Model decode speed (python bench/model_speed.py)\n\n" + report + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
