"""Routes for operating the server: GET /healthz, /metrics (Prometheus text) and /v1/models (what the caller's
tenant may call, with kind, parent base and residency)."""

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from serve.config import TenantConfig
from serve.http import schemas as S
from serve.http.auth import tenant
from serve.http.state import State

router = APIRouter()


@router.get("/healthz")
async def healthz():
    return {"status": "ok"}


@router.get("/metrics")
async def prometheus(state: State):
    body = state.metrics.render(await state.backend.snapshots(), await state.backend.models(),
                                in_flight=state.gate.in_flight)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models", response_model=S.ModelList)
async def models(state: State, t: TenantConfig | None = Depends(tenant)):
    cards = [S.ModelCard(id=m.name, kind=m.kind, parent=m.base, residency=m.residency, labels=m.labels,
                         status=m.status)
             for m in await state.backend.models() if t is None or "*" in t.models or m.name in t.models]
    return S.ModelList(data=cards)
