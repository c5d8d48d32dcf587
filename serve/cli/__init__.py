"""`manyfold`: the command line. Every failure is one line on stderr and a non-zero exit (2 for usage).

Each command group builds its own subparsers in its module (server, codecs, store, adapters, bench);
this one assembles them and runs the command chosen.
"""

import argparse
import os
import sys

from serve.cli.adapters import add_adapter_commands, add_translora_command
from serve.cli.args import default_store
from serve.cli.bench import add_bench_commands
from serve.cli.codecs import add_emr_commands, add_fmdelta_commands, add_neuzip_commands
from serve.cli.server import add_demo_command, add_serve_command
from serve.cli.store import add_store_commands
from serve.errors import ConfigError, ManyfoldError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def build_parser() -> argparse.ArgumentParser:
    """Every command, in the order `manyfold --help` lists them."""
    p = argparse.ArgumentParser(prog="manyfold", description="Serve many fine-tuned variants of one base model.")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True)
    store = default_store()
    add_demo_command(sub)
    add_serve_command(sub)
    add_fmdelta_commands(sub)
    add_neuzip_commands(sub)
    add_store_commands(sub, store)
    add_adapter_commands(sub, store)
    add_translora_command(sub)
    add_emr_commands(sub, store)
    add_bench_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; a ManyfoldError exits 2 if it is a ConfigError, 1 otherwise (the traceback with --debug)."""
    args = build_parser().parse_args(argv)
    try:
        args.fn(args)
    except ManyfoldError as e:
        if args.debug:
            raise
        print(f"manyfold: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    except KeyboardInterrupt:
        print("manyfold: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one line for the user; the traceback with --debug
        if args.debug:
            raise
        print(f"manyfold: error: internal error: {type(e).__name__}: {e} (run with --debug for details)",
              file=sys.stderr)
        return 1
    return 0
