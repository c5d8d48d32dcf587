"""Every `manyfold ...` command the docs show (README.md, serve/README.md, deploy/README.md) is one the CLI takes
as written: its command exists and takes every flag shown, with the value shown where it is a value (a placeholder
such as DIR or N stands for any value of the flag's type; `a|b` alternatives are tried each; optional `[...]`
parts are checked too). What they do is tested through the CLI where they can run here (tests/test_cli.py, the
server, fleet and demo tests); this test keeps the docs from naming a command, a flag or a value that is not there.
"""

import argparse
import re
import shlex
from pathlib import Path

import pytest

from serve.cli import build_parser

ROOT = Path(__file__).parents[1]
DOCS = ("README.md", "serve/README.md", "deploy/README.md")
INLINE = re.compile(r"`(manyfold [^`]+)`")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*([=./][A-Za-z0-9_./]*)?$|^\.\.\.$")


def documented() -> list[tuple[str, str]]:
    """(where, command) of every manyfold command in the docs: inline code, and lines of code blocks (a line that
    only starts with the word, as kubectl's output of a release named manyfold does, is not a command)."""
    commands = set(_subcommands(build_parser()))
    out = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        out += [(doc, re.sub(r"\s*\\?\|\s*", "|", m)) for m in INLINE.findall(text)]
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.DOTALL):
            for line in block.replace("\\\n", " ").splitlines():
                words = line.strip().lstrip("$ ").split(" #")[0].split()
                if len(words) > 1 and words[0] == "manyfold" and (words[1] in commands or words[1][0] == "-"):
                    out.append((doc, " ".join(words)))
    return sorted(set(out))


def _subcommands(parser: argparse.ArgumentParser) -> list[str]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices)


def variants(command: str) -> list[str]:
    """The command with each `a|b` group taken one alternative at a time (the first of the others), brackets
    dropped: every alternative gets checked without multiplying the cases."""
    flat = command.replace("[", " ").replace("]", " ")
    groups = [t for t in flat.split() if "|" in t and not t.startswith(("'", '"'))]
    if not groups:
        return [flat]
    out = []
    for g in groups:
        for alt in g.split("|"):
            out.append(" ".join(alt if t == g else t.split("|")[0] for t in flat.split()))
    return out


def _subparser(parser: argparse.ArgumentParser, words: list[str]) -> tuple[argparse.ArgumentParser, int]:
    """The parser of the command the words name, and how many words named it."""
    used = 0
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or used >= len(words) or words[used] not in sub.choices:
            return parser, used
        parser = sub.choices[words[used]]
        used += 1


def _value(action: argparse.Action, shown: str) -> str:
    """The value shown, or a value of the flag's type where the docs show a placeholder."""
    if action.choices is not None:
        return shown if shown in [str(c) for c in action.choices] else str(next(iter(action.choices)))
    if PLACEHOLDER.match(shown) and action.type in (int, float):
        return "1"
    return shown


def argv_of(command: str, parser: argparse.ArgumentParser) -> list[str] | None:
    """The command as argv: placeholders made values of their flags' types, a flag shown without its value (or
    with "...") given one, and any required flag the docs leave to "..." given a value, so that the rest of what
    they show is checked. None: a mention of a whole group ("manyfold bench ..."), not a command."""
    words = shlex.split(command)[1:]
    sub, used = _subparser(parser, [w for w in words if not w.startswith("-")])
    if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
        return None
    options = {s: a for a in sub._actions for s in a.option_strings}
    argv, i = words[:used], used
    while i < len(words):
        w = words[i]
        action = options.get(w.split("=")[0])
        value = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else None
        if w == "...":
            pass
        elif action is None or action.nargs == 0:
            argv.append(w)  # a positional (or a flag the parser does not know: it fails below, as it should)
        else:
            argv += [w, _value(action, value if value not in (None, "...") else "X")]
            i += value is not None
        i += 1
    for a in sub._actions:
        if a.required and a.option_strings and not set(a.option_strings) & set(argv):
            argv += [a.option_strings[0], _value(a, "X")]
    return argv


@pytest.mark.parametrize("where,command", documented(), ids=lambda x: x if len(x) < 80 else x[:77] + "...")
def test_a_documented_command_is_one_the_cli_takes(where, command):
    parser = build_parser()
    for form in variants(command):
        argv = argv_of(form, parser)
        if argv is None:
            continue
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{where}: `{form}` does not parse as argv {argv}")
        assert callable(getattr(args, "fn", None)), f"{where}: `{form}` names no command"


def test_the_docs_show_commands():
    """The extraction finds the docs' commands (a change of their markup would otherwise pass silently)."""
    commands = [c for _, c in documented()]
    assert len(commands) >= 40
    assert any(c.startswith("manyfold serve --store") for c in commands)
    assert any("s3://" in c for c in commands)
