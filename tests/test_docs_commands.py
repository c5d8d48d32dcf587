"""Every `manyfold ...` command the docs show (README.md, serve/README.md, deploy/README.md) is one the CLI takes
as written: its command exists and takes every flag shown, with the value shown where it is a value (a placeholder
such as DIR or N stands for any value of the flag's type; `a|b` alternatives are tried each; optional `[...]`
parts are checked, with and without). What they do is tested through the CLI where they can run here
(tests/test_docs_run.py runs each one that can, and says where the others are tested); this test keeps the docs from
naming a command, a flag or a value that is not there.
"""

import pytest

from serve.cli import build_parser
from tests.doc_commands import argv_of, documented, forms


@pytest.mark.parametrize("where,command", documented(), ids=lambda x: x if len(x) < 80 else x[:77] + "...")
def test_a_documented_command_is_one_the_cli_takes(where, command):
    parser = build_parser()
    for form in forms(command):
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
