"""Debian's fortunes: found installed system-wide or unpacked into the cache; fetched without root by
`apt-get download`-ing the packages and unpacking them into the cache (`python -m serve.data.fortunes --fetch`)."""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from serve.data.cache import home
from serve.errors import ArtifactError

PACKAGES = ("fortunes", "fortunes-min")
FORTUNES_DIRS = [Path("/usr/share/games/fortunes")]
"""Where an installed `fortunes` package keeps them."""


def unpacked_dir() -> Path:
    """Where `fetch` unpacks them: the packages' own layout under the cache."""
    return home() / "debian" / "usr" / "share" / "games" / "fortunes"


def _found() -> Path | None:
    """The first place that holds them (their .dat indexes included), or None."""
    for d in [*FORTUNES_DIRS, unpacked_dir()]:
        if d.is_dir() and any(d.glob("*.dat")):
            return d
    return None


def fortunes_dir() -> Path:
    """Debian's fortunes: installed system-wide, or unpacked by `python -m serve.data.fortunes --fetch`."""
    d = _found()
    if d is None:
        raise ArtifactError("Debian fortunes not found (run `make setup` or apt-get install fortunes)")
    return d


def fetch() -> Path:
    """Fetch Debian's fortunes without root: `apt-get download` the packages, unpack them into the cache."""
    d = _found()
    if d is not None:
        return d
    root = unpacked_dir().parents[3]
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["apt-get", "download", *PACKAGES]
        if subprocess.run(cmd, cwd=tmp, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
            subprocess.run(cmd, cwd=tmp, check=True, capture_output=True)
        for deb in Path(tmp).glob("*.deb"):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return unpacked_dir()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=fetch.__doc__)
    parser.add_argument("--fetch", action="store_true", required=True)
    parser.parse_args()
    try:
        print(f"fortunes: {fetch()}")
    except (OSError, subprocess.CalledProcessError) as e:
        sys.exit(f"fortunes: could not fetch Debian's fortunes ({e})")
