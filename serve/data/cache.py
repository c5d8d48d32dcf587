"""Manyfold's cache ($MANYFOLD_HOME): where converted models, the demo store and unpacked Debian data live."""

import os
from pathlib import Path


def home() -> Path:
    """Manyfold's cache: converted models, the demo store, unpacked Debian data."""
    return Path(os.environ.get("MANYFOLD_HOME", Path.home() / ".cache" / "manyfold"))
