"""The documentation site (``mkdocs.yml``, ``docs/``): it builds strictly, and every code block in it runs.

What each fence language means on a page:

- ``python``: executed, in page order. The python blocks of one page share one
  namespace, so a block continues the blocks above it on the same page (no marker:
  a page reads top to bottom); pages never share names. A page runs in a fresh
  temporary working directory, so files a block writes stay there.
- ``sh`` / ``console``: every line (a leading ``$ `` is dropped) is either a command
  this test runs — ``python -m recurrent_cache ...`` or ``python bench/NAME.py ...
  --quick`` — or starts with one of ``NOT_RUN``'s prefixes (installing or building,
  which would change the environment the tests run in; each listed with its reason).
  Any other line fails the test, unrun. Commands run in page order with the python
  blocks, in the page's directory, with this interpreter, under a timeout, and must
  exit with status 0; a command already run identically (same words) is not run twice.
- ``c`` / ``cpp`` / ``cython``: must be a verbatim excerpt, whitespace-normalised, of a
  file under ``examples/`` or of ``src/recurrent_cache/capi.h`` — the sources the test
  suite compiles (tests/capi/test_capi_examples.py), so a C block cannot show code that does not build.
- ``ALLOWED`` languages (``text``): not executed; each is listed with its reason.
- Any other language, a fence without one, or a fence not at the start of a line fails.

The tests at the end feed broken blocks and pages to each check to show it can fail.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

# The pages' blocks and toy model are numpy code whose caches take the engine only (docs/storage.md's
# blocks build their torch caches themselves): a torch run would repeat the compiled one.
pytestmark = pytest.mark.torch_skip("the pages and their toy model run numpy code on numpy storage; the torch "
                                    "run would repeat the compiled run (docs/storage.md runs torch itself)")

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
COMMAND_TIMEOUT = 180   # seconds; the commands on the pages take a few seconds each on an idle machine

ALLOWED = {
    "text": "byte layouts and transcripts: prose in a fixed-width font, nothing to run or compile",
}
NOT_RUN = {
    "pip install": "installs into the environment the tests run in",
    "python3 -m venv": "creates an environment; the tests already run in one",
    ".venv/bin/pip install": "installs into the environment the tests run in",
    "mkdocs build": "test_site_builds_strictly runs it",
    ".venv/bin/python -m pytest": "runs the test suite, inside which this test runs",
}
C_LANGUAGES = ("c", "cpp", "cython")
C_SOURCES = sorted(p for p in (ROOT / "examples").rglob("*") if p.suffix in (".c", ".cpp", ".pyx", ".h")) + [
    ROOT / "src" / "recurrent_cache" / "capi.h"]

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    """One fenced code block: its language, its text and the line its fence opens on."""

    language: str
    code: str
    line: int


class DocsError(AssertionError):
    """A page breaks one of the rules in this module's docstring."""


def blocks_of(text: str, name: str = "page") -> list[Block]:
    """The fenced blocks of a page, in order; a fence the parser would miss is an error."""
    blocks = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        language = match.group(1).strip()
        if not language:
            raise DocsError(f"{name}:{line}: a code fence without a language")
        blocks.append(Block(language, match.group(2), line))
    rest = FENCE.sub("", text)
    for line in rest.splitlines():
        if line.lstrip().startswith("```") or line.lstrip().startswith("~~~"):
            raise DocsError(f"{name}: a code fence this test cannot parse (indented, unclosed or ~~~): {line!r}")
    return blocks


def check_language(block: Block, name: str) -> None:
    """Fail for a fence language this module gives no rule for."""
    known = ("python", "sh", "console") + C_LANGUAGES
    if block.language not in known and block.language not in ALLOWED:
        raise DocsError(f"{name}:{block.line}: fence language {block.language!r} is neither checked "
                        f"({', '.join(known)}) nor allowed ({', '.join(ALLOWED)})")


def normalised(text: str) -> str:
    return " ".join(text.split())


def check_excerpt(block: Block, name: str) -> None:
    """A C, C++ or Cython block must appear, whitespace-normalised, in one of ``C_SOURCES``."""
    wanted = normalised(block.code)
    if not wanted:
        raise DocsError(f"{name}:{block.line}: an empty {block.language} block")
    if not any(wanted in normalised(path.read_text(encoding="utf-8")) for path in C_SOURCES):
        raise DocsError(f"{name}:{block.line}: this {block.language} block is not a verbatim excerpt of "
                        f"examples/ or capi.h:\n{block.code}")


def command_of(line: str, name: str, block: Block) -> list[str] | None:
    """The argv to run for one shell line, or None for a ``NOT_RUN`` line; anything else fails."""
    line = line.strip()
    if line.startswith("$ "):
        line = line[2:].strip()
    if not line or line.startswith("#"):
        return None
    words = shlex.split(line, comments=True)
    if any(line.startswith(prefix) for prefix in NOT_RUN):
        return None
    if words[:3] == ["python", "-m", "recurrent_cache"]:
        return [sys.executable, *words[1:]]
    if (len(words) >= 2 and words[0] == "python" and re.fullmatch(r"bench/\w+\.py", words[1])
            and "--quick" in words[2:]):
        return [sys.executable, str(ROOT / words[1]), *words[2:]]
    raise DocsError(f"{name}:{block.line}: a shell line this test neither runs nor allows: {line!r} "
                    "(runs: 'python -m recurrent_cache ...', 'python bench/NAME.py ... --quick')")


_RUN_ALREADY: dict[str, str] = {}


def run_command(argv: list[str], cwd: Path, name: str, block: Block) -> None:
    key = shlex.join(argv)
    if key in _RUN_ALREADY:
        return
    env = dict(os.environ, TQDM_DISABLE="1")
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    if result.returncode != 0:
        raise DocsError(f"{name}:{block.line}: {key} exited with status {result.returncode}:\n"
                        f"{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    _RUN_ALREADY[key] = result.stdout


def run_page(text: str, name: str, workdir: Path, run_commands: bool = True) -> dict:
    """Check and run every block of a page, in order; the python blocks' namespace.

    ``run_commands=False`` checks the shell lines without running them (a second engine's pass).
    """
    namespace: dict = {"__name__": f"docs.{name}"}
    blocks = blocks_of(text, name)
    for block in blocks:        # every block is checked before anything runs
        check_language(block, name)
        if block.language in ("sh", "console"):
            for line in block.code.splitlines():
                command_of(line, name, block)
    previous = Path.cwd()
    os.chdir(workdir)
    try:
        for block in blocks:
            if block.language == "python":
                # the blank lines keep the traceback's line numbers those of the page
                exec(compile("\n" * block.line + block.code, f"docs/{name}", "exec"), namespace)
            elif block.language in ("sh", "console"):
                for line in block.code.splitlines():
                    argv = command_of(line, name, block)
                    if argv is not None and run_commands:
                        run_command(argv, workdir, name, block)
            elif block.language in C_LANGUAGES:
                check_excerpt(block, name)
    finally:
        os.chdir(previous)
    return namespace


# -- the site ------------------------------------------------------------------------------------

def _mkdocs_or_skip():
    return pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install '.[docs]')")


def test_site_builds_strictly(tmp_path):
    """``mkdocs build --strict``: a broken link, anchor, image or API reference is an error."""
    _mkdocs_or_skip()
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed (pip install '.[docs]')")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert result.returncode == 0, result.stdout + result.stderr
    for page in PAGES:
        built = tmp_path / ("index.html" if page.stem == "index" else f"{page.stem}/index.html")
        assert built.is_file(), f"{page.name} was not built"
    reference = (tmp_path / "reference" / "index.html").read_text(encoding="utf-8")
    assert not missing_from_reference(reference)


def public_names() -> list[str]:
    """What the API reference must show: every name of ``recurrent_cache.__all__`` and of the
    models' ``__all__``, and a few methods deep in the classes."""
    import recurrent_cache
    import recurrent_cache.models

    return ([f"recurrent_cache.{name}" for name in recurrent_cache.__all__]
            + [f"recurrent_cache.models.{name}" for name in recurrent_cache.models.__all__]
            + [f"recurrent_cache.{name}" for name in ("RecurrentCache.init_batch", "MemoryState.r_steps",
                                                      "Ubatch.seq_owner", "PrefixCache.plan")])


def missing_from_reference(html: str) -> list[str]:
    """The public names the built reference page has no entry for (an exception is shown under
    ``recurrent_cache.errors``, where it is defined)."""
    ids = set(re.findall(r'id="([\w.]+)"', html))
    missing = []
    for name in public_names():
        short = name.rsplit(".", 1)[-1]
        if name not in ids and f"recurrent_cache.errors.{short}" not in ids:
            missing.append(name)
    return missing


def test_a_reference_without_a_public_name_fails():
    every = " ".join(f'<h2 id="{name}">' for name in public_names())
    assert not missing_from_reference(every)
    assert missing_from_reference(every.replace('id="recurrent_cache.load_session_file"', "")) == [
        "recurrent_cache.load_session_file"]


@pytest.mark.parametrize("breakage", [
    ("index.md", "\nSee [a page that does not exist](missing.md).\n"),
    ("index.md", "\nSee [a section that does not exist](concepts.md#no-such-section).\n"),
    ("reference.md", "\n::: recurrent_cache.NoSuchName\n"),
], ids=["broken-link", "broken-anchor", "broken-reference"])
def test_strict_build_fails_on_a_broken_page(tmp_path, breakage):
    """The same configuration, on a copy of the pages with one defect, refuses to build."""
    _mkdocs_or_skip()
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed (pip install '.[docs]')")
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort, PluginError

    pages = tmp_path / "docs"
    shutil.copytree(DOCS, pages)
    (pages / "reference.md").write_text("# API reference\n\n::: recurrent_cache.Batch\n", encoding="utf-8")
    page, defect = breakage
    with open(pages / page, "a", encoding="utf-8") as file:
        file.write(defect)
    config = load_config(config_file=str(ROOT / "mkdocs.yml"), docs_dir=str(pages),
                         site_dir=str(tmp_path / "site"))
    with pytest.raises((Abort, PluginError)):
        build(config)


# -- the code blocks -----------------------------------------------------------------------------

def runs_torch(page: Path) -> bool:
    """Whether a page's python blocks build torch caches (docs/storage.md): CI's torch stage runs them."""
    return any(block.language == "python" and "torch" in block.code
               for block in blocks_of(page.read_text(encoding="utf-8"), page.name))


@pytest.mark.parametrize("page", [pytest.param(page, marks=[pytest.mark.needs_torch] if runs_torch(page) else [])
                                  for page in PAGES], ids=[page.name for page in PAGES])
def test_code_blocks_run(page, tmp_path, rc, monkeypatch):
    """Every block of the page passes its language's rule (this module's docstring); the python
    blocks run on both engines (the caches they build take ``RECURRENT_CACHE_IMPL``), the
    commands once, on the default engine (the command-line tests cover the commands)."""
    monkeypatch.setenv("RECURRENT_CACHE_IMPL", rc.ENGINE)
    run_page(page.read_text(encoding="utf-8"), page.name, tmp_path, run_commands=rc.ENGINE == "compiled")


def test_every_page_is_in_the_site():
    """Pages are what the test walks; the nav is what the site shows: they must agree."""
    nav = re.findall(r":\s*([\w-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(encoding="utf-8"), re.M)
    assert sorted(nav) == sorted(page.name for page in PAGES)


# -- the toy model of "Bring your own model", against its solo runs -----------------------------

def toy_model() -> dict:
    """The namespace of the page's first python block: the toy model and its cache-free ``solo``."""
    page = DOCS / "bring-your-own-model.md"
    first = next(b for b in blocks_of(page.read_text(encoding="utf-8")) if b.language == "python")
    assert len(first.code.splitlines()) < 50, "the toy model must stay under 50 lines"
    namespace: dict = {}
    exec(compile(first.code, str(page), "exec"), namespace)
    return namespace


@pytest.mark.parametrize("n_rollback", [0, 3])
def test_toy_model_served_by_the_cache_equals_its_solo_runs(rc, n_rollback):
    """Random continuous batching — admissions, decode steps, forks, removals, rollbacks, ubatch
    sizes — and every output of every sequence equals the cache-free run of its tokens, bit for bit."""
    toy = toy_model()
    rng = np.random.default_rng(7 + n_rollback)
    n_seqs = 4
    cache = toy["new_cache"](n_seqs, n_rollback=n_rollback, engine=rc.ENGINE)
    history: dict[int, list[int]] = {}
    checked = 0
    for step in range(50):
        tokens, seq_ids, positions = [], [], []
        for seq in range(n_seqs):
            roll = 1.0 if step == 0 else rng.random()   # first, every sequence admitted
            if seq in history and roll < 0.1:
                assert cache.seq_rm(seq, -1, -1)
                del history[seq]
            elif seq in history and roll < 0.2 and len(history.keys() | set(seq_ids)) < n_seqs:
                fork = next(s for s in range(n_seqs) if s not in history and s not in seq_ids)
                cache.seq_cp(seq, fork)
                history[fork] = list(history[seq])
            elif seq in history and roll < 0.35 and n_rollback and len(history[seq]) > 1:
                p0 = int(rng.integers(1, len(history[seq])))
                if cache.seq_rm(seq, p0, -1):
                    del history[seq][p0:]
                assert cache.seq_pos_max(seq) == len(history[seq]) - 1
            else:
                length = 1 if seq in history else 4 if step == 0 else int(rng.integers(1, 7))
                new = [int(t) for t in rng.integers(toy["V"], size=length)]
                start = len(history.get(seq, []))
                tokens += new
                seq_ids += [seq] * len(new)
                positions += range(start, start + len(new))
        if not tokens:
            continue
        batch = rc.Batch(token=tokens, seq_id=seq_ids, pos=positions, logits=[1] * len(tokens))
        # the first batch: ubatches of 2 groups x 4 tokens, so a model mixing up groups and tokens fails
        st = cache.init_batch(batch, n_ubatch=8 if step == 0 else int(rng.choice([1, 2, 3, 8])))
        logits = toy["forward"](st)
        for seq, token in zip(seq_ids, tokens):
            history.setdefault(seq, []).append(token)
        solo = {seq: toy["solo"](history[seq]) for seq in set(seq_ids)}
        for row, index in enumerate(st.out_ids):
            np.testing.assert_array_equal(logits[row], solo[seq_ids[index]][positions[index]])
            checked += 1
        cache.check()
    assert checked > 100


def test_a_state_written_and_read_back_is_the_same_bytes(rc):
    """Exactness page: a blob read into another cache and written again is byte-identical, and the
    model continues from it exactly as from the original."""
    toy = toy_model()
    cache = toy["new_cache"](2, engine=rc.ENGINE)
    toy["forward"](cache.init_batch(rc.Batch(token=[1, 5, 9, 2], seq_id=[1] * 4, pos=[0, 1, 2, 3])))
    blob = cache.state_write(seq_id=1)
    other = toy["new_cache"](3, engine=rc.ENGINE)
    other.state_read(blob, seq_id=2)
    assert other.state_write(seq_id=2) == blob
    step = lambda c, seq: toy["forward"](c.init_batch(rc.Batch(token=[7], seq_id=[seq], pos=[4])))
    np.testing.assert_array_equal(step(other, 2), step(cache, 1))


# -- each check can fail -------------------------------------------------------------------------

def _fake_page(*blocks: str) -> str:
    return "# A page\n\nSome prose.\n\n" + "\n\nMore prose.\n\n".join(blocks) + "\n"


def test_a_failing_python_block_fails(tmp_path):
    page = _fake_page("```python\nx = 1\n```", "```python\nassert x == 2, 'the page is wrong'\n```")
    with pytest.raises(AssertionError, match="the page is wrong"):
        run_page(page, "fake.md", tmp_path)


def test_python_blocks_share_a_namespace_per_page_only(tmp_path):
    namespace = run_page(_fake_page("```python\nx = 1\n```", "```python\ny = x + 1\n```"), "a.md", tmp_path)
    assert namespace["y"] == 2
    with pytest.raises(NameError):
        run_page(_fake_page("```python\nprint(y)\n```"), "b.md", tmp_path)


def test_a_failing_command_fails(tmp_path):
    page = _fake_page("```sh\npython -m recurrent_cache inspect no-such-file.bin\n```")
    with pytest.raises(DocsError, match="exited with status"):
        run_page(page, "fake.md", tmp_path)


@pytest.mark.parametrize("line", ["rm -rf build", "python bench/run.py", "python -c 'print(1)'",
                                  "python bench/../tools/x.py --quick"])
def test_a_shell_line_that_is_not_a_documented_command_fails_unrun(tmp_path, line):
    with pytest.raises(DocsError, match="neither runs nor allows"):
        run_page(_fake_page(f"```sh\n{line}\n```"), "fake.md", tmp_path)


def test_a_c_block_that_is_not_an_excerpt_fails(tmp_path):
    real = "rc_batch_release(batch);\n    return code;"
    run_page(_fake_page(f"```c\n{real}\n```"), "fake.md", tmp_path)
    with pytest.raises(DocsError, match="not a verbatim excerpt"):
        run_page(_fake_page("```c\nrc_batch_release(batch);\n    return RC_OK;\n```"), "fake.md", tmp_path)


@pytest.mark.parametrize("fence", ["```bash\nls\n```", "```\nprint(1)\n```", "    ```python\n    x = 1\n    ```",
                                   "~~~python\nx = 1\n~~~"],
                         ids=["unknown-language", "no-language", "indented", "tildes"])
def test_a_block_without_a_rule_fails(tmp_path, fence):
    with pytest.raises(DocsError):
        run_page(_fake_page(fence), "fake.md", tmp_path)
