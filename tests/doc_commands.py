"""The `manyfold ...` commands the docs show (README.md, serve/README.md, deploy/README.md), their forms, and each
form read as the CLI reads it; shared by tests/test_docs_commands.py (each one parses) and tests/test_docs_run.py
(each one that can run here runs)."""

import argparse
import functools
import re
import shlex
from pathlib import Path

from serve.cli import build_parser

ROOT = Path(__file__).parents[1]
DOCS = ("README.md", "serve/README.md", "deploy/README.md")
INLINE = re.compile(r"`(manyfold [^`]+)`")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*([=./][A-Za-z0-9_./]*)?$|^\.\.\.$")


def documented() -> list[tuple[str, str]]:
    """(where, command) of every manyfold command in the docs: inline code, and lines of code blocks (a line that
    only starts with the word, as kubectl's output of a release named manyfold does, is not a command)."""
    commands = set(subcommands(build_parser()))
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


def subcommands(parser: argparse.ArgumentParser) -> list[str]:
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


def without_options(command: str) -> str:
    """The command with every optional `[...]` part (nested ones within it) left out."""
    while (shorter := re.sub(r"\s*\[[^\[\]]*\]", "", command)) != command:
        command = shorter
    return command


def forms(command: str) -> list[str]:
    """Every form of the command worth running: its variants with the optional parts and without them, each
    once, in that order."""
    out = [" ".join(f.split()) for f in variants(command) + variants(without_options(command))]
    return list(dict.fromkeys(out))


def subparser(parser: argparse.ArgumentParser, words: list[str]) -> tuple[argparse.ArgumentParser, int]:
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
    sub, used = subparser(parser, [w for w in words if not w.startswith("-")])
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


@functools.cache
def parser() -> argparse.ArgumentParser:
    """The CLI's parser, built once."""
    return build_parser()


def command_of(form: str) -> str:
    """The command a form runs: "store add", "emr merge", ... ("" for the whole CLI)."""
    words = shlex.split(form)[1:]
    return " ".join(words[:subparser(parser(), [w for w in words if not w.startswith("-")])[1]])


def parts(form: str) -> list[tuple[str | None, tuple[str, str, str] | None]]:
    """The form past its command, in order, as (flag, slot): a flag with its value's slot (command, flag, value as
    shown), a flag that takes no value with None, a positional value with no flag."""
    words = shlex.split(form)[1:]
    sub, used = subparser(parser(), [w for w in words if not w.startswith("-")])
    takes_none = {s for a in sub._actions if a.nargs == 0 for s in a.option_strings}
    command, out, i = " ".join(words[:used]), [], used
    while i < len(words):
        w = words[i]
        if not w.startswith("--"):
            out.append((None, (command, "", w)))
        elif w in takes_none:
            out.append((w, None))
        else:
            out.append((w, (command, w, words[i + 1])))
            i += 1
        i += 1
    return out


def slots(form: str) -> list[tuple[str, str, str]]:
    """(command, flag or "", value as shown) of every value in the form."""
    return [slot for _, slot in parts(form) if slot is not None]
