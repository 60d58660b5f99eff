"""Decode speed of ~130m-shaped hybrid models: the package next to llama.cpp and transformers, one run.

    python bench/hybrid_model_speed.py          # several minutes on 2 cores; writes bench/results/hybrid_model_speed.md
    python bench/hybrid_model_speed.py --quick  # small models, a few tokens: the script works (writes nothing)

Each model is built by transformers from a config with mamba-130m's widths (n_embd 768, 24 layers, vocab 50,280)
and its family's layer pattern, seeded random weights, saved with ``save_pretrained``; the package loads that
directory (``load_hf``, float32, f32 states and K/V), llama.cpp runs the GGUF the package converts it to (when
the package writes that family's GGUF and llama-cpp-python imports), transformers runs the checkpoint itself.
Each decodes ``--tokens`` greedy tokens after a short prompt, for one sequence and for 8 together; the table gives
generated tokens per second (summed over the sequences) and the ratio to llama.cpp.  Threads as
``bench/model_speed.py`` (``--threads``, default 2, for llama.cpp, torch and the compiled products; numpy's BLAS from
``OPENBLAS_NUM_THREADS``).

* **Jamba-like**: Mamba-1 layers (d_inner 1,536, d_state 16), attention every 8th layer (offset 4; 12 heads,
  4 KV heads), a mixture of 4 experts (2 per token, n_ff 768) on every other layer and a dense SwiGLU MLP
  (n_ff 768) on the others.
* **Qwen3-Next-like**: Gated DeltaNet layers (Qwen3-Next's head size 128, its head counts scaled to n_embd 768:
  4 key heads, 8 value heads, so a layer's state is 8 x 128 x 128, Mamba-2 130m's order), gated attention every
  4th layer (6 heads of 128, 2 KV heads, a quarter of each head rotated), a mixture of 4 experts (2 per token,
  n_ff 768, renormalised) with a gated shared expert (n_ff 768) on every layer.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.model_speed import (Decoder, PROMPT, THREADS, best_rates, llamacpp_decoder, package_decoder,  # noqa: E402
                               set_threads, torch_available)
from bench.quick import NOTE, add_quick_option  # noqa: E402

from recurrent_cache.errors import ModelError  # noqa: E402
from recurrent_cache.models import convert_hf_to_gguf, load_hf  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "hybrid_model_speed.md"


def jamba_config(quick: bool) -> Any:
    import transformers

    if quick:
        return transformers.JambaConfig(vocab_size=1000, hidden_size=128, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                        num_experts_per_tok=2, attn_layer_period=4, attn_layer_offset=2,
                                        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, tie_word_embeddings=False)
    return transformers.JambaConfig(vocab_size=50280, hidden_size=768, intermediate_size=768, num_hidden_layers=24,
                                    num_attention_heads=12, num_key_value_heads=4, num_experts=4,
                                    num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
                                    attn_layer_period=8, attn_layer_offset=4, mamba_d_state=16, mamba_d_conv=4,
                                    mamba_expand=2, tie_word_embeddings=False)


def qwen3_next_config(quick: bool) -> Any:
    import transformers

    if quick:
        return transformers.Qwen3NextConfig(vocab_size=1000, hidden_size=128, intermediate_size=128,
                                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                                            linear_key_head_dim=32, linear_value_head_dim=32, num_experts=4,
                                            num_experts_per_tok=2, moe_intermediate_size=128,
                                            shared_expert_intermediate_size=128, tie_word_embeddings=False)
    return transformers.Qwen3NextConfig(vocab_size=50280, hidden_size=768, intermediate_size=768, num_hidden_layers=24,
                                        num_attention_heads=6, num_key_value_heads=2, head_dim=128,
                                        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128,
                                        linear_value_head_dim=128, num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=768, shared_expert_intermediate_size=768,
                                        tie_word_embeddings=False)


MODELS = {"Jamba-like": ("JambaForCausalLM", jamba_config),
          "Qwen3-Next-like": ("Qwen3NextForCausalLM", qwen3_next_config)}


def saved_checkpoint(label: str, quick: bool, directory: Path) -> Any:
    """The transformers model of ``label``, seeded, saved into ``directory``; returns it (float32, eval)."""
    import torch
    import transformers

    class_name, config_of = MODELS[label]
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(config_of(quick)).eval()
    model.save_pretrained(directory)
    return model


def transformers_rate(hf: Any) -> Decoder:
    import torch

    def rate(n_seqs: int, n_tokens: int) -> float:
        import time

        prompt = torch.tensor([PROMPT] * n_seqs)
        with torch.inference_mode():
            start = time.perf_counter()
            hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n_tokens,
                        min_new_tokens=n_tokens, do_sample=False, pad_token_id=0)
            return n_seqs * n_tokens / (time.perf_counter() - start)
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_quick_option(parser, "4-layer models of n_embd 128, 4 tokens")
    parser.add_argument("--tokens", type=int, help="greedy tokens per sequence (default 32; 4 with --quick)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="sequences decoding together")
    parser.add_argument("--threads", type=int, default=THREADS,
                        help="llama.cpp's, torch's and the compiled products' threads (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every engine in turn; the best counts")
    options = parser.parse_args()
    if not torch_available():
        raise SystemExit("the models are built by transformers: pip install '.[test-torch]'")
    import transformers

    transformers.logging.set_verbosity_error()
    set_threads(options.threads)
    if options.quick:
        print(NOTE)
    n_tokens = options.tokens or (4 if options.quick else 32)
    load_before = os.getloadavg()
    lines = ["| model | engine | " + " | ".join(f"{b} seq tok/s | ×llama.cpp" for b in options.batches) + " |",
             "| --- | --- | " + " | ".join("---: | ---:" for _ in options.batches) + " |"]
    notes = []
    with tempfile.TemporaryDirectory() as tmp:
        for label in MODELS:
            directory = Path(tmp) / label
            hf = saved_checkpoint(label, options.quick, directory)
            model = load_hf(directory, dtype="float32")
            engines: dict[str, Decoder | str] = {}
            gguf_path = Path(tmp) / f"{label}.gguf"
            try:
                convert_hf_to_gguf(directory, gguf_path)
                engines["llama.cpp"] = llamacpp_decoder(gguf_path)
            except ModelError as exc:
                engines["llama.cpp"] = f"skipped: {exc}"
            engines["package, numpy"] = package_decoder(model, "numpy")   # type: ignore[arg-type]
            engines["package, torch CPU"] = package_decoder(model, "torch")   # type: ignore[arg-type]
            engines["package, torch CPU, torch's ops"] = package_decoder(model, "torch",  # type: ignore[arg-type]
                                                                         native=True)
            engines["transformers"] = transformers_rate(hf)
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
        RESULTS.write_text("# Hybrid model decode speed (python bench/hybrid_model_speed.py)\n\n" + report + "\n",
                           encoding="utf-8")


if __name__ == "__main__":
    main()
