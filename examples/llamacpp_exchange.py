"""Exchanging one sequence's state with a running llama.cpp, both ways (docs/llamacpp-exchange.md).

llama.cpp (through llama-cpp-python) and the package load the same GGUF file,
the package's shipped byte-level Mamba, and hand a sequence to each other as a
'ggsq' file, the format of ``llama_state_seq_save_file``:

1. llama.cpp decodes a prompt and saves the sequence; the package loads the
   file and continues the sequence with its own numpy model, while llama.cpp
   continues it too; the two sets of logits are compared.
2. The package decodes the prompt and saves the sequence; llama.cpp loads the
   file and continues, while the package continues too; compared again.

It prints how close the logits are over every continuation step (the largest
absolute difference, and that divided by the largest |logit|), whether the
greedy next byte agrees, and whether llama.cpp's file, loaded and written back
by the package, is the same bytes.  Needs ``pip install llama-cpp-python``
(it compiles llama.cpp)::

    python examples/llamacpp_exchange.py
"""

from __future__ import annotations

import ctypes
import tempfile
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

import recurrent_cache as rc
from recurrent_cache.models import TRAINED_GGUF, MambaModel, trained_model

PROMPT = list(b"def mean(values):\n    total = 0.0\n    for value in values:\n")
CONTINUATION = list(b"        total += value\n    return total / len(values)\n")


def open_llama() -> Any:
    """llama.cpp on the shipped GGUF: one thread (a reproducible run), logits for every token."""
    return llama_cpp.Llama(model_path=str(TRAINED_GGUF), n_ctx=256, n_batch=64, n_ubatch=64,
                           n_threads=1, n_threads_batch=1, logits_all=True, verbose=False)


def llama_continue(llama: Any, tokens: list[int]) -> np.ndarray:
    """llama.cpp decodes ``tokens`` after what it holds, one per step; the logits of each step."""
    rows = []
    for token in tokens:
        llama.eval([token])
        rows.append(llama.scores[llama.n_tokens - 1].copy())
    return np.array(rows)


def package_continue(model: MambaModel, cache: rc.RecurrentCache, seq_id: int, tokens: list[int]) -> np.ndarray:
    """The package's model decodes ``tokens`` on ``seq_id``, one per step; the logits of each step."""
    rows = []
    for token in tokens:
        batch = rc.Batch(token=[token], pos=[cache.seq_pos_max(seq_id) + 1], seq_id=[seq_id])
        rows.append(model.forward(cache.init_batch(batch))[0])
    return np.array(rows)


def llama_saves(llama: Any, path: Path) -> None:
    """llama.cpp decodes PROMPT from an empty state and saves sequence 0 as a 'ggsq' file."""
    llama.reset()
    llama.eval(PROMPT)
    tokens = (llama_cpp.llama_token * len(PROMPT))(*PROMPT)
    if not llama_cpp.llama_state_seq_save_file(llama.ctx, str(path).encode(), 0, tokens, len(PROMPT)):
        raise RuntimeError(f"llama_state_seq_save_file could not write {path}")


def llama_loads(llama: Any, path: Path) -> list[int]:
    """llama.cpp restores sequence 0 from a 'ggsq' file; the file's tokens."""
    llama.reset()
    tokens = (llama_cpp.llama_token * llama.n_ctx())()
    count = ctypes.c_size_t(0)
    if not llama_cpp.llama_state_seq_load_file(llama.ctx, str(path).encode(), 0, tokens, len(tokens),
                                               ctypes.byref(count)):
        raise RuntimeError(f"llama.cpp refused {path}")
    # Llama.eval places the next token at position n_tokens: tell it how many the state holds
    llama.n_tokens = count.value
    llama.input_ids[:count.value] = tokens[:count.value]
    return list(tokens[:count.value])


def package_prefills(model: MambaModel) -> rc.RecurrentCache:
    """A cache for ``model`` in which sequence 0 has decoded PROMPT (in ubatches of 64, as llama.cpp)."""
    cache = model.new_cache()
    model.forward(cache.init_batch(rc.Batch(token=PROMPT, seq_id=[0] * len(PROMPT)), n_ubatch=64))
    return cache


def agreement(ours: np.ndarray, theirs: np.ndarray) -> dict[str, float]:
    """How close two runs' logits are over every step, and how often their greedy next byte agrees."""
    largest_diff = float(np.abs(ours - theirs).max())
    return {"max_abs_diff": largest_diff, "relative": largest_diff / float(np.abs(theirs).max()),
            "same_argmax": int((ours.argmax(axis=1) == theirs.argmax(axis=1)).sum()), "steps": len(theirs)}


def measure(directory: Path) -> dict[str, Any]:
    """Both directions of the exchange, with the package's model computing in float32 and float64."""
    llama = open_llama()
    models = {"f32": trained_model(np.float32), "f64": trained_model(np.float64)}
    results: dict[str, Any] = {}

    # llama.cpp -> the package
    saved = directory / "by_llama.ggsq"
    llama_saves(llama, saved)
    whole = llama.save_state().llama_state                # llama_state_get_data: the whole context
    llama_own = llama_continue(llama, CONTINUATION)      # llama.cpp continues its own sequence
    for compute, model in models.items():
        cache = model.new_cache()
        tokens = rc.load_seq_file(saved, cache, 0)
        if tokens.tolist() != PROMPT:
            raise RuntimeError(f"{saved} holds the tokens {tokens.tolist()}, not the prompt")
        if compute == "f32":   # written back before it moves on: the same bytes as llama.cpp's file
            rc.save_seq_file(directory / "written_back.ggsq", cache, 0, tokens)
            results["file_bytes"] = saved.stat().st_size
            results["same_bytes"] = (directory / "written_back.ggsq").read_bytes() == saved.read_bytes()
            context = model.new_cache()
            context.state_read(whole, -1, arch="mamba")
            results["context_bytes"] = len(whole)
            results["context_same_bytes"] = context.state_write(-1, framing="llama", arch="mamba") == whole
        results[f"llama_to_package_{compute}"] = agreement(package_continue(model, cache, 0, CONTINUATION),
                                                           llama_own)

    # the package -> llama.cpp
    for compute, model in models.items():
        cache = package_prefills(model)
        written = directory / f"by_package_{compute}.ggsq"
        rc.save_seq_file(written, cache, 0, PROMPT)
        package_own = package_continue(model, cache, 0, CONTINUATION)
        if llama_loads(llama, written) != PROMPT:
            raise RuntimeError(f"llama.cpp read other tokens than the prompt from {written}")
        results[f"package_to_llama_{compute}"] = agreement(package_own, llama_continue(llama, CONTINUATION))

    # the two computes of the package from the same state: how much of the difference is the package's rounding
    f32_run, f64_run = (package_continue(model, package_prefills(model), 0, CONTINUATION) for model in models.values())
    results["package_f32_vs_f64"] = agreement(f32_run, f64_run)
    return results


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        results = measure(Path(directory))
    print(f"llama.cpp's 'ggsq' file ({results['file_bytes']:,} bytes, {len(PROMPT)} tokens), loaded by the "
          f"package and written back: {'the same bytes' if results['same_bytes'] else 'DIFFERENT BYTES'}")
    print(f"llama.cpp's whole-context blob (Llama.save_state, {results['context_bytes']:,} bytes), read by the "
          f"package and written back: {'the same bytes' if results['context_same_bytes'] else 'DIFFERENT BYTES'}")
    print(f"logits over {len(CONTINUATION)} continuation steps, one token per step:")
    labels = {"llama_to_package": "llama.cpp saved, package continued vs llama.cpp continued",
              "package_to_llama": "package saved, llama.cpp continued vs package continued"}
    for key, label in labels.items():
        for compute in ("f32", "f64"):
            a = results[f"{key}_{compute}"]
            print(f"  {label} (package in {compute}): max |diff| {a['max_abs_diff']:.2e} = "
                  f"{a['relative']:.2e} of the largest |logit|; same greedy byte at {a['same_argmax']}/{a['steps']}")
    a = results["package_f32_vs_f64"]
    print(f"  package in f32 vs package in f64, same prompt: max |diff| {a['max_abs_diff']:.2e} = "
          f"{a['relative']:.2e} of the largest |logit|")


if __name__ == "__main__":
    main()
