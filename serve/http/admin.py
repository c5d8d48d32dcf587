"""Admin routes, behind the admin key: register a variant (POST /v1/admin/variants) or remove one
(DELETE /v1/admin/variants/{name}) without a restart."""

from pathlib import Path

from fastapi import APIRouter, Depends, Request

from serve.errors import BadRequest
from serve.http import schemas as S
from serve.http.auth import admin
from serve.http.state import State

router = APIRouter()


@router.post("/v1/admin/variants", response_model=S.ModelCard, status_code=201)
async def add_variant(body: S.AddVariantRequest, request: Request, state: State, _=Depends(admin)):
    request.state.model = body.name
    if not Path(body.path).is_dir():
        raise BadRequest(f"path '{body.path}' is not a directory on the server")
    info = await state.backend.add_variant(body.name, body.base, body.path, body.kind)
    return S.ModelCard(id=info.name, kind=info.kind, parent=info.base, residency=info.residency,
                       labels=info.labels)


@router.delete("/v1/admin/variants/{name}")
async def remove_variant(name: str, request: Request, state: State, _=Depends(admin)):
    request.state.model = name
    await state.backend.remove_variant(name)
    return {"id": name, "deleted": True}
