"""Admin routes, behind the admin key: register a variant (POST /v1/admin/variants) or many at once
(POST /v1/admin/variants:batch), or remove one (DELETE /v1/admin/variants/{name}), without a restart."""

from pathlib import Path

from fastapi import APIRouter, Depends, Request, Response

from serve.errors import BadRequest, ManyfoldError
from serve.http import schemas as S
from serve.http.auth import admin
from serve.http.errors import manyfold_message
from serve.http.state import State
from serve.store.objects import is_url

router = APIRouter()


@router.post("/v1/admin/variants", response_model=S.ModelCard, status_code=201)
async def add_variant(body: S.AddVariantRequest, request: Request, state: State, _=Depends(admin)):
    request.state.model = body.name
    if not is_url(body.path) and not Path(body.path).is_dir():
        raise BadRequest(f"path '{body.path}' is not a directory on the server (nor an s3://, gs:// ... URL)")
    return S.ModelCard.of(await state.backend.add_variant(body.name, body.base, body.path, body.kind))


@router.post("/v1/admin/variants:batch", response_model=S.AddVariantsResponse, status_code=201)
async def add_variants(body: S.AddVariantsRequest, request: Request, response: Response, state: State,
                       _=Depends(admin)):
    """Register many variants in one call (thousands of tenants' adapters): each base's items are validated and
    stored by one of its replicas, the store's manifest written once per base and kind, not once per item.

    201: every item was added. 207 (Multi-Status): at least one was not; the others were, and stay added. Either
    way `data` has one entry per item, in order, with its own `status` (201, or what POST /v1/admin/variants
    would have answered for it alone: 400 for a name taken or given twice in the batch, 404 for an unknown base,
    422 for an adapter that does not fit) and its `model` card or its `error`. A malformed body, or more than
    MAX_BATCH_VARIANTS items, is one 422 for the whole request, and nothing is added."""
    items = [(v.name, v.base, v.path, v.kind) for v in body.variants]
    outcomes = await state.backend.add_variants(items)
    data = [_outcome(request, v.name, o) for v, o in zip(body.variants, outcomes)]
    if any(d.error is not None for d in data):
        response.status_code = 207
    return S.AddVariantsResponse(data=data)


def _outcome(request: Request, name: str, outcome) -> S.AddVariantOutcome:
    if not isinstance(outcome, ManyfoldError):
        return S.AddVariantOutcome(name=name, status=201, model=S.ModelCard.of(outcome))
    error = S.ErrorDetail(message=manyfold_message(request, outcome), type=outcome.code, code=outcome.code)
    return S.AddVariantOutcome(name=name, status=outcome.http_status, error=error)


@router.delete("/v1/admin/variants/{name}")
async def remove_variant(name: str, request: Request, state: State, _=Depends(admin)):
    request.state.model = name
    await state.backend.remove_variant(name)
    return {"id": name, "deleted": True}
