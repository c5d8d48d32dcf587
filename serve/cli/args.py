"""What several command groups share: how a command is registered, and how --store and --base are resolved."""

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from serve.errors import ConfigError

if TYPE_CHECKING:
    from serve.store.view import StoreView


def add_command(parent: argparse._SubParsersAction, name: str, fn: Callable[[argparse.Namespace], None],
                help: str) -> argparse.ArgumentParser:
    """A subcommand whose help is also its description, run by `main()` through `fn`."""
    sp = parent.add_parser(name, help=help, description=help)
    sp.set_defaults(fn=fn)
    return sp


def default_store() -> str | None:
    """$MANYFOLD_STORE, read when the parser is built: --store may then be left out."""
    return os.environ.get("MANYFOLD_STORE")


def open_store(args: argparse.Namespace, create: bool = False) -> "StoreView":
    """The store at --store (a directory, or an s3://, gs://, ... URL), imported late so that `manyfold --help`
    stays quick."""
    from serve.store.store import open_store as open_location

    return open_location(args.store, create=create)


def base_dir(args: argparse.Namespace) -> Path:
    """--base as a HF model directory, or as the name of a base in --store."""
    if Path(args.base).is_dir():
        return Path(args.base)
    if not args.store:
        raise ConfigError(f"--base '{args.base}' is not a directory (give --store to name a store base)")
    return open_store(args).base_dir(args.base)
