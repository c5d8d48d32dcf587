"""How commands show their work on the terminal: a progress bar on stderr, tables, and sizes in bytes for people."""

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress(desc: str, total: int | None = None, unit: str = "tensor") -> Iterator[Callable[[object], None]]:
    """A tqdm bar on stderr, advanced by calling the yielded function once per item."""
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False,
              disable=None if sys.stderr.isatty() else True) as bar:
        yield lambda _name: bar.update(1)


def human_bytes(n: float | None) -> str:
    """A byte count in decimal units (KB = 1000 B), one decimal; "-" for an unknown size."""
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def table(header: list[str], rows: list[list[str]], right: frozenset[int] = frozenset()) -> list[str]:
    """The lines of a table whose columns are as wide as their widest cell, so a long name never shifts the columns
    after it; columns in `right` (numbers) align right, the last column is not padded."""
    widths = [max(map(len, column)) for column in zip(header, *rows)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(header), *map(line, rows)]
