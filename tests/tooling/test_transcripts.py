"""The transcripts in ``docs/`` still describe what their commands print.

``tools/write_transcripts.py`` writes every ``<!-- transcript: NAME -->`` block
from a real run.  Here every such block's commands (its ``$`` lines) run again,
in order, in one fresh directory, and today's output must have the documented
shape: the same lines, in the same order, with the same labels and words, and
the same numbers except those ``masked`` replaces by a placeholder.  Per field:

- **By shape** (a number of any value, the words around it exact), because they
  measure this run on this machine and load:
  every number on a ``throughput`` line (tokens/s, seconds, speed-ups) and on a
  ``time`` line (the cache / model / other percentages); every duration
  ``N s`` and rate ``N tokens/s`` elsewhere (``generate``'s figures on stderr);
  the verification's ``last logits within E relative`` (the largest rounding
  difference against the solo runs: it depends on the platform's floating-point
  kernels, and the command itself fails when it exceeds the tolerance); the
  directory in ``DirectoryStore('...')`` (the run's temporary directory); the
  store's ``(N written)`` and its ``N entries (S MiB)`` (a put whose state is
  bit-equal to the stored one is skipped, and whether a state prefilled in
  other ubatches is bit-equal in f32 depends on the platform's rounding, see
  docs/exactness.md; this machine gives the same counts on every run).
- **Exactly**, because a seeded run determines them: the model and cache
  lines; every client's prompt length, prompt excerpt, generated text and
  sampling seed (the sampling is seeded per client; the greedy modes have no
  randomness); token, ubatch and ``init_batch`` counts; peak cells; drafted,
  accepted and rolled-back tokens and model steps of ``--speculative``; the
  prefix cache's snapshots, saves, evictions, hit rate and prefill counts; the
  store's restores, restored tokens, lookups and puts on the first and the
  second run, damaged entries and errors; the namespace (a hash of the
  weights); ``PASSED``, the number of clients or requests verified and the
  tolerance; ``generate``'s text, positions and state size.

The generated texts are exact although they come from float32 logits: a
sampled or greedy token changes only when rounding moves a logit across a
near-tie or a sampling threshold.  That is rare (checked on one x86_64 machine
only), and a platform where it happens is one where the page shows the user a
text they will not see: worth a failure, then a decision.

The last tests doctor a documented transcript and show the check refuses it,
while a change of a measured figure alone passes.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "write_transcripts.py"


def _load_tool():
    spec = importlib.util.spec_from_file_location("write_transcripts", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


tool = _load_tool()

NUMBER = r"\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?"
MEASURED_LINE = re.compile(r"^(?:throughput|time)\s{2,}")
MEASURED = (
    (re.compile(rf"(?<![\w.]){NUMBER} s\b"), "<seconds> s"),
    (re.compile(rf"(?<![\w.]){NUMBER} tokens/s\b"), "<rate> tokens/s"),
    (re.compile(rf"last logits within {NUMBER} relative"), "last logits within <error> relative"),
    (re.compile(r"DirectoryStore\('[^']*'"), "DirectoryStore('<directory>'"),
    (re.compile(rf"\({NUMBER} written\)"), "(<n> written)"),
    (re.compile(rf"{NUMBER} entries \({NUMBER} MiB\)"), "<n> entries (<size> MiB)"),
)


class ShapeMismatch(AssertionError):
    """Today's output of a documented command does not have the documented shape."""


def masked(line: str) -> str:
    """``line`` with every by-shape field (this module's docstring) replaced by a placeholder."""
    if MEASURED_LINE.match(line):
        return re.sub(NUMBER, "<n>", line)
    for pattern, placeholder in MEASURED:
        line = pattern.sub(placeholder, line)
    return line


def check_shape(documented: str, actual: str, command: str) -> None:
    """Raise ``ShapeMismatch`` naming the first line where ``actual`` leaves ``documented``'s shape."""
    want, got = documented.splitlines(), actual.splitlines()
    for number, (expected, line) in enumerate(zip(want, got), start=1):
        if masked(expected) != masked(line):
            raise ShapeMismatch(f"{command}: line {number} differs beyond its measured figures:\n"
                                f"  documented: {expected}\n  today:      {line}\n"
                                f"  (compared as {masked(expected)!r}\n           and {masked(line)!r})")
    if len(want) != len(got):
        extra = want[len(got):] or got[len(want):]
        raise ShapeMismatch(f"{command}: documented {len(want)} lines, today {len(got)}; "
                            f"first unmatched: {extra[0]!r}")


def documented_transcripts() -> list[tuple[str, str, str]]:
    """``(page, name, body)`` of every transcript block in the docs."""
    found = []
    for page in sorted(tool.DOCS.glob("*.md")):
        for (kind, name), body in tool.marked_blocks(page.read_text(encoding="utf-8")).items():
            if kind == "transcript":
                found.append((page.name, name, body))
    return found


TRANSCRIPTS = documented_transcripts()


def test_the_docs_hold_exactly_the_transcripts_the_tool_writes():
    """Each registered transcript is on its page with its commands and the run's date and load; no other."""
    on_pages = {(page, name): body for page, name, body in TRANSCRIPTS}
    assert sorted(on_pages) == sorted((t.page, t.name) for t in tool.TRANSCRIPTS)
    for transcript in tool.TRANSCRIPTS:
        body = on_pages[(transcript.page, transcript.name)]
        assert [command for command, _ in tool.runs_of(body)] == [tool.shown(c) for c in transcript.commands]
        assert re.search(r"Recorded by `tools/write_transcripts.py` on \d{4}-\d\d-\d\d \d\d:\d\d UTC, "
                         r"\d+ CPUs, load average [\d.]+ [\d.]+ [\d.]+", body), body.splitlines()[0]


@pytest.mark.parametrize(("page", "name", "body"), TRANSCRIPTS, ids=[f"{p}:{n}" for p, n, _ in TRANSCRIPTS])
def test_documented_output_has_todays_shape(page, name, body, tmp_path):
    """Run the transcript's commands as documented; each output has the documented shape."""
    runs = tool.runs_of(body)
    outputs = tool.run_commands([command for command, _ in runs], tmp_path)
    for (command, documented), actual in zip(runs, outputs):
        check_shape(documented, actual, f"{page}:{name}: {command}")


def test_the_benchmark_table_quotes_the_committed_results():
    """docs/benchmarks.md's table is what the tool writes from bench/results/results.md today."""
    page = (tool.DOCS / "benchmarks.md").read_text(encoding="utf-8")
    quoted = tool.marked_blocks(page)[("table", "bench-operations")]
    assert quoted == tool.bench_table(tool.BENCH_RESULTS.read_text(encoding="utf-8"))


# -- the check can fail --------------------------------------------------------------------------

def _documented(name: str) -> tuple[str, str]:
    """The (command, output) of a transcript's first run, as the page has it."""
    body = next(body for _, found, body in TRANSCRIPTS if found == name)
    return tool.runs_of(body)[0]


def _doctor(text: str, old: str, new: str) -> str:
    assert old in text, f"the transcript no longer contains {old!r}: pick another doctoring"
    return text.replace(old, new, 1)


@pytest.mark.parametrize(("name", "old", "new"), [
    ("demo-default", "tokens           ", "tokens used      "),                 # a label renamed
    ("demo-default", "verification     PASSED: 8 of 8", "verification     PASSED: 7 of 8"),
    ("demo-default", "PASSED", "FAILED"),
    ("demo-default", "tolerance 1e-05", "tolerance 1e-04"),
    ("demo-default", "generated\n", "generated, 3 errors\n"),
    ("demo-default", "seed (0, 3)", "seed (0, 4)"),
    ("demo-speculative", " accepted (", " accepted  ("),                         # the words' spacing
    ("demo-prefix-cache", "prefill          ", "prefill          1 "),
    ("demo-store-twice", "0 restores from it (0 tokens) in 8 lookups", "0 restores from it (0 tokens) in 9 lookups"),
    ("generate", "\n---", "\n--- extra line\n---"),
], ids=["label", "verified-count", "verdict", "tolerance", "words", "seed", "spacing", "prefill", "store-lookups",
     "extra-line"])
def test_a_doctored_transcript_is_refused(name, old, new):
    """The documented output, doctored in one place, no longer matches the real one."""
    command, output = _documented(name)
    check_shape(output, output, command)
    with pytest.raises(ShapeMismatch):
        check_shape(_doctor(output, old, new), output, command)


@pytest.mark.parametrize("name", ["demo-default", "demo-speculative", "demo-prefix-cache"])
def test_a_changed_count_is_refused(name):
    """Every exact number, changed by one, is refused; numbers are exact unless a by-shape rule masks them."""
    command, output = _documented(name)
    exact_lines = [i for i, line in enumerate(output.splitlines())
                   if not MEASURED_LINE.match(line) and re.search(r"\b\d+ (?:of|tokens|init_batch|drafted)\b", line)]
    assert exact_lines, "no counts to doctor"
    for index in exact_lines:
        lines = output.splitlines()
        lines[index] = re.sub(r"\b(\d+)( (?:of|tokens|init_batch|drafted)\b)",
                              lambda m: f"{int(m.group(1)) + 1}{m.group(2)}", lines[index], count=1)
        with pytest.raises(ShapeMismatch):
            check_shape("\n".join(lines), output, command)


def test_a_missing_or_extra_line_is_refused():
    command, output = _documented("demo-default")
    with pytest.raises(ShapeMismatch, match="documented"):
        check_shape(output + "\nnew line", output, command)
    with pytest.raises(ShapeMismatch, match="documented"):
        check_shape("\n".join(output.splitlines()[:-1]), output, command)


def test_measured_figures_may_change():
    """Timings, rates, percentages, the rounding error and the store's directory are compared by shape."""
    _, output = _documented("demo-store-twice")
    today = re.sub(r"(throughput\s+)\d+", r"\g<1>99999", output)
    today = re.sub(r"\((\d+\.\d+) s\)", "(123.45 s)", today)
    today = re.sub(r"within [\d.e-]+ relative", "within 9.9e-06 relative", today)
    today = re.sub(r"DirectoryStore\('[^']*'", "DirectoryStore('/elsewhere/states'", today)
    today = re.sub(r"\d+ entries \([\d.]+ MiB\)", "58 entries (4.3 MiB)", today)
    today = re.sub(r"\(\d+ written\)", "(0 written)", today)
    assert today != output
    check_shape(output, today, "demo-store-twice")
    _, generated = _documented("generate")
    check_shape(generated, re.sub(r"\d+\.\d+ s \(\d+ tokens/s", "9.999 s (1 tokens/s", generated), "generate")


def test_a_command_that_fails_is_an_error(tmp_path):
    with pytest.raises(tool.TranscriptError, match="exited with status 1"):
        tool.run_commands(["python -m recurrent_cache inspect no-such-file.bin"], tmp_path)


def test_only_the_package_commands_run(tmp_path):
    with pytest.raises(tool.TranscriptError, match="not 'python -m recurrent_cache"):
        tool.run_commands(["python -c 'print(1)'"], tmp_path)


def test_the_tool_refuses_pages_it_cannot_write():
    """A missing block, a name used twice and a block without its fence are errors, not silent skips."""
    page = "# A page\n\n<!-- transcript: a -->\nold\n<!-- /transcript -->\n"
    assert tool.replace_block(page, "transcript", "a", "new\n") == page.replace("old", "new")
    with pytest.raises(tool.TranscriptError, match="no <!-- transcript: b -->"):
        tool.replace_block(page, "transcript", "b", "new\n")
    with pytest.raises(tool.TranscriptError, match="two blocks"):
        tool.marked_blocks(page + page)
    with pytest.raises(tool.TranscriptError, match="without a ```text fence"):
        tool.runs_of("old\n")
    with pytest.raises(tool.TranscriptError, match="output before the first"):
        tool.runs_of("```text\nmodel  Mamba-1\n$ python -m recurrent_cache demo\n```\n")
