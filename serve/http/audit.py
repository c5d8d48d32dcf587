"""The admin audit log: one JSON line per admin change, made or refused, on stdout (the "manyfold.audit" logger)
and in the store (StoreView.append_audit, through the backend's catalog), so every node's changes are read in one
place. A line the store cannot take is logged and the change already made stands.

    {"time": "2025-01-01T12:00:00.123Z", "key": "3f2a9c01b4d2", "tenant": "acme" | null, "route": "POST /v1/...",
     "name": "acme-sql", "revision": "9c01..." | null, "outcome": {"status": 201, "error": null | "forbidden"}}

`key` is the first 12 hex characters of the sha256 of the key used (never the key); `tenant` is null for the
operator's key. A caller with no valid admin key changes nothing and is logged on stdout only: it cannot make
the store write."""

import json
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from fastapi import Request

from serve.config import key_digest
from serve.errors import ManyfoldError
from serve.http.state import HttpState

log = logging.getLogger("manyfold.audit")
KEY_PREFIX = 12
"""Hex characters of the key's digest a line keeps: enough to tell keys apart, too few to stand for one."""


class _Stdout(logging.Handler):
    """Each line as it is, on the process's stdout of the moment."""

    def emit(self, record: logging.LogRecord) -> None:
        sys.stdout.write(record.getMessage() + "\n")
        sys.stdout.flush()


if not any(isinstance(h, _Stdout) for h in log.handlers):
    log.addHandler(_Stdout())
    log.setLevel(logging.INFO)
    log.propagate = False


class Caller(Protocol):
    """Who made a change (serve/http/auth.py Admin)."""

    key_sha256: str

    @property
    def tenant_name(self) -> str | None: ...


@dataclass
class Change:
    """What one admin change came to, filled in by its route: the outcome of a refusal is the error's."""

    route: str
    name: str
    status: int = 200
    revision: str | None = None
    error: str | None = None


def line(caller_key_sha256: str | None, tenant: str | None, change: Change) -> dict:
    return {"time": datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "key": caller_key_sha256[:KEY_PREFIX] if caller_key_sha256 else None, "tenant": tenant,
            "route": change.route, "name": change.name, "revision": change.revision,
            "outcome": {"status": change.status, "error": change.error}}


async def record(state: HttpState, caller: Caller, change: Change) -> None:
    """Log the change's line and keep it in the store; a store that refuses it costs a warning, not the answer."""
    entry = line(caller.key_sha256, caller.tenant_name, change)
    log.info(json.dumps(entry, separators=(",", ":")))
    if state.catalog is None:
        return
    try:
        await state.catalog.append_audit(entry)
    except Exception as e:  # noqa: BLE001  (the change is made; its record on stdout stands)
        logging.getLogger("manyfold.http").warning("audit line for %s %s not kept in the store: %s", change.route,
                                                   change.name, str(e).splitlines()[0] if str(e) else type(e).__name__)


@asynccontextmanager
async def audited(state: HttpState, caller: Caller, route: str, name: str) -> AsyncIterator[Change]:
    """Around one change: its line is recorded however the block ends (a ManyfoldError is its refusal, anything
    else a 500), and the error goes on to the handler."""
    change = Change(route, name)
    try:
        yield change
    except ManyfoldError as e:
        change.status, change.error = e.http_status, e.code
        raise
    except Exception:
        change.status, change.error = 500, "internal_error"
        raise
    finally:
        await record(state, caller, change)


def refused(request: Request, error: ManyfoldError) -> None:
    """A call that carried no valid admin key: on stdout only."""
    key = request.headers.get("authorization", "").partition(" ")[2].strip()
    change = Change(f"{request.method} {request.url.path}", request.path_params.get("name", ""),
                    error.http_status, None, error.code)
    log.info(json.dumps(line(key_digest(key) if key else None, None, change), separators=(",", ":")))
