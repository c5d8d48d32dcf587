"""Typed errors. Each carries a stable `code` and the HTTP status the API layer maps it to."""

import re

_UNION_TAG = re.compile(r"^(str|int|float|bool|none|[a-z-]+\[.*\]|constrained-[a-z]+|function-[a-z]+.*)$")
_RAISED_PREFIX = {"value_error": "Value error, ", "assertion_error": "Assertion failed, "}
"""What pydantic puts before the message of an error a validator raised: the message already says it all."""


def first_error(e, skip: tuple[str, ...] = ()) -> str:
    """The first problem of a pydantic (or FastAPI request) validation error as 'loc: msg', one line. Of a
    union's alternatives the one that got furthest speaks ("stop: List should have at most 4 items ... not 5",
    not "Input should be a valid string"), and the alternatives' tags stay out of the location."""
    errors = e.errors()
    err = next((x for x in errors if not x["type"].endswith("_type")), errors[0])
    loc = ".".join(str(p) for p in err["loc"] if p not in skip and not (isinstance(p, str) and _UNION_TAG.match(p)))
    msg = err["msg"].removeprefix(_RAISED_PREFIX.get(err["type"], ""))
    return f"{loc}: {msg}" if loc else msg


class ManyfoldError(Exception):
    """Base of every error Manyfold raises on purpose; its message is one line for a user."""

    code = "manyfold_error"
    http_status = 500


class ConfigError(ManyfoldError):
    code = "config_error"
    http_status = 500


class StoreUnreachable(ManyfoldError):
    """The store's object storage cannot be used as configured: a bucket that does not exist, a request it denies,
    an endpoint that does not answer."""

    code = "store_unreachable"
    http_status = 503


class ArtifactError(ManyfoldError):
    """A file on disk is missing, truncated, corrupt or does not match what it claims."""

    code = "artifact_error"
    http_status = 500


class VariantNotFound(ManyfoldError):
    code = "variant_not_found"
    http_status = 404


class VariantIncompatible(ManyfoldError):
    """A variant does not fit the base it is applied to (wrong base, shape mismatch)."""

    code = "variant_incompatible"
    http_status = 422


class CapacityExceeded(ManyfoldError):
    code = "capacity_exceeded"
    http_status = 503


class RowFailed(ManyfoldError):
    """Serving one request's rows raised something unexpected (a device error, a bug): the message names the model
    and the stage; the traceback is in the replica's log. Only the rows that step touched fail."""

    code = "internal_error"
    http_status = 500


class Unavailable(ManyfoldError):
    """The model's base is not running (its deployment cannot be scheduled, or is starting)."""

    code = "unavailable"
    http_status = 503
    retry_after_s = 5


class ReplicaLost(Unavailable):
    """The base's replica that held the request went away (its actor, worker or node) before it answered in full;
    another replica, or the one Serve starts in its place, can take it again."""

    retry_after_s = 1


class Overloaded(ManyfoldError):
    """The queue is full; the client should retry after `retry_after_s`."""

    code = "overloaded"
    http_status = 429
    retry_after_s = 1


class RateLimited(ManyfoldError):
    """A tenant is past one of its limits (serve/http/tenant_limits.py): the message names the limit and its value;
    Retry-After says when the request would be admitted."""

    code = "rate_limited"
    http_status = 429

    def __init__(self, message: str, retry_after_s: float, limit: str):
        super().__init__(message)
        self.retry_after_s = max(1, int(retry_after_s + 0.999))
        self.limit = limit


class TenantNotFound(ManyfoldError):
    code = "tenant_not_found"
    http_status = 404


class BadRequest(ManyfoldError):
    code = "bad_request"
    http_status = 400


class Unauthorized(ManyfoldError):
    code = "unauthorized"
    http_status = 401


class Forbidden(ManyfoldError):
    code = "forbidden"
    http_status = 403


class TooLarge(ManyfoldError):
    code = "request_too_large"
    http_status = 413


class BatchIncomplete(ManyfoldError):
    """Some items of a batch were not added (each reported by name, with why); the others were."""

    code = "batch_incomplete"
    http_status = 422


class ClientGone(ManyfoldError):
    """The client closed the request before its answer: nothing to send, not a server error."""

    code = "client_closed_request"
    http_status = 499


class SourceTooLarge(ManyfoldError):
    """A variant's source holds more than one add may copy (admin.max_add_mib); nothing of it was copied."""

    code = "source_too_large"
    http_status = 413
