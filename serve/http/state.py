"""The one state every route and middleware of the HTTP app shares: the backend, the config and what is built
from it. build_http_app puts it on app.state; handlers reach it through the `http_state` dependency."""

from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request

from serve.config import LimitsConfig, ServeConfig
from serve.http.drain import DrainGate
from serve.http.tenant_limits import TenantGate
from serve.metrics import Metrics
from serve.store.catalog import Catalog
from serve.store.manifest import TenantEntry


@dataclass
class HttpState:
    """backend: anything with the Engine's request methods (the local Engine, or a client of a remote one),
    so the HTTP app knows nothing of Ray."""

    backend: Any
    config: ServeConfig
    gate: DrainGate
    metrics: Metrics = field(default_factory=Metrics)
    tenant_gate: TenantGate = field(init=False)
    """Each tenant's limits, kept by this ingress (serve/http/tenant_limits.py)."""
    _tenants_of: Any = field(default=(), init=False)
    """The snapshot the key maps were built from (() before the first build)."""
    _keys: dict[str, TenantEntry] = field(default_factory=dict, init=False)
    _admin_keys: dict[str, TenantEntry] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.tenant_gate = TenantGate(self.metrics)

    @property
    def catalog(self) -> Catalog | None:
        """The backend's view of the store (the Engine's or the Router's); None for a backend without one."""
        return getattr(self.backend, "catalog", None)

    def _follow_tenants(self) -> None:
        """The config's tenants, replaced by name by the store's as of the catalog's snapshot (the backend's, when
        it has one): rebuilt once per snapshot, so a tenant added on any node is served here within
        store_refresh_s."""
        snapshot = self.catalog.snapshot if self.catalog is not None else None
        if snapshot is self._tenants_of:
            return
        stored = snapshot.manifest.tenants if snapshot is not None else {}
        by_name = {t.name: t for t in self.config.tenants} | dict(stored)
        self._keys = {k: t for t in by_name.values() for k in t.key_sha256}
        self._admin_keys = {k: t for t in by_name.values() for k in t.admin_key_sha256}
        self._tenants_of = snapshot

    def tenants(self) -> dict[str, TenantEntry]:
        """Tenant by the sha256 of each of its API keys; empty: the server authenticates no one."""
        self._follow_tenants()
        return self._keys

    def tenant_admins(self) -> dict[str, TenantEntry]:
        """Tenant by the sha256 of each of its admin keys (which change only that tenant's own variants)."""
        self._follow_tenants()
        return self._admin_keys

    @property
    def limits(self) -> LimitsConfig:
        return self.config.limits


async def http_state(request: Request) -> HttpState:
    return request.app.state.http


State = Annotated[HttpState, Depends(http_state)]
"""A route's parameter `state: State` receives the app's HttpState."""
