"""Admin routes, behind an admin key (auth.py `admin`): register a variant (POST /v1/admin/variants) or many at once
(POST /v1/admin/variants:batch), or remove one (DELETE /v1/admin/variants/{name}), without a restart; add, list,
read and remove tenants (/v1/admin/tenants), kept in the store so that every node follows them.

A variant's `path` must lie under admin.sources (sources.py), checked before anything is read; a tenant's admin key
changes only that tenant's own variants. Every change, made or refused, is one line of the audit log (audit.py)."""

from pathlib import Path

from fastapi import APIRouter, Depends, Request, Response

from serve.errors import BadRequest, ManyfoldError, TenantNotFound
from serve.http import schemas as S
from serve.http.audit import Change, audited, record
from serve.http.auth import Admin, admin
from serve.http.errors import manyfold_message
from serve.http.sources import check_source
from serve.http.state import HttpState, State
from serve.store.manifest import TenantEntry
from serve.store.objects import is_url

router = APIRouter()
VARIANTS = "/v1/admin/variants"
TENANTS = "/v1/admin/tenants"


def _revision(state: HttpState, name: str) -> str | None:
    """The revision of the variant entry `name` in the backend's newest snapshot (None: it has none)."""
    entry = state.catalog.snapshot.manifest.variants.get(name) if state.catalog is not None else None
    return entry.revision if entry is not None else None


@router.post(VARIANTS, response_model=S.ModelCard, status_code=201)
async def add_variant(body: S.AddVariantRequest, request: Request, state: State, caller: Admin = Depends(admin)):
    request.state.model = body.name
    async with audited(state, caller, f"POST {VARIANTS}", body.name) as change:
        caller.may_change(body.name)
        path = check_source(body.path, state.config)
        if not is_url(path) and not Path(path).is_dir():
            raise BadRequest(f"path '{body.path}' is not a directory on the server (nor an s3://, gs:// ... URL)")
        info = await state.backend.add_variant(body.name, body.base, path, body.kind)
        change.status, change.revision = 201, _revision(state, body.name)
    return S.ModelCard.of(info)


@router.post(f"{VARIANTS}:batch", response_model=S.AddVariantsResponse, status_code=201)
async def add_variants(body: S.AddVariantsRequest, request: Request, response: Response, state: State,
                       caller: Admin = Depends(admin)):
    """Register many variants in one call (thousands of tenants' adapters): each base's items are validated and
    stored by one of its replicas, the store's manifest written once per base and kind, not once per item.

    201: every item was added. 207 (Multi-Status): at least one was not; the others were, and stay added. Either
    way `data` has one entry per item, in order, with its own `status` (201, or what POST /v1/admin/variants
    would have answered for it alone: 400 for a name taken or given twice in the batch, 403 for a name the
    caller may not change or a path outside admin.sources, 404 for an unknown base, 422 for an adapter that does
    not fit) and its `model` card or its `error`. A malformed body, or more than MAX_BATCH_VARIANTS items, is one
    422 for the whole request, and nothing is added. Each item is one line of the audit log."""
    outcomes: list = [None] * len(body.variants)
    todo: list[tuple[int, tuple[str, str, str, str]]] = []
    for i, v in enumerate(body.variants):
        try:
            caller.may_change(v.name)
            todo.append((i, (v.name, v.base, check_source(v.path, state.config), v.kind)))
        except ManyfoldError as e:
            outcomes[i] = e
    try:
        added = await state.backend.add_variants([item for _, item in todo]) if todo else []
    except Exception as e:
        for i, _ in todo:
            outcomes[i] = e
        await _record_batch(state, caller, body, outcomes)
        raise
    for (i, _), outcome in zip(todo, added):
        outcomes[i] = outcome
    await _record_batch(state, caller, body, outcomes)
    data = [_outcome(request, v.name, o) for v, o in zip(body.variants, outcomes)]
    if any(d.error is not None for d in data):
        response.status_code = 207
    return S.AddVariantsResponse(data=data)


async def _record_batch(state: HttpState, caller: Admin, body: S.AddVariantsRequest, outcomes: list) -> None:
    for v, o in zip(body.variants, outcomes):
        change = Change(f"POST {VARIANTS}:batch", v.name)
        if isinstance(o, ManyfoldError):
            change.status, change.error = o.http_status, o.code
        elif isinstance(o, Exception):
            change.status, change.error = 500, "internal_error"
        else:
            change.status, change.revision = 201, _revision(state, v.name)
        await record(state, caller, change)


def _outcome(request: Request, name: str, outcome) -> S.AddVariantOutcome:
    if not isinstance(outcome, ManyfoldError):
        return S.AddVariantOutcome(name=name, status=201, model=S.ModelCard.of(outcome))
    error = S.ErrorDetail(message=manyfold_message(request, outcome), type=outcome.code, code=outcome.code)
    return S.AddVariantOutcome(name=name, status=outcome.http_status, error=error)


@router.delete(VARIANTS + "/{name}")
async def remove_variant(name: str, request: Request, state: State, caller: Admin = Depends(admin)):
    request.state.model = name
    async with audited(state, caller, f"DELETE {VARIANTS}", name):
        caller.may_change(name)
        await state.backend.remove_variant(name)
    return {"id": name, "deleted": True}


# ---- tenants: the operator's key only
def _tenants(state: HttpState) -> dict[str, S.TenantCard]:
    """Every tenant served, by name: the config's, replaced by the store's of the same name."""
    stored = state.backend.catalog.snapshot.manifest.tenants
    cards = {t.name: S.TenantCard(tenant=t, source="config", revision=t.revision) for t in state.config.tenants}
    return cards | {n: S.TenantCard(tenant=t, source="store", revision=t.revision) for n, t in stored.items()}


def _check_keys(state: HttpState, entry: TenantEntry) -> None:
    """A key names one caller: none of the tenant's may be the operator's, nor another config tenant's (the store
    refuses another stored tenant's itself)."""
    keys = set(entry.key_sha256) | set(entry.admin_key_sha256)
    if keys & set(state.config.admin_key_sha256):
        raise BadRequest(f"a key of tenant '{entry.name}' is the operator's admin key")
    for other in state.config.tenants:
        if other.name != entry.name and keys & (set(other.key_sha256) | set(other.admin_key_sha256)):
            raise BadRequest(f"a key of tenant '{entry.name}' is already a key of tenant '{other.name}'")


@router.post(TENANTS, response_model=S.TenantCard, status_code=201)
async def put_tenant(body: S.TenantRequest, response: Response, state: State, caller: Admin = Depends(admin)):
    """Add a tenant (201) or replace the one of its name (200), in the store: every ingress on every node serves
    it within store_refresh_s, this one at once."""
    entry = TenantEntry(**body.model_dump())
    async with audited(state, caller, f"POST {TENANTS}", entry.name) as change:
        caller.may_manage_tenants()
        _check_keys(state, entry)
        replaced = await state.backend.catalog.write(lambda store: store.put_tenant(entry))
        change.status, change.revision = (200 if replaced else 201), entry.revision
    response.status_code = change.status
    return S.TenantCard(tenant=entry, source="store", revision=entry.revision)


@router.get(TENANTS, response_model=S.TenantList)
async def list_tenants(state: State, caller: Admin = Depends(admin)):
    caller.may_manage_tenants()
    return S.TenantList(data=sorted(_tenants(state).values(), key=lambda c: c.tenant.name))


@router.get(TENANTS + "/{name}", response_model=S.TenantCard)
async def get_tenant(name: str, state: State, caller: Admin = Depends(admin)):
    caller.may_manage_tenants()
    card = _tenants(state).get(name)
    if card is None:
        raise TenantNotFound(f"no tenant '{name}'")
    return card


@router.delete(TENANTS + "/{name}")
async def remove_tenant(name: str, state: State, caller: Admin = Depends(admin)):
    """Remove a tenant added at run time: its keys stop working on every node within store_refresh_s (a config
    file's tenant of its name, if any, is served again)."""
    async with audited(state, caller, f"DELETE {TENANTS}", name):
        caller.may_manage_tenants()
        if name not in state.backend.catalog.snapshot.manifest.tenants and \
                any(t.name == name for t in state.config.tenants):
            raise BadRequest(f"tenant '{name}' is in the config file; remove it there")
        await state.backend.catalog.write(lambda store: store.remove_tenant(name))
    return {"id": name, "object": "tenant", "deleted": True}
