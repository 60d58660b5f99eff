"""Benchmark of the prefix-state cache (``rc.PrefixCache``, SPEC §8).

    python bench/prefix_cache.py            # ~1 min on 2 cores
    python bench/prefix_cache.py --quick    # a shorter trace and fewer sizes

Three parts, one run:

1. **Prefill recomputed** on a trace of requests that share system prompts,
   continue multi-turn conversations, or are unique, as a fraction of all
   prompt tokens, at equal ``max_bytes`` (counted in snapshots).  PrefixCache
   runs for real (a one-layer cache with tiny rows: the benchmark measures
   which prefixes are reusable, not the model), next to simulations of the
   anchors' policies on the same trace:
   - *no cache*: every prompt token is computed;
   - *leaf-only* (SGLang's Mamba radix cache): a state only at the end of each
     request (prompt + reply); a state whose key a later request extends is
     an inner node of the radix tree and is dropped; LRU;
   - *block grid* (vLLM): a state at every multiple of ``block_size`` of
     prompt + reply; a hit touches the states along its path; LRU;
   - *whole-prompt LRU* (MLX-LM): one state per request, prompt + reply, LRU.
   Every policy restores the longest held proper prefix of a prompt.
2. **Lookup cost**: ``match`` + ``plan`` and ``restore`` per request as the
   prompt length and the number of held snapshots grow.
3. **Restore bandwidth**: ``restore`` of a Mamba-sized snapshot vs numpy
   copying the same rows between the same arrays.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

try:
    import recurrent_cache as rc
except ImportError:  # run from a source tree without an install
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
    import recurrent_cache as rc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the repository root, for bench.quick
from bench.quick import NOTE, add_quick_option  # noqa: E402

VOCAB = 32000


# -- the trace ---------------------------------------------------------------------------


@dataclass
class Request:
    prompt: np.ndarray   # int32 tokens
    reply: np.ndarray    # the tokens generated for it
    kind: str            # "system" (new conversation on a shared system prompt), "turn", "unique"


def make_trace(n_requests: int, seed: int = 0) -> list[Request]:
    """Shared system prompts, multi-turn conversations and unique prompts, interleaved.

    6 system prompts of 300-1500 tokens, chosen with Zipf-like popularity; a
    new conversation is a system prompt + 30-400 user tokens; 45% of the
    requests continue an open conversation (its previous prompt + reply +
    20-200 new user tokens; a conversation closes after a turn with p = 0.3);
    a quarter of the new requests are unique prompts of 100-2000 tokens.
    Replies are 20-300 tokens.  At most 24 conversations are open at once.
    """
    rng = np.random.default_rng(seed)

    def text(low: int, high: int) -> np.ndarray:
        return rng.integers(0, VOCAB, int(rng.integers(low, high + 1)), dtype=np.int32)

    systems = [text(300, 1500) for _ in range(6)]
    popularity = 1.0 / np.arange(1, len(systems) + 1)
    popularity /= popularity.sum()
    open_conversations: list[np.ndarray] = []  # the text so far of each open conversation
    trace = []
    for _ in range(n_requests):
        if open_conversations and rng.random() < 0.45:
            k = int(rng.integers(len(open_conversations)))
            prompt = np.concatenate([open_conversations[k], text(20, 200)])
            kind = "turn"
        elif rng.random() < 0.75:
            k = -1
            prompt = np.concatenate([systems[rng.choice(len(systems), p=popularity)], text(30, 400)])
            kind = "system"
        else:
            k = -1
            prompt = text(100, 2000)
            kind = "unique"
        reply = text(20, 300)
        trace.append(Request(prompt, reply, kind))
        history = np.concatenate([prompt, reply])
        if kind == "turn":
            if rng.random() < 0.3:
                open_conversations.pop(k)
            else:
                open_conversations[k] = history
        elif kind == "system":
            open_conversations.append(history)
            if len(open_conversations) > 24:
                open_conversations.pop(0)
    return trace


# -- the policies ------------------------------------------------------------------------


class KeyLRU:
    """An LRU set of token keys (bytes) with longest-proper-prefix lookup."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[bytes, None] = OrderedDict()
        self.lengths: dict[int, int] = {}   # key length in tokens -> keys of that length

    def longest(self, data: bytes, n_tokens: int, lengths=None) -> int:
        for n in sorted(self.lengths if lengths is None else lengths, reverse=True):
            if n < n_tokens and data[:4 * n] in self.keys:
                return n
        return 0

    def touch(self, key: bytes) -> None:
        self.keys.move_to_end(key)

    def add(self, key: bytes) -> None:
        if self.capacity == 0:
            return
        if key in self.keys:
            self.keys.move_to_end(key)
            return
        if len(self.keys) >= self.capacity:
            self.discard(next(iter(self.keys)))
        self.keys[key] = None
        n = len(key) // 4
        self.lengths[n] = self.lengths.get(n, 0) + 1

    def discard(self, key: bytes) -> None:
        if key in self.keys:
            del self.keys[key]
            n = len(key) // 4
            self.lengths[n] -= 1
            if not self.lengths[n]:
                del self.lengths[n]


def run_no_cache(trace: list[Request], capacity: int, block_size: int) -> int:
    return sum(len(r.prompt) for r in trace)


def run_whole_prompt(trace: list[Request], capacity: int, block_size: int) -> int:
    held = KeyLRU(capacity)
    recomputed = 0
    for r in trace:
        data = r.prompt.tobytes()
        n = held.longest(data, len(r.prompt))
        if n:
            held.touch(data[:4 * n])
        recomputed += len(r.prompt) - n
        held.add(data + r.reply.tobytes())
    return recomputed


def run_leaf_only(trace: list[Request], capacity: int, block_size: int) -> int:
    held = KeyLRU(capacity)
    recomputed = 0
    for r in trace:
        data = r.prompt.tobytes()
        n = held.longest(data, len(r.prompt))
        recomputed += len(r.prompt) - n
        # this request's path passes through every held key that is a prefix of it: those
        # become inner nodes of the radix tree, which keeps no state
        for m in list(held.lengths):
            if m <= len(r.prompt):
                held.discard(data[:4 * m])
        held.add(data + r.reply.tobytes())
    return recomputed


def run_block_grid(trace: list[Request], capacity: int, block_size: int) -> int:
    held = KeyLRU(capacity)
    recomputed = 0
    for r in trace:
        data = r.prompt.tobytes()
        n_tokens = len(r.prompt)
        grid = range(block_size, n_tokens, block_size)
        n = held.longest(data, n_tokens, grid)
        for m in range(block_size, n + 1, block_size):  # a hit touches the blocks of its path
            if data[:4 * m] in held.keys:
                held.touch(data[:4 * m])
        recomputed += n_tokens - n
        whole = data + r.reply.tobytes()
        for m in range(block_size, len(whole) // 4 + 1, block_size):
            held.add(whole[:4 * m])
    return recomputed


def run_prefix_cache(trace: list[Request], capacity: int, block_size: int) -> int:
    """The real PrefixCache on a one-layer cache of 1-float rows, following ``plan``."""
    cache = rc.RecurrentCache(1, 1, 1, n_seq_max=1)
    pc = rc.PrefixCache(cache, capacity * 8, block_size=block_size)

    def advance(tokens: np.ndarray, start: int, end: int) -> None:
        # stands in for the model's prefill: the cell's position moves on (its rows are not read)
        for _ in cache.init_batch(rc.Batch(token=tokens[start:end], pos=np.arange(start, end, dtype=np.int32),
                                           seq_id=np.zeros(end - start, np.int32)), 4096):
            pass

    for r in trace:
        cache.seq_rm(0, -1, -1)
        n = pc.restore(0, r.prompt)
        for cut in pc.plan(r.prompt, n):
            advance(r.prompt, n, cut)
            pc.save(0, r.prompt[:cut])
            n = cut
        whole = np.concatenate([r.prompt, r.reply])
        advance(whole, len(r.prompt), len(whole))
        pc.save(0, whole)
    return pc.stats()["tokens_recomputed"]


POLICIES = {
    "no cache": run_no_cache,
    "leaf-only": run_leaf_only,
    "block grid": run_block_grid,
    "whole-prompt LRU": run_whole_prompt,
    "PrefixCache": run_prefix_cache,
}


def recompute_table(trace: list[Request], budgets: list[int], block_size: int) -> bool:
    total = sum(len(r.prompt) for r in trace)
    kinds = {k: sum(r.kind == k for r in trace) for k in ("system", "turn", "unique")}
    print(f"## Prefill recomputed (fraction of {total:,} prompt tokens; {len(trace)} requests: "
          f"{kinds['system']} new on a system prompt, {kinds['turn']} conversation turns, "
          f"{kinds['unique']} unique; block_size {block_size})\n")
    print("| max_bytes (snapshots) | " + " | ".join(POLICIES) + " | best anchor / PrefixCache |")
    print("|---:|" + "---:|" * (len(POLICIES) + 1))
    never_worse, strictly_better = True, {name: False for name in POLICIES if name != "PrefixCache"}
    for budget in budgets:
        results = {name: run(trace, budget, block_size) for name, run in POLICIES.items()}
        ours = results["PrefixCache"]
        anchors = {name: v for name, v in results.items() if name != "PrefixCache"}
        best = min(anchors.values())
        never_worse &= ours <= best
        for name, v in anchors.items():
            strictly_better[name] |= ours < v
        cells = " | ".join(f"{v / total:.3f}" for v in results.values())
        print(f"| {budget} | {cells} | {best / max(ours, 1):.2f}x |")
    print()
    verdict = never_worse and all(strictly_better.values())
    print(f"PrefixCache recomputes no more than the best anchor at every budget: {'PASS' if never_worse else 'FAIL'}; "
          f"strictly less than each anchor at some budget: "
          f"{'PASS' if all(strictly_better.values()) else 'FAIL ' + str(strictly_better)}\n")
    return verdict


# -- lookup cost ---------------------------------------------------------------------------


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def lookup_table(lengths: list[int], counts: list[int], block_size: int) -> bool:
    """match + plan and restore for a prompt of L tokens with N snapshots held along its path.

    The N snapshots are prefixes of the prompt (its grid points) and branches
    off it at random lengths (each the prompt's prefix + 8 tokens of its
    own): the worst case for the lookup, which walks the prompt's path.
    """
    print("## Lookup cost per request (µs, best of 20)\n")
    print("| prompt tokens | snapshots held | match + plan | match + plan, nothing memoised "
          "| restore (seq_rm + restore) |")
    print("|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(1)
    ok = True
    for count in counts:
        for length in lengths:
            cache = rc.RecurrentCache(1, 1, 1, n_seq_max=1)
            pc = rc.PrefixCache(cache, (count + 8) * 8, block_size=block_size)
            prompt = rng.integers(0, VOCAB, length, dtype=np.int32)
            keys = [prompt[:m] for m in range(block_size, length, block_size)][:count]
            while len(keys) < count:
                cut = int(rng.integers(1, length))
                keys.append(np.concatenate([prompt[:cut], rng.integers(0, VOCAB, 8, dtype=np.int32)]))
            for key in keys:
                cache.seq_rm(0, -1, -1)
                cache.seq_restore(0, len(key) - 1, [t[0] for t in cache.r], [t[0] for t in cache.s])
                pc.save(0, key)
            assert len(pc) == count, (len(pc), count)

            def lookup() -> None:
                pc.match(prompt)
                pc.plan(prompt, 0)

            def restore() -> None:
                cache.seq_rm(0, -1, -1)
                pc.restore(0, prompt)

            path = pc._walk(prompt.tobytes(), length)   # noqa: SLF001 - times the trie walk plan memoises

            def cold_lookup() -> None:
                for node in path:   # forget what plan memoised along the path: as for a new prompt
                    node.branch_memo = (-1, [])
                lookup()

            t_cold = best_of(cold_lookup, 20)
            t_lookup = best_of(lookup, 20)
            t_restore = best_of(restore, 20)
            if length == max(lengths) and count == max(counts):
                ok = max(t_lookup, t_cold) < 1e-3
            print(f"| {length:,} | {count:,} | {t_lookup * 1e6:.0f} | {t_cold * 1e6:.0f} | {t_restore * 1e6:.0f} |")
    print(f"\nmatch + plan of a {max(lengths):,}-token prompt with {max(counts):,} snapshots under 1 ms: "
          f"{'PASS' if ok else 'FAIL'}\n")
    return ok


# -- restore bandwidth -----------------------------------------------------------------------


def bandwidth_table(shapes: dict[str, tuple[int, int, int]], rounds: int) -> bool:
    """restore vs numpy copying the same rows (pool row -> cache row, every layer's r and s)."""
    print(f"## Restore bandwidth (median of {rounds} interleaved rounds)\n")
    print("| snapshot | MiB | restore GB/s | numpy copy GB/s | restore / numpy |")
    print("|---|---:|---:|---:|---:|")
    ok = True
    for name, (n_layer, n_embd_r, n_embd_s) in shapes.items():
        cache = rc.RecurrentCache(n_layer, n_embd_r, n_embd_s, n_seq_max=2)
        rng = np.random.default_rng(2)
        for il in range(n_layer):
            cache.r[il][...] = rng.standard_normal(cache.r[il].shape)
            cache.s[il][...] = rng.standard_normal(cache.s[il].shape)
        pc = rc.PrefixCache(cache, n_layer * (n_embd_r + n_embd_s) * 4, block_size=16)
        assert pc.capacity == 1
        tokens = np.arange(100, dtype=np.int32)
        cache.seq_restore(0, 49, [t[1] for t in cache.r], [t[1] for t in cache.s])
        pc.save(0, tokens[:50])
        nbytes = pc.snapshot_bytes
        row = cache.cell(0)[2]
        other = 1 - row
        held_r, held_s = cache.seq_state(0)   # rows of the snapshot's shape, as restore copies them

        def restore() -> None:
            cache.seq_rm(1, -1, -1)
            pc.restore(1, tokens)

        # the baseline: the same rows between the same arrays, views prepared outside the clock
        targets = [cache.r[il][other] for il in range(n_layer)] + [cache.s[il][other] for il in range(n_layer)]
        sources = held_r + held_s

        def numpy_copy() -> None:
            cache.seq_rm(1, -1, -1)
            for target, source in zip(targets, sources):
                np.copyto(target, source)

        ours, base = [], []
        for _ in range(rounds):
            ours.append(best_of(restore, 5))
            base.append(best_of(numpy_copy, 5))
        cache.seq_rm(1, -1, -1)
        assert pc.restore(1, tokens) == 50 and cache.cell(1)[2] == other
        assert all(np.array_equal(cache.s[il][other], cache.s[il][row]) for il in range(n_layer))
        t_ours, t_base = float(np.median(ours)), float(np.median(base))
        ratio = t_base / t_ours
        ok &= ratio >= 0.8
        print(f"| {name} ({n_layer} layers, r {n_embd_r}, s {n_embd_s}, f32) | {nbytes / 2**20:.1f} | "
              f"{nbytes / t_ours / 1e9:.2f} | {nbytes / t_base / 1e9:.2f} | {ratio:.2f}x |")
    print(f"\nrestore at >= 0.8x a numpy copy of the same bytes: {'PASS' if ok else 'FAIL'}\n")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_quick_option(parser, "a shorter trace, fewer sizes, no PASS / FAIL decided")
    parser.add_argument("--requests", type=int, help="requests in the trace (default 600; 200 with --quick)")
    parser.add_argument("--block-size", type=int, default=256)
    options = parser.parse_args(argv)
    if options.quick:
        print(NOTE + "\n")
    n_requests = options.requests or (200 if options.quick else 600)
    trace = make_trace(n_requests)
    print(f"# PrefixCache benchmark ({'quick' if options.quick else 'full'} run, load average "
          f"{os.getloadavg()[0]:.2f})\n")
    budgets = [2, 8, 32, 128] if options.quick else [2, 4, 8, 16, 32, 64, 128, 256, 512]
    ok = recompute_table(trace, budgets, options.block_size)
    lengths = [1024, 32768] if options.quick else [1024, 4096, 32768]
    counts = [100, 10000] if options.quick else [100, 1000, 10000]
    ok &= lookup_table(lengths, counts, options.block_size)
    shapes = {"mamba-130m": (24, 3 * 1536, 16 * 1536)}
    if not options.quick:
        shapes["mamba-1.4b"] = (48, 3 * 4096, 16 * 4096)
    ok &= bandwidth_table(shapes, 3 if options.quick else 7)
    return 0 if ok or options.quick else 1   # a quick run's figures decide nothing


if __name__ == "__main__":
    sys.exit(main())
