"""The pages (README.md, docs/*.md) name what the code has: commands, extras, file versions, the CI command.

- every ``python -m recurrent_cache COMMAND`` on a page is a command of ``cli.COMMANDS``, every
  command has a ``## COMMAND`` section in docs/cli.md, and the "Command line" rows of the README's
  and the site's tables of pages name every command;
- every extra a page names (``'.[X]'``, ``recurrent_cache[X]``, ``[X]`` extra) is one of
  pyproject.toml's, getting-started's table of extras lists every extra, and each package its row
  names is one that extra installs;
- a version stated next to 'ggsq' / 'ggsn' is one of ``formats.layouts.FILE_FORMATS``' and an older one
  than the current (what ``save_seq_file`` / ``save_session_file`` write) is said to be June 2025's;
- the README's two opening commands are getting-started's, and the test command is .ci/run's first stage.

That the API reference shows every public name is checked on the built site
(tests/tooling/test_docs.py, ``test_site_builds_strictly``: one build for both). The tests
at the end break a copy of a page and show that each check then fails.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from recurrent_cache.formats import layouts as state_format
from recurrent_cache.cli import COMMANDS

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11")

ROOT = Path(__file__).resolve().parents[2]
PAGES = {path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8")
         for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
SELF = PYPROJECT["project"]["name"]

COMMAND = re.compile(r"python -m recurrent_cache ([a-z][\w-]*)")   # not a placeholder (COMMAND)
EXTRA = re.compile(r"(?:\.|recurrent_cache)\[([\w,-]+)\]|`\[([\w-]+)\]` extra")
VERSION = re.compile(r"(ggsq|ggsn)[^.|\n]{0,40}?\bversions?\s+(\d+)")
# What marks an older version as such, in the sentence that states it or the heading of its section.
OLDER = re.compile(r"June|2025|version=2|older")


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def extra_packages(extra: str) -> set[str]:
    """The distributions ``extra`` installs, its own extras (``recurrent_cache[test]``) expanded."""
    names: set[str] = set()
    for requirement in PYPROJECT["project"]["optional-dependencies"][extra]:
        match = re.match(r"([A-Za-z0-9._-]+)(?:\[([\w,-]+)\])?", requirement)
        name, extras = normalized(match.group(1)), match.group(2)
        if name == normalized(SELF):
            names |= {package for included in extras.split(",") for package in extra_packages(included)}
        else:
            names.add(name)
    return names


def included_extras(extra: str) -> set[str]:
    """The extras of this package that ``extra`` installs too."""
    found = set()
    for requirement in PYPROJECT["project"]["optional-dependencies"][extra]:
        match = re.match(r"([A-Za-z0-9._-]+)\[([\w,-]+)\]", requirement)
        if match and normalized(match.group(1)) == normalized(SELF):
            found |= set(match.group(2).split(","))
    return found


# -- commands ------------------------------------------------------------------------------------

def unknown_commands(pages: dict[str, str]) -> list[str]:
    return [f"{name}: python -m recurrent_cache {command}" for name, text in pages.items()
            for command in COMMAND.findall(text) if command not in COMMANDS]


def commands_without_a_section(cli_page: str) -> list[str]:
    sections = set(re.findall(r"^## ([\w-]+)", cli_page, re.M))
    return sorted(set(COMMANDS) - sections)


def commands_a_table_row_misses(text: str) -> list[str]:
    """The commands the "Command line" row of a table of pages leaves out (the row must exist)."""
    row = next((line for line in text.splitlines() if line.startswith("| [Command line](")), None)
    assert row is not None, "no '| [Command line](...)' row in the table of pages"
    return sorted(command for command in COMMANDS if f"`{command}`" not in row and
                  f"python -m recurrent_cache {command}`" not in row)


def test_every_command_a_page_names_exists():
    assert not unknown_commands(PAGES)


def test_every_command_has_a_section_in_the_command_line_page():
    assert not commands_without_a_section(PAGES["docs/cli.md"])


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_the_table_of_pages_names_every_command(page):
    assert not commands_a_table_row_misses(PAGES[page])


# -- extras --------------------------------------------------------------------------------------

def unknown_extras(pages: dict[str, str]) -> list[str]:
    known = PYPROJECT["project"]["optional-dependencies"]
    return [f"{name}: [{extra}]" for name, text in pages.items() for match in EXTRA.finditer(text)
            for extra in (match.group(1) or match.group(2)).split(",") if extra not in known]


def extras_table(text: str) -> dict[str, str]:
    """getting-started's table of extras: extra -> the row's description."""
    return {match.group(1): match.group(2)
            for match in re.finditer(r"^\| `'\.\[([\w-]+)\]'` \| (.*) \|$", text, re.M)}


def extras_table_defects(text: str) -> list[str]:
    """Extras the table lacks or does not have, and packages a row names that its extra does not install."""
    table = extras_table(text)
    known = PYPROJECT["project"]["optional-dependencies"]
    defects = [f"the table lacks [{extra}]" for extra in sorted(set(known) - set(table))]
    defects += [f"the table lists [{extra}], which pyproject.toml lacks" for extra in sorted(set(table) - set(known))]
    for extra, description in table.items():
        if extra not in known:
            continue
        for name in re.findall(r"`([a-z][a-z0-9_-]*)`", description):
            if normalized(name) not in extra_packages(extra) and name not in included_extras(extra):
                defects.append(f"[{extra}] names `{name}`, which it does not install")
    return defects


def test_every_extra_a_page_names_exists():
    assert not unknown_extras(PAGES)


def test_getting_started_lists_every_extra_with_the_packages_it_installs():
    assert not extras_table_defects(PAGES["docs/getting-started.md"])


def test_the_test_extra_leaves_torch_to_the_test_torch_extra():
    """The newcomer's install stays light; CI's torch stage installs what the test extra leaves out."""
    heavy = {"torch", "transformers", "safetensors", "tokenizers"}
    assert not extra_packages("test") & heavy
    assert extra_packages("test-torch") >= extra_packages("test") | heavy


# -- 'ggsq' / 'ggsn' versions --------------------------------------------------------------------

def sentence_around(text: str, start: int, end: int) -> str:
    """The sentence (or table cell) holding ``text[start:end]``."""
    boundary = re.compile(r"\.\s|\n\n|\|")
    before = [m.end() for m in boundary.finditer(text, 0, start)]
    after = boundary.search(text, end)
    return text[before[-1] if before else 0:after.start() if after else len(text)]


def heading_above(text: str, start: int) -> str:
    """The heading of the section holding ``text[start]`` (empty before the first)."""
    headings = re.findall(r"^#+ .*$", text[:start], re.M)
    return headings[-1] if headings else ""


def version_defects(pages: dict[str, str]) -> list[str]:
    versions = {"ggsq": {f.version for f in state_format.FILE_FORMATS if f.magic == state_format.GGSQ.magic},
                "ggsn": {f.version for f in state_format.FILE_FORMATS if f.magic == state_format.GGSN.magic}}
    current = {"ggsq": state_format.GGSQ.version, "ggsn": state_format.GGSN.version}
    defects = []
    for name, text in pages.items():
        for match in VERSION.finditer(text):
            magic, version = match.group(1), int(match.group(2))
            where = f"{name}:{text.count(chr(10), 0, match.start()) + 1}: {match.group(0)!r}"
            if version not in versions[magic]:
                defects.append(f"{where}: the code knows versions {sorted(versions[magic])}")
            elif version != current[magic] and not OLDER.search(
                    sentence_around(text, match.start(), match.end()) + heading_above(text, match.start())):
                defects.append(f"{where}: {version} is not the version written ({current[magic]}) and the "
                               "sentence (or its section) does not say it is June 2025's")
    return defects


def test_the_file_versions_the_pages_state_are_the_codes():
    assert not version_defects(PAGES)


def test_the_pages_state_the_current_versions():
    """The check above has something to check: the state page states both current versions."""
    found = {(m.group(1), int(m.group(2))) for m in VERSION.finditer(PAGES["docs/state.md"])}
    assert {("ggsq", state_format.GGSQ.version), ("ggsn", state_format.GGSN.version)} <= found


# -- the commands a newcomer runs ----------------------------------------------------------------

def opening_commands(readme: str) -> list[str]:
    """The README's first two shell blocks: the demo's command, then the tests'."""
    return [block.strip() for block in re.findall(r"^```sh\n(.*?)^```", readme, re.M | re.S)[:2]]


def command_defects(readme: str, getting_started: str, ci: str) -> list[str]:
    demo, tests = opening_commands(readme)
    defects = []
    if tests not in ci.splitlines():
        defects.append(f".ci/run's first stage is not the README's test command {tests!r}")
    blocks = re.findall(r"^```sh\n(.*?)^```", getting_started, re.M | re.S)
    if not any(tests == block.strip() for block in blocks):
        defects.append(f"getting-started does not show the README's test command {tests!r}")
    install = demo.rsplit(" && ", 1)[0]
    if not any(" && ".join(block.strip().splitlines()) == install for block in blocks):
        defects.append(f"getting-started does not install as the README does: {install!r}")
    return defects


def test_the_readmes_commands_are_getting_starteds_and_cis():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert not command_defects(PAGES["README.md"], PAGES["docs/getting-started.md"], ci)


# -- each check can fail -------------------------------------------------------------------------

def test_a_page_naming_a_missing_command_fails():
    assert unknown_commands({"p.md": "run `python -m recurrent_cache serve`"})
    assert commands_without_a_section(PAGES["docs/cli.md"].replace("## inspect", "## Inspecting"))
    row = "| [Command line](cli.md) | `demo`, `generate`, `inspect` |"
    assert commands_a_table_row_misses(row) == sorted(set(COMMANDS) - {"demo", "generate", "inspect"})


def test_a_page_naming_a_missing_extra_fails():
    assert unknown_extras({"p.md": "pip install '.[gpu]'"})
    assert unknown_extras({"p.md": "pip install 'recurrent_cache[torch,cuda]'"})
    assert unknown_extras({"p.md": "the `[tests]` extra installs it"})


def test_an_extras_table_with_a_wrong_row_fails():
    page = PAGES["docs/getting-started.md"]
    hf_row = next(line for line in page.splitlines() if line.startswith("| `'.[hf]'`"))
    assert extras_table_defects(page.replace(hf_row + "\n", "")) == ["the table lacks [hf]"]
    assert extras_table_defects(page.replace("(`matplotlib`)", "(`matplotlib`, `seaborn`)", 1))


def test_a_wrong_file_version_fails():
    written = f"'ggsq' files (magic 0x67677371, version {state_format.GGSQ_V2.version}, token count)"
    assert version_defects({"p.md": written})
    assert not version_defects({"p.md": f"June 2025's 'ggsq' files, version {state_format.GGSQ_V2.version}"})
    assert version_defects({"p.md": "'ggsn' session files version 11"})


def test_commands_out_of_step_fail():
    readme, page = PAGES["README.md"], PAGES["docs/getting-started.md"]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    tests = opening_commands(readme)[1]
    assert command_defects(readme, page, ci.replace(tests, tests.replace("pytest", "pytest -x")))
    assert command_defects(readme, page.replace(tests, tests + " -q"), ci)
    assert command_defects(readme.replace("pip install . &&", "pip install '.[demo]' &&", 1), page, ci)
