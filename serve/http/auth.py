"""Who may call what: tenants by API key (Authorization: Bearer <key>, compared as sha256) and the admin key.

With no tenants configured every caller is served; with no admin key (the operator's, or a tenant's) the admin
routes are off."""

from dataclasses import dataclass

from fastapi import Request

from serve.config import key_digest
from serve.engine.types import Tenant
from serve.errors import Forbidden, ManyfoldError, Unauthorized
from serve.http import audit
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


@dataclass(frozen=True)
class Admin:
    """Who called an admin route: the operator (one of ServeConfig.admin_key_sha256), who may do anything, or a
    tenant by one of its admin keys, who may change only its own variants ("<tenant>-...") and no tenant."""

    key_sha256: str
    tenant: TenantEntry | None = None

    @property
    def tenant_name(self) -> str | None:
        return self.tenant.name if self.tenant is not None else None

    def may_change(self, variant: str) -> None:
        """Forbidden unless this caller may add, replace or remove the variant named `variant`."""
        if self.tenant is not None and not self.tenant.owns(variant):
            raise Forbidden(f"tenant '{self.tenant.name}' may change only its own variants, named "
                            f"'{self.tenant.name}-...'; not '{variant}'")

    def may_manage_tenants(self) -> None:
        if self.tenant is not None:
            raise Forbidden(f"only the operator's admin key may manage tenants; this key is tenant "
                            f"'{self.tenant.name}''s")


def admin(request: Request, state: State) -> Admin:
    """Dependency: the caller of an admin route, by its key; a call without a valid one is refused (and logged on
    stdout by the audit log, never in the store: it changes nothing)."""
    key = request.headers.get("authorization", "").partition(" ")[2].strip()
    digest = key_digest(key) if key else ""
    if digest and digest in state.config.admin_key_sha256:
        return Admin(digest)
    owner = state.tenant_admins().get(digest) if digest else None
    if owner is not None:
        return Admin(digest, owner)
    if not state.config.admin_key_sha256 and not state.tenant_admins():
        error: ManyfoldError = Forbidden("admin routes are disabled (no admin key configured)")
    else:
        error = Unauthorized("admin key required")
    audit.refused(request, error)
    raise error
