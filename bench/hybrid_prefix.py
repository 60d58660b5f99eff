"""Prefix reuse on a hybrid model: prompt tokens recomputed, HybridPrefixCache next to vLLM's block-aligned
policy and llama.cpp's context checkpoints, at equal memory.

    python bench/hybrid_prefix.py            # about a minute on 2 cores
    python bench/hybrid_prefix.py --quick

The memory of a hybrid prefix has two prices: its KV rows cost per token, its recurrent state the
same at any length.  Their ratio is the model's: here one state costs as much as ``RATIO`` tokens of
KV (Granite-4.0-H-Tiny: 36 Mamba-2 layers of (d_inner 3072 x d_state 128 + conv 3 x 3328) f32 ≈
56 MiB a state; 4 attention layers of 4 KV heads x 128, K and V f16 ≈ 8 KiB a token: ≈ 7,000).
Budgets are counted in states.

Two traces: the demo's conversations (``python -m recurrent_cache demo --prefix-cache``: 8 clients,
two system prompts of 48-96 tokens, 3 turns of 4-16 user tokens, 32-token replies) and a multi-turn
trace (``conversations``: 24 conversations on 4 system prompts of 300-1500 tokens, 4-8 turns of
20-200 user tokens and 20-300 reply tokens, interleaved).  Each request's prompt is everything said
so far; after it the model has computed the prompt and its reply but the last token.

- **HybridPrefixCache** runs for real (a hybrid memory of tiny rows of the model's byte ratio): it
  keeps a prefix at the end of the system prompt, of every prompt and of every reply, and restores
  the longest one a prompt begins with.
- **vLLM** (simulated; block sizes 16, 64 and 528, the size its hybrids force): KV blocks of the
  computed text and a recurrent state at every block boundary of it; a prompt reuses the longest
  block-aligned prefix (shorter than the prompt) whose blocks and state are held; LRU over both.
- **llama.cpp** (simulated server): slots, each holding one conversation's context (its KV and the
  recurrent state at its end) and up to 8 context checkpoints (a recurrent state at the end of each
  prompt it processed); as many slots as the budget holds at the trace's longest context; a prompt
  goes to the slot sharing most of it (else the least recently used), reuses the whole context if
  it continues it exactly, else the last checkpoint within the shared part, else nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):   # run as a script: the repository root on the path, for bench.quick
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import numpy as np  # noqa: E402

from bench.quick import NOTE, add_quick_option  # noqa: E402
from recurrent_cache import Batch, HybridCache, HybridPrefixCache  # noqa: E402
from recurrent_cache.cli.demo_prefix import make_conversations  # noqa: E402

RATIO = 7000          # KV tokens per recurrent state, in bytes
DEMO_REPLY = 32
CHECKPOINTS = 8       # llama.cpp server's context checkpoints per slot
RESULTS = Path(__file__).resolve().parent / "results" / "hybrid_prefix.md"


@dataclass
class Request:
    conversation: int
    prompt: list[int]
    reply: list[int]
    system: int        # where the system prompt ends


def demo_trace(seed: int = 0) -> list[Request]:
    """The demo's conversations, turn by turn, clients taking turns."""
    users = make_conversations(argparse.Namespace(seed=seed, clients=8), 1000)
    rng = np.random.default_rng(seed)

    def system_length(client: int) -> int:
        """The demo's system prompt of a client: what its first turn shares with another client's."""
        mine = users[client][0]
        other = users[(client + 2) % len(users)][0]
        n = min(len(mine), len(other))
        differ = np.flatnonzero(np.asarray(mine[:n]) != np.asarray(other[:n]))
        return int(differ[0]) if differ.size else n

    said = [[] for _ in users]
    trace = []
    for turn in range(len(users[0])):
        for client, turns in enumerate(users):
            prompt = said[client] + turns[turn]
            reply = rng.integers(0, 1000, DEMO_REPLY).tolist()
            trace.append(Request(client, prompt, reply, system_length(client)))
            said[client] = prompt + reply
    return trace


def conversations(n: int, seed: int = 0) -> list[Request]:
    """``n`` multi-turn conversations on 4 shared system prompts, their turns interleaved."""
    rng = np.random.default_rng(seed)

    def text(low: int, high: int) -> list[int]:
        return rng.integers(0, 32000, int(rng.integers(low, high + 1))).tolist()

    systems = [text(300, 1500) for _ in range(4)]
    pending = []
    for c in range(n):
        system = systems[int(rng.integers(len(systems)))]
        pending.append([c, system, [(text(20, 200), text(20, 300)) for _ in range(int(rng.integers(4, 9)))], 0])
    trace = []
    said = {c: list(system) for c, system, _, _ in pending}
    while pending:
        k = int(rng.integers(len(pending)))
        c, system, turns, t = pending[k]
        user, reply = turns[t]
        prompt = said[c] + user
        trace.append(Request(c, prompt, reply, len(system)))
        said[c] = prompt + reply
        pending[k][3] += 1
        if pending[k][3] == len(turns):
            pending.pop(k)
    return trace


def computed(request: Request) -> list[int]:
    """What the model computed for a request: its prompt and its reply but the last token."""
    return request.prompt + request.reply[:-1]


# -- the package ----------------------------------------------------------------------------------

def run_ours(trace: list[Request], budget_states: float) -> int:
    longest = max(len(computed(r)) for r in trace)
    cache = HybridCache(2, attn_layers=[0], recr_layers=[1], n_embd_k=1, n_embd_v=1, n_embd_r=1,
                        n_embd_s=RATIO - 1, kv_size=longest + 8, n_seq_max=1)   # K, V f16: 4 bytes a token
    assert cache.recurrent_bytes_per_seq == RATIO * cache.kv_bytes_per_token
    prefixes = HybridPrefixCache(cache, int(budget_states * cache.recurrent_bytes_per_seq), block_size=16)
    recomputed = 0

    def prefill(tokens: list[int], start: int, end: int) -> None:
        batch = Batch(token=tokens[start:end], seq_id=[0] * (end - start), pos=list(range(start, end)))
        for _ in cache.init_batch(batch, n_ubatch=2048):
            pass

    for request in trace:
        cache.seq_rm(0, -1, -1)
        done = prefixes.restore(0, request.prompt[:-1])   # a prompt's last token is always computed
        recomputed += len(request.prompt) - done
        text = computed(request)
        for cut in sorted({request.system, len(request.prompt), len(text)}):
            if cut > done:
                prefill(text, done, cut)
                done = cut
            if cut == done:
                prefixes.save(0, text[:cut])
    return recomputed


# -- the simulated anchors ------------------------------------------------------------------------

def run_vllm(trace: list[Request], budget_states: float, block: int) -> int:
    """KV blocks and states at block boundaries, LRU over both, in KV-token units."""
    budget = budget_states * RATIO
    held: OrderedDict[tuple[str, bytes], int] = OrderedDict()   # ("kv" | "state", prefix bytes) -> cost
    used = 0
    recomputed = 0

    def key(tokens: list[int], n: int) -> bytes:
        return np.asarray(tokens[:n], dtype=np.int32).tobytes()

    def add(entry: tuple[str, bytes], cost: int) -> None:
        nonlocal used
        if entry in held:
            held.move_to_end(entry)
            return
        while held and used + cost > budget:
            _, freed = held.popitem(last=False)
            used -= freed
        if used + cost <= budget:
            held[entry] = cost
            used += cost

    for request in trace:
        best = 0
        for n in range(block, len(request.prompt), block):
            if ("kv", key(request.prompt, n)) not in held:
                break
            if ("state", key(request.prompt, n)) in held:
                best = n
        for n in range(block, best + 1, block):
            held.move_to_end(("kv", key(request.prompt, n)))
        if best:
            held.move_to_end(("state", key(request.prompt, best)))
        recomputed += len(request.prompt) - best
        text = computed(request)
        for n in range(block, len(text) + 1, block):
            add(("kv", key(text, n)), block)
            add(("state", key(text, n)), RATIO)
    return recomputed


def run_llamacpp(trace: list[Request], budget_states: float) -> int:
    """Slots holding a context and checkpoints each; as many slots as the budget holds."""
    longest = max(len(computed(r)) for r in trace)
    per_slot = longest + (1 + CHECKPOINTS) * RATIO
    n_slots = max(1, int(budget_states * RATIO // per_slot))
    slots: list[dict] = [{"text": [], "checkpoints": [], "used": -1} for _ in range(n_slots)]
    recomputed = 0
    for clock, request in enumerate(trace):
        prompt = request.prompt

        def shared(slot: dict) -> int:
            n = min(len(slot["text"]), len(prompt) - 1)
            mismatch = np.flatnonzero(np.asarray(slot["text"][:n]) != np.asarray(prompt[:n]))
            return int(mismatch[0]) if mismatch.size else n

        scores = [shared(slot) for slot in slots]
        best = int(np.argmax(scores))
        if scores[best] * 2 < len(prompt):                       # llama.cpp's slot similarity 0.5
            best = min(range(n_slots), key=lambda i: slots[i]["used"])
        slot = slots[best]
        common = shared(slot)
        if common == len(slot["text"]) and common:
            reused = common                                     # it continues the context: the state at its end
        else:
            reused = max((c for c in slot["checkpoints"] if c <= common), default=0)
        recomputed += len(prompt) - reused
        checkpoints = [c for c in slot["checkpoints"] if c <= reused] + [len(prompt)]
        slot.update(text=computed(request), checkpoints=checkpoints[-CHECKPOINTS:], used=clock)
    return recomputed


def table(name: str, trace: list[Request], budgets: list[float]) -> list[str]:
    total = sum(len(r.prompt) for r in trace)
    lines = [f"### {name}: {len(trace)} requests, {total:,} prompt tokens", "",
             "| budget (states) | HybridPrefixCache | vLLM block 16 | vLLM block 64 | vLLM block 528 "
             "| llama.cpp checkpoints |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for budget in budgets:
        cells = [run_ours(trace, budget)] + [run_vllm(trace, budget, b) for b in (16, 64, 528)] + \
            [run_llamacpp(trace, budget)]
        lines.append(f"| {budget:g} | " + " | ".join(f"{c:,} ({100 * c / total:.1f}%)" for c in cells) + " |")
        print(lines[-1], flush=True)
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_quick_option(parser, "one budget, 8 conversations, no results file")
    args = parser.parse_args()
    if args.quick:
        print(NOTE)
    load = os.getloadavg()[0]
    budgets = [4.0] if args.quick else [2.0, 8.0, 32.0]
    lines = ["# Hybrid prefix reuse (bench/hybrid_prefix.py)", "",
             f"Prompt tokens recomputed (and their share of all prompt tokens) at equal memory; a recurrent state "
             f"costs {RATIO:,} tokens of KV. Load average {load:.2f} at the start.", ""]
    lines += table("The demo's conversations", demo_trace(), budgets)
    lines += table("Multi-turn conversations", conversations(8 if args.quick else 24), budgets)
    if not args.quick:
        RESULTS.write_text("\n".join(lines))
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
