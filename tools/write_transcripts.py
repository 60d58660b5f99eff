"""Write the command transcripts and the benchmark table in ``docs/`` from real runs.

The documentation quotes what ``python -m recurrent_cache ...`` prints.  A quote
typed by hand goes stale the day the output changes, so every quote lives
between marker comments and is written by this tool::

    <!-- transcript: NAME -->
    *Recorded ... (date, CPUs, load average)*

    ```text
    $ python -m recurrent_cache demo
    ...what it printed...
    ```
    <!-- /transcript -->

``TRANSCRIPTS`` names each transcript, its page and its commands.  The commands
of one transcript run in order in one fresh temporary directory (so ``--store
states`` of two runs is one directory), with this interpreter, stdout and stderr
merged as a terminal shows them.  Each ``$`` line in the block is a command, the
lines up to the next one its output; ``tests/tooling/test_transcripts.py`` reruns them
and checks that today's output still has the documented shape.

``<!-- table: bench-operations -->`` in ``docs/benchmarks.md`` is filled the same
way from the committed ``bench/results/results.md`` (the rows ``BENCH_ROWS``
names), so the page quotes the run that is committed, with its load.

Usage: ``python tools/write_transcripts.py [NAME ...]`` (default: all of them).
It rewrites the pages in place and prints what it wrote.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BENCH_RESULTS = ROOT / "bench" / "results" / "results.md"
COMMAND_TIMEOUT = 300   # seconds; the slowest command (the prefix-cache demo) takes ~15 s on a loaded machine
PROMPT = "$ "


@dataclass(frozen=True)
class Transcript:
    """A documented run: its marker name, the page it is on, its commands (argv after ``python``)."""

    name: str
    page: str
    commands: tuple[tuple[str, ...], ...]


def _cli(*args: str) -> tuple[str, ...]:
    return ("-m", "recurrent_cache", *args)


TRANSCRIPTS = (
    Transcript("demo-default", "getting-started.md", (_cli("demo"),)),
    Transcript("demo-fork", "cli.md", (_cli("demo", "--fork"),)),
    Transcript("generate", "cli.md", (_cli("generate", "def fibonacci(n):", "-n", "40", "--seed", "3"),)),
    Transcript("demo-speculative", "rollback.md", (_cli("demo", "--speculative", "4"),)),
    Transcript("demo-prefix-cache", "prefix-cache.md", (_cli("demo", "--prefix-cache"),)),
    Transcript("demo-store-twice", "prefix-cache.md", (_cli("demo", "--prefix-cache", "--store", "states"),) * 2),
)

# The rows of results.md's operations table that docs/benchmarks.md quotes: (workload, cache size, active seqs).
BENCH_ROWS = (
    ("decode step", "64", "64"),
    ("decode step", "1024", "64"),
    ("decode step", "16384", "64"),
    ("decode step", "65536", "64"),
    ("decode step", "65536", "4096"),
    ("prompt ingestion (4096 tokens)", "256", "256"),
    ("churn: all operations", "64", "64"),
)
BENCH_COLUMNS = ("Python API µs/op", "cimport API µs/op", "reference µs/op")

BLOCK = re.compile(r"(<!-- (transcript|table): ([\w-]+) -->\n)(.*?)(<!-- /\2 -->)", re.S)


class TranscriptError(Exception):
    """A page's markers, a transcript block or a benchmark table is not what this tool writes."""


def shown(command: tuple[str, ...]) -> str:
    """The command as the page shows it: ``python`` and its arguments, quoted for a shell."""
    return shlex.join(("python", *command))


def marked_blocks(text: str) -> dict[tuple[str, str], str]:
    """``{(kind, name): body}`` of every marked block of a page; a name used twice is an error."""
    blocks: dict[tuple[str, str], str] = {}
    for match in BLOCK.finditer(text):
        key = (match.group(2), match.group(3))
        if key in blocks:
            raise TranscriptError(f"two blocks marked {key[0]}: {key[1]}")
        blocks[key] = match.group(4)
    return blocks


def replace_block(text: str, kind: str, name: str, body: str) -> str:
    """``text`` with the body of its block ``kind: name`` replaced; the block must exist."""
    found = False

    def substitute(match: re.Match[str]) -> str:
        nonlocal found
        if (match.group(2), match.group(3)) != (kind, name):
            return match.group(0)
        found = True
        return match.group(1) + body + match.group(5)

    new = BLOCK.sub(substitute, text)
    if not found:
        raise TranscriptError(f"no <!-- {kind}: {name} --> ... <!-- /{kind} --> block")
    return new


def runs_of(body: str) -> list[tuple[str, str]]:
    """``[(command line, output)]`` of a transcript block's fenced ``text`` block."""
    fence = re.search(r"^```text\n(.*?)^```$", body, re.M | re.S)
    if fence is None:
        raise TranscriptError("a transcript block without a ```text fence")
    runs: list[tuple[str, list[str]]] = []
    for line in fence.group(1).splitlines():
        if line.startswith(PROMPT):
            runs.append((line[len(PROMPT):], []))
        elif not runs:
            raise TranscriptError(f"output before the first '{PROMPT}' command: {line!r}")
        else:
            runs[-1][1].append(line)
    return [(command, "\n".join(lines)) for command, lines in runs]


def argv_of(command_line: str) -> list[str]:
    """The argv that runs a documented command line with this interpreter; only ``python -m recurrent_cache``."""
    words = shlex.split(command_line)
    if words[:3] != ["python", "-m", "recurrent_cache"]:
        raise TranscriptError(f"a transcript command that is not 'python -m recurrent_cache ...': {command_line!r}")
    return [sys.executable, *words[1:]]


def run_commands(command_lines: list[str], workdir: Path) -> list[str]:
    """Run the command lines in order in ``workdir``; each one's output, stdout and stderr merged.

    A command that fails raises: a transcript of a failure would document a bug.
    """
    env = dict(os.environ, TQDM_DISABLE="1")
    outputs = []
    for line in command_lines:
        result = subprocess.run(argv_of(line), cwd=workdir, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, timeout=COMMAND_TIMEOUT)
        if result.returncode != 0:
            raise TranscriptError(f"{line} exited with status {result.returncode}:\n{result.stdout[-3000:]}")
        outputs.append(result.stdout.rstrip("\n"))
    return outputs


def record(transcript: Transcript) -> str:
    """Run ``transcript``'s commands now; the block body: when, on what load, and what they printed."""
    load = os.getloadavg()
    started = datetime.datetime.now(datetime.timezone.utc)
    lines = [shown(command) for command in transcript.commands]
    with tempfile.TemporaryDirectory(prefix="transcript-") as workdir:
        outputs = run_commands(lines, Path(workdir))
    text = "\n".join(f"{PROMPT}{line}\n{output}" for line, output in zip(lines, outputs))
    return (f"*Recorded by `tools/write_transcripts.py` on {started:%Y-%m-%d %H:%M} UTC, "
            f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
            f"(1, 5, 15 min); timings vary with the machine and its load.*\n\n"
            f"```text\n{text}\n```\n")


def bench_table(results: str) -> str:
    """The block body for docs/benchmarks.md: ``BENCH_ROWS`` of results.md, medians, with its run's setting."""
    setting = re.search(r"^- (Python .*)$", results, re.M)
    if setting is None:
        raise TranscriptError("results.md has no '- Python ...' line naming its run's setting")
    header: list[str] | None = None
    rows: dict[tuple[str, str, str], list[str]] = {}
    for line in results.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if header is None and cells[:3] == ["workload", "cache size", "active seqs"]:
            header = cells
        elif header is not None and len(cells) == len(header) and tuple(cells[:3]) in BENCH_ROWS:
            rows.setdefault((cells[0], cells[1], cells[2]), cells)
    missing = [row for row in BENCH_ROWS if row not in rows]
    if header is None or missing:
        raise TranscriptError(f"results.md's operations table lacks the rows {missing}")
    columns = [header.index(column) for column in BENCH_COLUMNS]
    out = [f"*From `bench/results/results.md` (full mode; {setting.group(1)}); medians in µs, "
           f"written by `tools/write_transcripts.py`.*", "",
           "| workload | cache size | active seqs | Python API | cimport API | reference |",
           "|---|---:|---:|---:|---:|---:|"]
    for key in BENCH_ROWS:
        medians = [rows[key][i].split(" (")[0] for i in columns]
        out.append("| " + " | ".join([*key, *medians]) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [t.name for t in TRANSCRIPTS] + ["bench-operations"]
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"what to write (default: all): {', '.join(names)}")
    wanted = set(parser.parse_args(argv).names or names)
    if wanted - set(names):
        parser.error(f"unknown names {sorted(wanted - set(names))}; known: {', '.join(names)}")
    for transcript in TRANSCRIPTS:
        if transcript.name in wanted:
            page = DOCS / transcript.page
            body = record(transcript)
            page.write_text(replace_block(page.read_text(encoding="utf-8"), "transcript", transcript.name, body),
                            encoding="utf-8")
            print(f"{transcript.page}: {transcript.name}: {body.splitlines()[0]}")
    if "bench-operations" in wanted:
        page = DOCS / "benchmarks.md"
        body = bench_table(BENCH_RESULTS.read_text(encoding="utf-8"))
        page.write_text(replace_block(page.read_text(encoding="utf-8"), "table", "bench-operations", body),
                        encoding="utf-8")
        print(f"benchmarks.md: bench-operations: {body.splitlines()[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
