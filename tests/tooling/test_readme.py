"""The README's Python examples run as written (against the installed package), and its
``python -m recurrent_cache`` commands are accepted by the command line."""

import importlib
import re
import shlex
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


@pytest.mark.parametrize("code", EXAMPLES, ids=[f"example{i}" for i in range(len(EXAMPLES))])
def test_readme_example_runs(code, capsys):
    exec(compile(code, str(README), "exec"), {})
    assert capsys.readouterr().out  # every example prints what it did


def documented_commands() -> list[list[str]]:
    """``python -m recurrent_cache SUBCOMMAND ARGS`` in the README's code blocks, as argument lists
    (a shell prompt, comments, pipes and redirections cut off)."""
    commands, fenced = [], False
    for line in README.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced and "-m recurrent_cache " in line:
            words = shlex.split(line.split("-m recurrent_cache ", 1)[1], comments=True)
            cut = [i for i, word in enumerate(words) if word in {"|", ">", "2>", "&&", ";"}]
            commands.append(words[:cut[0]] if cut else words)
    return commands


COMMANDS = documented_commands()


@pytest.mark.parametrize("words", COMMANDS, ids=[" ".join(words) for words in COMMANDS])
def test_readme_command_is_accepted_as_written(words):
    """Every documented command line names a subcommand and options it accepts together."""
    from recurrent_cache import cli
    assert words[0] in cli.COMMANDS
    importlib.import_module(cli.COMMANDS[words[0]][0]).parse_args(words[1:])
