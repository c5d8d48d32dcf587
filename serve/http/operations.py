"""Routes for operating the server: GET /healthz and /health (liveness), /readyz (readiness), /metrics (Prometheus
text) and /v1/models (what the caller's tenant may call, with kind, parent base and residency)."""

from typing import Annotated

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse, Response

from serve.errors import BadRequest
from serve.http import schemas as S
from serve.http.auth import tenant
from serve.http.state import State
from serve.store.manifest import TenantEntry

router = APIRouter()

MAX_MODELS_PAGE = 10_000
"""The largest `limit` of one /v1/models page (without `limit`, the list is whole)."""


@router.get("/healthz")
@router.get("/health")
async def healthz():
    """Liveness: this process answers (/health is vLLM's name, which its benchmark clients ask first). Whether models
    do is /readyz."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(state: State):
    """200 once every base that can run has a running replica (one Ray cannot place, or one allowed to scale to
    zero, does not hold it back); 503 until then. Either way, each base's state."""
    ready, bases = await state.backend.readiness()
    return JSONResponse({"status": "ready" if ready else "starting", "bases": bases}, status_code=200 if ready else 503)


@router.get("/metrics")
async def prometheus(state: State):
    ingresses = getattr(state.backend, "ingress_counters", None)  # a Ray app's ingresses add theirs up
    totals = await ingresses(state.metrics.counters()) if ingresses is not None else None
    body = state.metrics.render(await state.backend.snapshots(), await state.backend.models(),
                                in_flight=state.gate.in_flight, ingresses=totals)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models", response_model=S.ModelList)
async def models(state: State, t: TenantEntry | None = Depends(tenant),
                 limit: Annotated[int | None, Query(ge=1, le=MAX_MODELS_PAGE)] = None, after: str | None = None):
    """Every model the caller may call, in a stable order (bases, each followed by its variants as the store
    lists them). Without parameters, all of them (what OpenAI clients expect); `limit` and `after` page through
    them as OpenAI's cursor lists do: has_more says whether to ask again with after=last_id."""
    infos = [m for m in await state.backend.models() if t is None or t.may_call(m.name)]
    start = 0
    if after is not None:
        start = next((i + 1 for i, m in enumerate(infos) if m.name == after), None)
        if start is None:
            raise BadRequest(f"after: no model '{after}' in this list (removed since?); start again without after")
    end = len(infos) if limit is None else min(len(infos), start + limit)
    cards = [S.ModelCard.of(m) for m in infos[start:end]]
    return S.ModelList(data=cards, has_more=end < len(infos), first_id=cards[0].id if cards else None,
                       last_id=cards[-1].id if cards else None)
