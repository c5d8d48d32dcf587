"""Fetch Debian's fortunes without root: `apt-get download` the packages, unpack them into the cache."""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGES = ("fortunes", "fortunes-min")


def unpacked_dir() -> Path:
    from serve.data.datasets import home

    return home() / "debian" / "usr" / "share" / "games" / "fortunes"


def fetch() -> Path:
    from serve.data.datasets import FORTUNES_DIRS

    for d in [*FORTUNES_DIRS, unpacked_dir()]:
        if d.is_dir() and any(d.glob("*.dat")):
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
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fetch", action="store_true", required=True)
    parser.parse_args()
    try:
        print(f"fortunes: {fetch()}")
    except (OSError, subprocess.CalledProcessError) as e:
        sys.exit(f"fortunes: could not fetch Debian's fortunes ({e})")
