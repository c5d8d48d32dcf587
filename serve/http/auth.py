"""Who may call what: tenants by API key (Authorization: Bearer <key>, compared as sha256) and the admin key.

With no tenants configured every caller is served; with no admin key the admin routes are off."""

from fastapi import Request

from serve.config import key_digest
from serve.engine.types import Tenant
from serve.errors import Forbidden, Unauthorized
from serve.http.state import State
from serve.store.manifest import TenantEntry


def tenant(request: Request, state: State) -> TenantEntry | None:
    """Dependency: the caller's tenant, or None when the server has no tenants."""
    tenants = state.tenants()
    if not tenants:
        return None
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key:
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    t = tenants.get(key_digest(key.strip()))
    if t is None:
        raise Unauthorized("invalid API key")
    request.state.tenant = t.name
    return t


def share(t: TenantEntry | None) -> Tenant | None:
    """The tenant as the engine orders its rows (None: the engine takes the model as the tenant)."""
    return Tenant(t.name, t.weight) if t is not None else None


def allow(request: Request, t: TenantEntry | None, model: str) -> None:
    """Names the request's model (for metrics and logs), then refuses it if the tenant may not call it."""
    request.state.model = model
    if t is not None and not t.may_call(model):
        raise Forbidden(f"tenant '{t.name}' may not call model '{model}'")


def admin(request: Request, state: State) -> None:
    """Dependency: refuses unless the request carries one of the configured admin keys."""
    header = request.headers.get("authorization", "")
    key = header.partition(" ")[2].strip()
    if not state.config.admin_key_sha256:
        raise Forbidden("admin routes are disabled (no admin key configured)")
    if not key or key_digest(key) not in state.config.admin_key_sha256:
        raise Unauthorized("admin key required")
