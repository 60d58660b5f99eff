"""Train a byte-level Mamba-1 on the Python standard library's source and write it as GGUF.

A development tool, not part of the package's runtime: it needs JAX and optax
(``pip install '.[train]'``, or into a separate venv: ``pip install jax optax gguf
matplotlib``).  The model is llama.cpp's Mamba-1 (architecture ``mamba``) with a
vocabulary of 256: one token per byte, so there is no tokenizer.  The GGUF uses
llama.cpp's keys, tensor names and layouts; ``recurrent_cache.models.load_gguf``
loads it.

Data: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, except
``site-packages`` and test directories (``test``, ``tests``, ``idle_test``),
sorted by relative path.  The split is fixed: a file is held out when
``zlib.crc32(relative path) % 20 == 0`` (about 5% of the files), all others
are for training.  Training samples windows of ``--seq-len + 1`` bytes at
seeded random offsets of the concatenated training files (each file followed
by a blank line); the held-out bits per byte are measured on consecutive
windows of ``--eval-len`` bytes of the concatenated held-out files, each
window starting from a zero state.

Writes (``--out-dir``, default ``training-run/`` in the current directory):
``byte_mamba.gguf`` (2-D weights f16 as llama.cpp's ``--outtype f16``),
``byte_mamba.json`` (the command, the split, held-out bits per byte, demo
prompts from held-out files), ``train_log.txt``, ``loss.png`` (or ``--log-dir``)
and ``reference_logits.npz`` (or ``--reference-out``): the logits the trained
weights, as stored in the GGUF, give on a held-out snippet, which the
package's numpy forward must reproduce.  The shipped files (the package's
``models/data/byte_mamba.*``, ``tests/data/byte_mamba_reference.npz`` and the
log in ``tools/training/``) are written only with ``--overwrite-shipped``;
any other path into them is refused.

    python tools/train_byte_mamba.py                          # everything in ./training-run/
    python tools/train_byte_mamba.py --overwrite-shipped      # retrain the shipped model
    python tools/train_byte_mamba.py --tiny --steps 3 --out-dir /tmp/m   # smoke test, everything in /tmp/m
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import sysconfig
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_RUN = Path("training-run")   # relative: a run writes beside the user, never into the checkout by default
SHIPPED_MODEL = REPO / "src" / "recurrent_cache" / "models" / "data"
SHIPPED_LOG = REPO / "tools" / "training"
SHIPPED_REFERENCE = REPO / "tests" / "data" / "byte_mamba_reference.npz"
SHIPPED_DIRS = (SHIPPED_MODEL, SHIPPED_LOG, SHIPPED_REFERENCE.parent)
HELD_OUT_MODULUS = 20
SKIPPED_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
FILE_SEPARATOR = b"\n\n"
SNIPPET_LENGTH = 64    # bytes of the held-out snippet whose logits are recorded
PROMPT_LENGTH = 120    # bytes of each held-out file start kept as a demo prompt
N_PROMPTS = 12


# -- data -------------------------------------------------------------------------------


def stdlib_files(root: Path) -> list[str]:
    """Relative paths of the standard library's own source files, sorted."""
    found = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if SKIPPED_DIRS.isdisjoint(relative.parts[:-1]):
            found.append(relative.as_posix())
    return sorted(found)


def is_held_out(relative: str) -> bool:
    return zlib.crc32(relative.encode()) % HELD_OUT_MODULUS == 0


def read_corpus(root: Path, files: list[str]) -> np.ndarray:
    return np.frombuffer(b"".join((root / f).read_bytes() + FILE_SEPARATOR for f in files), dtype=np.uint8)


# -- the model (llama.cpp's build_mamba_layer, with a parallel scan over time) ------------


@dataclass(frozen=True)
class Config:
    n_embd: int = 128
    n_layer: int = 4
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    rms_eps: float = 1e-5

    @property
    def d_inner(self) -> int:
        return self.expand * self.n_embd

    @property
    def dt_rank(self) -> int:
        return -(self.n_embd // -16)


def init_params(cfg: Config, seed: int) -> dict:
    """mamba_ssm's initialisation (S4D-real A, dt log-uniform in [1e-3, 1e-1], D = 1)."""
    rng = np.random.default_rng(seed)
    d, e, n, r = cfg.d_inner, cfg.n_embd, cfg.d_state, cfg.dt_rank

    def uniform(bound: float, *shape: int) -> np.ndarray:
        return rng.uniform(-bound, bound, size=shape).astype(np.float32)

    layers = []
    for _ in range(cfg.n_layer):
        dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), size=d))
        layers.append({
            "attn_norm": np.ones(e, np.float32),
            "ssm_in": uniform(1 / math.sqrt(e), 2 * d, e),
            "ssm_conv1d": uniform(1 / math.sqrt(cfg.d_conv), d, cfg.d_conv),
            "ssm_conv1d_b": uniform(1 / math.sqrt(cfg.d_conv), d),
            "ssm_x": uniform(1 / math.sqrt(d), r + 2 * n, d),
            "ssm_dt": uniform(1 / math.sqrt(r), d, r),
            "ssm_dt_b": (dt + np.log(-np.expm1(-dt))).astype(np.float32),
            "a_log": np.log(np.tile(np.arange(1, n + 1, dtype=np.float32), (d, 1))),
            "ssm_d": np.ones(d, np.float32),
            "ssm_out": uniform(1 / math.sqrt(d), e, d) / math.sqrt(cfg.n_layer),
        })
    return {
        "token_embd": (0.02 * rng.standard_normal((256, e))).astype(np.float32),
        "layers": layers,
        "output_norm": np.ones(e, np.float32),
        "output": uniform(1 / math.sqrt(e), 256, e),
    }


def make_forward(cfg: Config):
    import jax
    import jax.numpy as jnp

    def rms_norm(v, weight):
        return v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + cfg.rms_eps) * weight

    def selective_scan(dt, xc, b, c, a):
        """y[t] = h[t] @ c[t], h[t] = h[t-1] * exp(dt[t] a) + (dt[t] xc[t]) b[t], from h = 0.

        A sequential ``lax.scan`` over time that builds each step's
        [batch, d_inner, d_state] values inside the step: on 2 CPU cores it
        measured 3.6x faster (forward + backward, 16 x 256 tokens, d_inner 256,
        d_state 16) than ``lax.associative_scan``, whose log2(T) passes move
        the whole [batch, T, d_inner, d_state] tensor through memory each time.
        """
        def step(h, inputs):
            dt_t, xc_t, b_t, c_t = inputs
            h = h * jnp.exp(dt_t[..., None] * a) + (dt_t * xc_t)[..., None] * b_t[:, None, :]
            return h, jnp.einsum("bdn,bn->bd", h, c_t)

        h0 = jnp.zeros((dt.shape[0], cfg.d_inner, cfg.d_state), dt.dtype)
        _, y = jax.lax.scan(step, h0, tuple(v.swapaxes(0, 1) for v in (dt, xc, b, c)), unroll=8)
        return y.swapaxes(0, 1)

    def mixer(p, u):
        n_tokens = u.shape[1]
        d, n, r = cfg.d_inner, cfg.d_state, cfg.dt_rank
        xz = u @ p["ssm_in"].T
        x, z = xz[..., :d], xz[..., d:]
        padded = jnp.pad(x, ((0, 0), (cfg.d_conv - 1, 0), (0, 0)))  # window: oldest input first
        xc = sum(padded[:, k:k + n_tokens] * p["ssm_conv1d"][:, k] for k in range(cfg.d_conv))
        xc = jax.nn.silu(xc + p["ssm_conv1d_b"])
        dbc = xc @ p["ssm_x"].T
        dt = jax.nn.softplus(dbc[..., :r] @ p["ssm_dt"].T + p["ssm_dt_b"])
        b, c = dbc[..., r:r + n], dbc[..., r + n:]
        y = selective_scan(dt, xc, b, c, -jnp.exp(p["a_log"])) + xc * p["ssm_d"]
        return (y * jax.nn.silu(z)) @ p["ssm_out"].T

    def forward(params, tokens):
        x = params["token_embd"][tokens]
        for p in params["layers"]:
            x = x + mixer(p, rms_norm(x, p["attn_norm"]))
        return rms_norm(x, params["output_norm"]) @ params["output"].T

    return forward


def cross_entropy(logits, targets):
    import jax
    import jax.numpy as jnp

    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


# -- GGUF -------------------------------------------------------------------------------

# Field -> llama.cpp tensor name (``blk.N.`` prefix for layers).
LAYER_TENSORS = {
    "attn_norm": "attn_norm.weight", "ssm_in": "ssm_in.weight", "ssm_conv1d": "ssm_conv1d.weight",
    "ssm_conv1d_b": "ssm_conv1d.bias", "ssm_x": "ssm_x.weight", "ssm_dt": "ssm_dt.weight",
    "ssm_dt_b": "ssm_dt.bias", "ssm_a": "ssm_a", "ssm_d": "ssm_d", "ssm_out": "ssm_out.weight",
}


def stored_tensors(params: dict, half: bool = True) -> dict[str, np.ndarray]:
    """The tensors as the GGUF stores them: llama.cpp's names, ssm_a = -exp(A_log), f16 where
    llama.cpp's converter writes f16 (2-D ``.weight`` tensors except ssm_conv1d)."""
    named = {"token_embd.weight": params["token_embd"], "output_norm.weight": params["output_norm"],
             "output.weight": params["output"]}
    for il, layer in enumerate(params["layers"]):
        fields = dict(layer, ssm_a=-np.exp(np.asarray(layer["a_log"], np.float64)))
        for field, suffix in LAYER_TENSORS.items():
            named[f"blk.{il}.{suffix}"] = fields[field]
    stored = {}
    for name, array in named.items():
        array = np.asarray(array, dtype=np.float32)
        as_f16 = half and array.ndim == 2 and name.endswith(".weight") and ".ssm_conv1d." not in name
        stored[name] = array.astype(np.float16) if as_f16 else array
    return stored


def params_as_stored(params: dict, stored: dict[str, np.ndarray]) -> dict:
    """``params`` with every weight replaced by its stored (possibly f16-rounded) value."""
    def get(name: str) -> np.ndarray:
        return stored[name].astype(np.float32)

    layers = []
    for il in range(len(params["layers"])):
        layer = {field: get(f"blk.{il}.{suffix}") for field, suffix in LAYER_TENSORS.items() if field != "ssm_a"}
        layer["a_log"] = np.log(-stored[f"blk.{il}.ssm_a"].astype(np.float64)).astype(np.float32)
        layers.append(layer)
    return {"token_embd": get("token_embd.weight"), "layers": layers,
            "output_norm": get("output_norm.weight"), "output": get("output.weight")}


def write_gguf(path: Path, cfg: Config, stored: dict[str, np.ndarray], name: str) -> None:
    import gguf

    writer = gguf.GGUFWriter(os.fspath(path), "mamba")
    writer.add_name(name)
    writer.add_context_length(2**20)   # llama.cpp's converter's placeholder: no context limit
    writer.add_embedding_length(cfg.n_embd)
    writer.add_feed_forward_length(0)  # unused by Mamba, required by llama.cpp
    writer.add_head_count(0)
    writer.add_block_count(cfg.n_layer)
    writer.add_ssm_conv_kernel(cfg.d_conv)
    writer.add_ssm_inner_size(cfg.d_inner)
    writer.add_ssm_state_size(cfg.d_state)
    writer.add_ssm_time_step_rank(cfg.dt_rank)
    writer.add_layer_norm_rms_eps(cfg.rms_eps)
    writer.add_ssm_dt_b_c_rms(False)
    writer.add_vocab_size(256)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tokenizer_model("no_vocab")  # token id = byte value
    for tensor_name, array in stored.items():
        writer.add_tensor(tensor_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# -- training ---------------------------------------------------------------------------


def refuse(message: str) -> NoReturn:
    """Stop before anything is written, with one line on stderr."""
    raise SystemExit(f"tools/train_byte_mamba.py: {message}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-state", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--eval-len", type=int, default=1024, help="bytes per held-out window")
    parser.add_argument("--eval-windows", type=int, default=16, help="held-out windows during training")
    parser.add_argument("--final-eval-windows", type=int, default=256, help="held-out windows at the end")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and data for a smoke test")
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--out-dir", type=Path,
                        help=f"where the GGUF, its JSON, the log and the reference go (default: ./{DEFAULT_RUN})")
    parser.add_argument("--log-dir", type=Path, help="the log and loss curve (default: --out-dir)")
    parser.add_argument("--reference-out", type=Path,
                        help="the held-out snippet's logits (default: reference_logits.npz in --out-dir)")
    parser.add_argument("--params-out", type=Path, help="also save the trained float32 parameters (npz)")
    parser.add_argument("--overwrite-shipped", action="store_true",
                        help="retrain the shipped model: replace the package's models/data/byte_mamba.*, "
                             "tests/data/byte_mamba_reference.npz and the log in tools/training/")
    options = parser.parse_args(argv)
    if options.overwrite_shipped:
        chosen = [flag for flag, value in (("--out-dir", options.out_dir), ("--log-dir", options.log_dir),
                                           ("--reference-out", options.reference_out), ("--tiny", options.tiny))
                  if value]
        if chosen:
            refuse(f"--overwrite-shipped writes the shipped files where they belong; it takes no {chosen[0]}")
        options.out_dir, options.log_dir, options.reference_out = SHIPPED_MODEL, SHIPPED_LOG, SHIPPED_REFERENCE
    else:
        options.out_dir = options.out_dir or DEFAULT_RUN
        options.log_dir = options.log_dir or options.out_dir
        options.reference_out = options.reference_out or options.out_dir / "reference_logits.npz"
        for flag, path in (("--out-dir", options.out_dir), ("--log-dir", options.log_dir),
                           ("--reference-out", options.reference_out), ("--params-out", options.params_out)):
            if path is not None and any(path.resolve().is_relative_to(shipped) for shipped in SHIPPED_DIRS):
                refuse(f"{flag} {path} is among the shipped files; pass --overwrite-shipped to replace them")
    if options.tiny:
        options.n_embd, options.n_layer, options.d_state = 16, 1, 4
        options.batch, options.seq_len, options.eval_len = 2, 32, 64
        options.eval_windows = options.final_eval_windows = 2
    return options


def main(argv: list[str] | None = None) -> int:
    options = parse_args(sys.argv[1:] if argv is None else argv)
    import jax
    import jax.numpy as jnp
    import optax

    started = time.time()
    command = "python tools/train_byte_mamba.py " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv))
    files = stdlib_files(options.stdlib)
    train_files = [f for f in files if not is_held_out(f)]
    held_files = [f for f in files if is_held_out(f)]
    if options.tiny:
        train_files, held_files = train_files[:20], held_files[:4]
    train = read_corpus(options.stdlib, train_files)
    held = read_corpus(options.stdlib, held_files)

    cfg = Config(n_embd=options.n_embd, n_layer=options.n_layer, d_state=options.d_state)
    forward = make_forward(cfg)
    params = jax.tree_util.tree_map(jnp.asarray, init_params(cfg, options.seed))
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(params))

    warmup = min(options.warmup, options.steps // 2)
    schedule = optax.warmup_cosine_decay_schedule(0.0, options.lr, warmup, max(options.steps, warmup + 1),
                                                  end_value=options.lr / 10)
    decayed = jax.tree_util.tree_map(lambda a: a.ndim == 2, params)
    decayed["layers"] = [dict(layer, a_log=False) for layer in decayed["layers"]]
    optimiser = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=options.weight_decay,
                                        mask=decayed))
    opt_state = optimiser.init(params)

    def loss_fn(p, window):
        return cross_entropy(forward(p, window[:, :-1]), window[:, 1:])

    @jax.jit
    def train_step(p, state, window):
        loss, grads = jax.value_and_grad(loss_fn)(p, window)
        updates, state = optimiser.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    @jax.jit
    def eval_loss(p, window):
        return loss_fn(p, window)

    n_eval_all = max(1, (len(held) - 1) // options.eval_len)

    def held_out_bpb(p, n_windows: int) -> float:
        """Mean bits per byte over the first ``n_windows`` held-out windows, 8 at a time."""
        n_windows = min(n_windows, n_eval_all)
        starts = np.arange(n_windows) * options.eval_len
        total = 0.0
        for k in range(0, n_windows, 8):
            chunk = starts[k:k + 8]
            windows = np.stack([held[s:s + options.eval_len + 1] for s in chunk]).astype(np.int32)
            total += float(eval_loss(p, windows)) * len(chunk)
        return total / n_windows / math.log(2)

    options.log_dir.mkdir(parents=True, exist_ok=True)
    options.out_dir.mkdir(parents=True, exist_ok=True)
    options.reference_out.parent.mkdir(parents=True, exist_ok=True)
    log_path = options.log_dir / "train_log.txt"
    log = log_path.open("w")

    def say(line: str) -> None:
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    say(f"command: {command}")
    say(f"jax {jax.__version__}, optax {optax.__version__}, devices {jax.devices()}, python {sys.version.split()[0]}")
    say(f"stdlib {options.stdlib}: {len(train_files)} training files ({len(train):,} bytes), "
        f"{len(held_files)} held-out files ({len(held):,} bytes)")
    say(f"model: {asdict(cfg)} d_inner {cfg.d_inner} dt_rank {cfg.dt_rank}, {n_params:,} parameters")
    say(f"training: {options.steps} steps x {options.batch} x {options.seq_len} bytes, lr {options.lr}, "
        f"seed {options.seed}")

    rng = np.random.default_rng(options.seed)
    history: list[tuple[int, int, float, float | None]] = []   # step, tokens, train loss (bpb), held-out bpb
    tokens_per_step = options.batch * options.seq_len
    window_loss = []
    for step in range(1, options.steps + 1):
        starts = rng.integers(0, len(train) - options.seq_len - 1, size=options.batch)
        windows = np.stack([train[s:s + options.seq_len + 1] for s in starts]).astype(np.int32)
        params, opt_state, loss = train_step(params, opt_state, windows)
        window_loss.append(loss)
        if step % options.eval_every == 0 or step == options.steps or step == 1:
            train_bpb = float(np.mean([float(v) for v in window_loss])) / math.log(2)
            window_loss = []
            held_bpb = held_out_bpb(params, options.eval_windows)
            history.append((step, step * tokens_per_step, train_bpb, held_bpb))
            say(f"step {step:>6}  tokens {step * tokens_per_step:>11,}  train {train_bpb:.3f} bpb  "
                f"held-out {held_bpb:.3f} bpb  lr {float(schedule(step)):.2e}  {time.time() - started:7.0f} s")

    params = jax.tree_util.tree_map(np.asarray, params)
    stored = stored_tensors(params)
    if options.params_out:  # full precision, for experiments; the GGUF holds the f16 weights
        np.savez(options.params_out, **stored_tensors(params, half=False))
    as_stored = jax.tree_util.tree_map(jnp.asarray, params_as_stored(params, stored))
    final_bpb = held_out_bpb(as_stored, options.final_eval_windows)
    n_final = min(options.final_eval_windows, n_eval_all)
    say(f"final: held-out {final_bpb:.4f} bits per byte over {n_final} windows of {options.eval_len} bytes "
        f"({n_final * options.eval_len:,} bytes), weights as stored in the GGUF (f16)")

    gguf_path = options.out_dir / "byte_mamba.gguf"
    write_gguf(gguf_path, cfg, stored, "recurrent-cache-byte-mamba")

    # The reference the package's numpy forward must reproduce: logits of a held-out snippet.
    snippet_file = next(f for f in held_files if (options.stdlib / f).stat().st_size >= SNIPPET_LENGTH)
    snippet = np.frombuffer((options.stdlib / snippet_file).read_bytes()[:SNIPPET_LENGTH], np.uint8)
    snippet_logits = np.asarray(forward(as_stored, jnp.asarray(snippet[None].astype(np.int32))))[0]
    np.savez_compressed(options.reference_out, tokens=snippet, logits=snippet_logits)

    prompts = []
    for f in held_files:
        text = (options.stdlib / f).read_bytes()[:PROMPT_LENGTH]
        if len(text) == PROMPT_LENGTH and len(prompts) < N_PROMPTS:
            prompts.append({"file": f, "text": text.decode("utf-8", "replace")})
    seconds = time.time() - started
    facts = {
        "command": command,
        "python": sys.version.split()[0],
        "config": asdict(cfg) | {"d_inner": cfg.d_inner, "dt_rank": cfg.dt_rank, "parameters": n_params},
        "split": f"*.py under sysconfig stdlib without {sorted(SKIPPED_DIRS)}; held out when "
                 f"zlib.crc32(relative path) % {HELD_OUT_MODULUS} == 0",
        "train_files": len(train_files), "train_bytes": int(len(train)),
        "held_out_files": held_files, "held_out_bytes": int(len(held)),
        "held_out_bits_per_byte": round(final_bpb, 4),
        "held_out_eval": f"{n_final} windows of {options.eval_len} bytes, each from a zero state",
        "tokens_seen": options.steps * tokens_per_step,
        "seconds": round(seconds),
        "snippet_file": snippet_file,
        "prompts": prompts,
    }
    (options.out_dir / "byte_mamba.json").write_text(json.dumps(facts, indent=1) + "\n")
    say(f"wrote {gguf_path} ({gguf_path.stat().st_size:,} bytes) in {seconds:.0f} s, "
        f"{options.steps * tokens_per_step:,} tokens seen")
    log.close()
    plot(history, options.log_dir / "loss.png", final_bpb)
    return 0


def plot(history: list, path: Path, final_bpb: float) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss.png", file=sys.stderr)
        return
    tokens = [h[1] / 1e6 for h in history]
    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot(tokens, [h[2] for h in history], label="training (mean since last point)")
    axes.plot(tokens, [h[3] for h in history], label="held-out", marker="o", markersize=3)
    axes.axhline(final_bpb, color="gray", linestyle=":", label=f"final held-out {final_bpb:.3f}")
    axes.set_xlabel("bytes seen (millions)")
    axes.set_ylabel("bits per byte")
    axes.set_ylim(bottom=0)
    axes.set_title("byte-level Mamba on the Python standard library")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
