"""The one state every route and middleware of the HTTP app shares: the backend, the config and what is built
from it. build_http_app puts it on app.state; handlers reach it through the `http_state` dependency."""

from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request

from serve.config import LimitsConfig, ServeConfig, TenantConfig
from serve.http.drain import DrainGate
from serve.metrics import Metrics


@dataclass
class HttpState:
    """backend: anything with the Engine's request methods (the local Engine, or a client of a remote one),
    so the HTTP app knows nothing of Ray."""

    backend: Any
    config: ServeConfig
    gate: DrainGate
    metrics: Metrics = field(default_factory=Metrics)
    tenants: dict[str, TenantConfig] = field(init=False)
    """Tenant by the sha256 of each of its keys."""

    def __post_init__(self) -> None:
        self.tenants = {k: t for t in self.config.tenants for k in t.key_sha256}

    @property
    def limits(self) -> LimitsConfig:
        return self.config.limits


async def http_state(request: Request) -> HttpState:
    return request.app.state.http


State = Annotated[HttpState, Depends(http_state)]
"""A route's parameter `state: State` receives the app's HttpState."""
