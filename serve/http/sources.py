"""Where an admin may add a variant from: `admin.sources` and the store's own incoming/ folder, checked at the HTTP
boundary before the backend reads anything, so an admin key can neither probe the server's filesystem nor copy
from a place the operator did not name.

The check is lexical first (no stat, no listing: a path outside the sources is refused the same whether it exists
or not); only a path already inside is resolved, and refused if a symlink (the path's own or one inside its tree)
leads outside every source."""

import os

from serve.config import ServeConfig
from serve.errors import Forbidden
from serve.store.objects import is_url

INCOMING = "incoming"
"""The store's folder an admin may always add from (a local store's <root>/incoming/, <store url>/incoming/)."""


def sources(config: ServeConfig) -> list[str]:
    """The prefixes a variant's `path` may lie under, normalised: admin.sources, then the store's incoming/."""
    store = str(config.store)
    incoming = f"{store.rstrip('/')}/{INCOMING}" if is_url(store) else os.path.join(store, INCOMING)
    return [p for p in (normal(s) for s in [*config.admin.sources, incoming]) if p is not None]


def normal(path: str) -> str | None:
    """A source or a requested path as the check compares it, without touching the filesystem: a local path made
    absolute with its `.` and `..` resolved; file:///P as the local path P; another URL with its slashes collapsed.
    None: a path no prefix may allow (a URL with a `.` or `..` segment, a file:// URL naming a host, a NUL)."""
    if "\0" in path:
        return None
    if path.startswith("file://"):
        path = path[len("file://"):]
        if not path.startswith("/"):
            return None
    if is_url(path):
        scheme, _, rest = path.partition("://")
        parts = [p for p in rest.split("/") if p]
        if not parts or any(p in (".", "..") for p in parts):
            return None
        return f"{scheme.lower()}://{'/'.join(parts)}"
    return os.path.normpath(os.path.abspath(path))


def under(path: str, prefix: str) -> bool:
    """Whether `path` is `prefix` or inside it, by whole segments ("/data/a" is not under "/data/ab")."""
    return path == prefix or path.startswith(prefix if prefix.endswith("/") else prefix + "/")


def check_source(path: str, config: ServeConfig) -> str:
    """The path a variant may be read from (normalised, as the backend should read it), or Forbidden before
    anything is read. For a local path, once it is lexically inside a source, its real path and every symlink
    in its tree must stay inside one too."""
    allowed = sources(config)
    given = normal(path)
    if given is None or not any(under(given, p) for p in allowed):
        raise Forbidden(f"path '{path}' is not under admin.sources nor the store's {INCOMING}/ folder; nothing "
                        f"was read")
    if is_url(given):
        return given
    real = [os.path.realpath(p) for p in allowed if not is_url(p)]
    outside = _leaves(given, real)
    if outside is not None:
        raise Forbidden(f"path '{path}' leads through a symlink to '{outside}', outside admin.sources")
    return given


def _leaves(path: str, real_prefixes: list[str]) -> str | None:
    """The first real path, of `path` itself or of a symlink under it, that lies outside every prefix; None if
    none does."""
    def inside(p: str) -> bool:
        return any(under(p, prefix) for prefix in real_prefixes)

    resolved = os.path.realpath(path)
    if not inside(resolved):
        return resolved
    for folder, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            link = os.path.join(folder, name)
            if os.path.islink(link) and not inside(target := os.path.realpath(link)):
                return target
    return None
