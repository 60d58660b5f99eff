"""Replay of the conformance data in tests/data/ (format: tests/data/README.md)."""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
from pathlib import Path

import numpy as np
from rows import assign, dtype, host

# Recorded from llama.cpp; the repository carries them so a fresh clone tests alone.
VECTORS = Path(__file__).resolve().parent / "data"


def load(name: str) -> list[dict]:
    """The objects of ``name`` (a ``.jsonl`` file, stored gzip-compressed)."""
    with gzip.open(VECTORS / f"{name}.gz", "rt") as f:
        return [json.loads(line) for line in f]


def formula(a: int, b: int, c: int, w: int, n: int) -> np.ndarray:
    j = np.arange(n, dtype=np.int64)
    return ((((a * 37 + b * 11 + c * 5 + w * 17 + j * 3) % 251) - 125) / 4).astype(np.float32)


def store(row, values: np.ndarray) -> None:
    """Write float32 values into a row of any state dtype and storage (bf16 may be raw uint16 bits)."""
    if dtype(row) == np.uint16:
        assign(row, (values.view(np.uint32) >> 16).astype(np.uint16))
    else:
        assign(row, values)


def raw_bytes(array) -> bytes:
    """The bytes of rows of any storage."""
    return host(array).tobytes()


def rows_hash(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(raw_bytes(a))
    return h.hexdigest()


def snapshot(cache) -> dict:
    return {
        "head": cache.head,
        "used": cache.used,
        "cells": [[p, src, tail, sorted(ids)] for p, src, tail, ids in
                  (cache.cell(i) for i in range(cache.size))],
        "rows_sha256": rows_hash(list(cache.r) + list(cache.s)),
    }


class Replay:
    """Drives one script through an implementation ``rc`` and asserts every record."""

    def __init__(self, rc, script: dict, raise_variant: dict | None = None) -> None:
        self.rc = rc
        self.script = script
        self.raise_variant = raise_variant
        self.step = 0

    def where(self, op: dict, what: str) -> str:
        return f"script {self.script['script']} op {op['i']} ({op['op']}): {what}"

    def run(self) -> None:
        rc, script = self.rc, self.script
        if script.get("constructor_raises"):
            try:
                rc.RecurrentCache(**script["constructor"])
            except rc.RecurrentCacheError:
                return
            raise AssertionError(f"script {script['script']}: constructor should raise")
        self.cache = rc.RecurrentCache(**script["constructor"])
        assert self.cache.size == script["size"]
        self.expect_snapshot(script["initial"], "initial")
        ops = script["ops"]
        k = 0
        while k < len(ops):
            op = ops[k]
            if op.get("lenient_changes_cache") and self.raise_variant is not None:
                # this package raises at cache-changing lenient ops: continue on the raise record
                ops = self.raise_variant["ops"]
                op = ops[k]
            self.run_op(op)
            k += 1

    def expect_snapshot(self, expected: dict, what: str) -> None:
        got = snapshot(self.cache)
        for key in ("head", "used", "cells", "rows_sha256"):
            assert got[key] == expected[key], f"{what}: {key} {got[key]!r} != {expected[key]!r}"
        self.cache.check()

    def run_op(self, op: dict) -> None:
        rc, cache, args = self.rc, self.cache, op["args"]
        name = op["op"]
        expect_raise = op.get("raises")
        try:
            if name == "init_batch":
                result = self.init_batch(op)
            elif name == "fill":
                self.fill(args["salt"])
                result = None
            elif name == "init_full":
                st = cache.init_full()
                result = {"head": st.head, "n_kv": st.n_kv}
            elif name == "state_write":
                result = cache.state_write(seq_id=args["seq_id"])
            elif name == "state_read":
                result = cache.state_read(base64.b64decode(args["blob_b64"]), seq_id=args["seq_id"])
            else:
                result = getattr(cache, name)(*args.values())
        except rc.RecurrentCacheError as exc:
            if not expect_raise and not op.get("lenient"):
                raise AssertionError(self.where(op, f"unexpected {type(exc).__name__}: {exc}")) from exc
            self.expect_snapshot(op["after"], self.where(op, "after a rejected op"))
            return
        if expect_raise:
            raise AssertionError(self.where(op, f"should raise {expect_raise}: {op.get('raises_message')}"))
        if name in ("seq_rm", "seq_pos_min", "seq_pos_max"):
            assert result == op["returns"], self.where(op, f"returned {result!r}, expected {op['returns']!r}")
        elif name == "init_full":
            assert result == op["state"], self.where(op, f"{result} != {op['state']}")
        elif name == "state_write":
            assert result == base64.b64decode(op["returns_b64"]), self.where(op, "blob bytes differ")
        self.expect_snapshot(op["after"], self.where(op, "after"))

    def fill(self, salt: int) -> None:
        cache = self.cache
        arrays = list(cache.r) + list(cache.s)
        for k, a in enumerate(arrays):
            for c in range(cache.size):
                store(a[c], formula(salt, c, k, 3, a.shape[1]))

    def init_batch(self, op: dict) -> None:
        rc, cache, args = self.rc, self.cache, op["args"]
        batch = rc.Batch(**args["batch"])
        st = cache.init_batch(batch, n_ubatch=args["n_ubatch"], embd_pooled=args["embd_pooled"],
                              logits_all=args["logits_all"])
        assert st.status.name == op["status"], self.where(op, f"status {st.status.name}")
        stop_after = op.get("stop_after")
        ubatches = op["ubatches"]
        if stop_after == 0:
            return
        n_layer = cache.n_layer
        for k, u in enumerate(ubatches):
            st.apply()
            ub = st.ubatch
            at = self.where(op, f"ubatch {k}")
            assert (ub.n_tokens, ub.n_seq_tokens, ub.n_seqs) == (u["n_tokens"], u["n_seq_tokens"], u["n_seqs"]), at
            assert [list(ids) for ids in ub.seq_id] == u["seq_id"], at
            if "token" in u:
                assert ub.token.tolist() == u["token"], at
            else:
                np.testing.assert_array_equal(ub.embd, np.array(u["embd"], dtype=np.float32), err_msg=at)
            assert ub.pos.tolist() == u["pos"], at
            assert ub.output.tolist() == u["output"], at
            assert (st.head, st.n_kv, cache.n) == (u["head"], u["n_kv"], u["n_kv"]), at
            assert st.copy_src.tolist() == u["copy_src"], at
            assert st.zero.tolist() == u["zero"], at
            cells = [[p, src, tail, sorted(ids)] for p, src, tail, ids in
                     (cache.cell(i) for i in range(cache.size))]
            assert cells == u["cells"], at + f" cells {cells}"
            assert rows_hash(list(cache.r) + list(cache.s)) == u["rows_sha256"], at + " rows"
            views = [st.r(il) for il in range(n_layer)] + [st.s(il) for il in range(n_layer)]
            assert rows_hash(views) == u["views_sha256"], at + " views"
            head = st.head
            for s in range(ub.n_seqs):
                for il in range(n_layer):
                    store(cache.r[il][head + s], formula(self.step, s, il, 0, cache.r[il].shape[1]))
                    store(cache.s[il][head + s], formula(self.step, s, il, 1, cache.s[il].shape[1]))
            self.step += 1
            if stop_after is not None and k + 1 == stop_after:
                return
            assert st.next() == (k + 1 < len(ubatches)), at
        assert st.out_ids.tolist() == op["out_ids"], self.where(op, "out_ids")
