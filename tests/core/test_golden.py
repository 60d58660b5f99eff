"""Replay every script of tests/data/golden.jsonl.gz through both engines.

Each op's result, the cell table, head, used and a hash of every state row
must equal the record (format: tests/data/README.md §1).  This package
raises at the lenient ops that would change the cache, so scripts marked
``raise_variant`` continue on their record in golden_lenient_raise.jsonl.
"""

import pytest
from golden import Replay, load

SCRIPTS = load("golden.jsonl")
RAISE_VARIANTS = {script["script"]: script for script in load("golden_lenient_raise.jsonl")}


def test_every_script_is_here():
    assert [script["script"] for script in SCRIPTS] == list(range(120))
    assert sorted(RAISE_VARIANTS) == [s["script"] for s in SCRIPTS if s["raise_variant"]]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: f"script{s['script']}-{s['kind']}")
def test_golden(rc, script):
    Replay(rc, script, RAISE_VARIANTS.get(script["script"])).run()
