"""The store's manifest: one versioned JSON file listing bases and variants with their files and digests."""

import hashlib
import sys
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (BaseModel, ConfigDict, Field, SerializeAsAny, StringConstraints, TypeAdapter,
                      ValidationError, field_validator, model_validator)
from pydantic_core import PydanticCustomError, from_json

from serve.errors import ArtifactError, BadRequest, first_error
from serve.store.writer import atomic_write

MANIFEST = "manifest.json"
VERSION = 1
Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
"""Names become directory names and HTTP `model` values: no slashes, no leading dot, 64 chars at most."""
_NAME = TypeAdapter(Name)


def check_name(name: str) -> str:
    """A name the manifest takes, or BadRequest saying the rule (pydantic's pattern error names no rule)."""
    try:
        return _NAME.validate_python(name)
    except ValidationError:
        raise BadRequest(f"'{name}' is not a valid name: letters, digits, '.', '_' and '-', starting with a letter "
                         f"or digit, 64 characters at most") from None


Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class StrictModel(BaseModel):
    """Schemas of files Manyfold reads: unknown fields and type coercions are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


REVISION_SEP = "@"
"""Between an entry's name and its revision in a key ("support@3f2a..."); no Name contains it."""
MEMBER_SEP = "/"
"""Between an EMR group's name and its task's in a model id ("support/sentiment"); no Name contains it."""


class FileEntry(StrictModel):
    path: str
    """Relative to the store root."""
    bytes: Annotated[int, Field(ge=0)]
    sha256: Sha256


class BaseEntry(StrictModel):
    kind: Literal["base"] = "base"
    name: Name
    architecture: str
    """The HF architecture of the stored model (config.json `architectures[0]`)."""
    params: int
    fingerprint: Sha256
    """serve.store.tensors.fingerprint of its weights: what FM-Delta files are checked against."""
    files: list[FileEntry]
    neuzip_bits: Literal[0, 1, 3, 7] | None = None
    """Served in NeuZip form with this many mantissa bits (its weights stay stored lossless beside it)."""


class FormCandidate(StrictModel):
    """One form `store add --kind auto` weighed: its bytes and, where measured, its agreement."""

    form: str
    """"fmdelta" (exact), "lora r8" (the delta cut to rank 8), "emr GROUP" (a task of that group, re-merged)."""
    resident_bytes: Annotated[int, Field(ge=0)]
    """What serving it holds in memory beyond the base (for an EMR task, what the group grows by)."""
    stored_bytes: Annotated[int, Field(ge=0)]
    agreement: float | None = None
    """With the fine-tune on the calibration set (labels, or greedy tokens); None: exact, nothing to measure."""
    kl: float | None = None
    """Mean token KL(fine-tune || form), language models."""


class FormRecord(StrictModel):
    """Why a variant is in the form it is: what `store add --kind auto` measured, and what it chose."""

    chosen: str
    tolerance: Annotated[float, Field(ge=0, le=1)]
    """Disagreement with the fine-tune allowed (0: exact forms only)."""
    calibration: str | None = None
    """What agreement was measured on; None when nothing needed measuring (tolerance 0)."""
    candidates: list[FormCandidate]

    def summary(self) -> str:
        chosen = next(c for c in self.candidates if c.form == self.chosen)
        agreed = "exact" if chosen.agreement is None else f"agreement {chosen.agreement:.1%}"
        return f"{self.chosen} (auto, {agreed}, tolerance {self.tolerance:.1%})"


class VariantEntryBase(StrictModel):
    """What every variant kind's entry holds. A kind's entry class narrows `kind` to its own Literal, adds its
    fields and is registered (register_entry): the manifest reads each entry with the class its kind registered."""

    kind: str
    name: Name
    base: Name
    architecture: str
    raw_bytes: int
    """Size of the fine-tune's tensors (or files) uncompressed."""
    files: list[FileEntry]
    form: FormRecord | None = None
    """Set by `store add --kind auto`: the forms it weighed and why this one."""

    def models(self) -> dict[str, list[str] | None]:
        """Model id -> class labels, for every model the entry serves."""
        return {self.name: None}

    def form_records(self) -> dict[str, FormRecord]:
        """Model id -> how `store add --kind auto` chose its form, for the models it chose."""
        return {self.name: self.form} if self.form else {}

    def form_of(self, model: str) -> str:
        """How a model of this entry is served, as /v1/models and `store list` show it."""
        record = self.form_records().get(model)
        return record.summary() if record else self.kind

    @property
    def directory(self) -> str:
        """Its files' directory under variants/."""
        return self.name

    @property
    def revision(self) -> str:
        """A digest of everything the entry says (its files' digests among it): a replace under the same name is
        another revision, so what is keyed by it (the engine's cache, slots and families) never serves the old
        contents for the new."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]

    @property
    def key(self) -> str:
        """"<name>@<revision>": the entry as one revision of it, as caches, slots and routing key it."""
        return f"{self.name}{REVISION_SEP}{self.revision}"


class _Labelled(VariantEntryBase):
    """An entry that serves one model, under its own name, a classifier if it has labels."""

    labels: list[str] | None = None
    """Class labels, for classifier variants."""

    def models(self) -> dict[str, list[str] | None]:
        return {self.name: self.labels}


class FullVariantEntry(_Labelled):
    """A full fine-tune stored as an FM-Delta file against its parent base."""

    kind: Literal["full"] = "full"


class _AdapterEntry(_Labelled):
    """A PEFT LoRA-form adapter (adapter_config.json + adapter_model.safetensors) of its parent base; `labels`
    for a classifier adapter (its head saved through PEFT's modules_to_save). `architecture` is the parent
    base's (an adapter has none of its own)."""

    rank: Annotated[int, Field(ge=1)]
    """The largest rank over its modules, as served (a converted PiSSA adapter's 2r)."""
    target_modules: tuple[str, ...]
    """Base module names it corrects (a JSON list in the file)."""
    translora: Literal["student", "unchanged"] | None = None
    """Set by `store translora`: "student" for an adapter Trans-LoRA trained on this base; "unchanged" for the
    source adapter kept as it was (not transferred: the student did not beat it on validation).
    None for an adapter added directly (and in manifests written before the field existed)."""

    @field_validator("target_modules", mode="before")
    @classmethod
    def _a_tuple(cls, value: object) -> object:
        return tuple(value) if isinstance(value, list) else value

    @field_validator("target_modules")
    @classmethod
    def _shared(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return shared_names(value)


class LoraVariantEntry(_AdapterEntry):
    kind: Literal["lora"] = "lora"


class PissaVariantEntry(_AdapterEntry):
    """A trained PiSSA adapter, stored converted: a rank-2r LoRA on the original base."""

    kind: Literal["pissa"] = "pissa"


_SHARED_NAMES: dict[tuple[str, ...], tuple[str, ...]] = {}
MAX_SHARED_NAMES = 1024
"""Distinct name lists kept for sharing; past that, each entry keeps its own (interned) copy."""


def shared_names(names: tuple[str, ...]) -> tuple[str, ...]:
    """One tuple of interned names for every entry that lists the same ones: thousands of adapters of one base
    target the same modules, and a 2,000-adapter manifest held 20 MB in each process that read it, mostly
    these lists."""
    key = tuple(sys.intern(n) for n in names)
    if len(_SHARED_NAMES) < MAX_SHARED_NAMES:
        return _SHARED_NAMES.setdefault(key, key)
    return _SHARED_NAMES.get(key, key)


class EmrTaskEntry(StrictModel):
    name: Name
    labels: list[str] | None = None
    form: FormRecord | None = None
    """Set when `store add --kind auto` chose to merge the fine-tune into the group as this task."""


class EmrVariantEntry(VariantEntryBase):
    """An EMR-Merging group (serve/codecs/emr.py): one bundle, one model per task, "<group>/<task>". Its
    `architecture` is the tasks' (the first task's, as the bundle records it); `raw_bytes` the bundle's files."""

    kind: Literal["emr"] = "emr"
    bundle: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")]
    """Its directory under variants/: each bundle added gets a new one, so replacing a group (a task added,
    re-merged) swaps the manifest entry from one whole directory to another."""
    tasks: list[EmrTaskEntry]

    def models(self) -> dict[str, list[str] | None]:
        return {f"{self.name}{MEMBER_SEP}{t.name}": t.labels for t in self.tasks}

    def form_records(self) -> dict[str, FormRecord]:
        return {f"{self.name}{MEMBER_SEP}{t.name}": t.form for t in self.tasks if t.form}

    @property
    def directory(self) -> str:
        return self.bundle


VariantEntry = VariantEntryBase
"""Any kind's entry (as type hints say it)."""

ENTRY_TYPES: dict[str, type[VariantEntryBase]] = {}
"""kind -> its entry class: what the manifest reads a variant entry with."""


def register_entry(cls: type[VariantEntryBase]) -> type[VariantEntryBase]:
    """Make a kind's entry readable in every manifest (its `kind` field's default names the kind)."""
    kind = cls.model_fields["kind"].default
    if not isinstance(kind, str) or kind == "base":
        raise ValueError(f"{cls.__name__}: `kind` must default to the kind's name")
    if kind in ENTRY_TYPES and ENTRY_TYPES[kind] is not cls:
        raise ValueError(f"variant kind '{kind}' has an entry class already ({ENTRY_TYPES[kind].__name__})")
    ENTRY_TYPES[kind] = cls
    return cls


def unregister_entry(kind: str) -> None:
    ENTRY_TYPES.pop(kind, None)


# The built-in kinds' entries live here, not in their kind modules (serve/variants/), because every process that
# reads a store must know them, the HTTP ingress too, which imports no torch; a new kind registers its own.
for _cls in (FullVariantEntry, LoraVariantEntry, PissaVariantEntry, EmrVariantEntry):
    register_entry(_cls)


def _entry(name: str, data: object) -> VariantEntryBase:
    if isinstance(data, VariantEntryBase):
        return data
    kind = data.get("kind") if isinstance(data, dict) else None
    cls = ENTRY_TYPES.get(kind)  # type: ignore[arg-type]
    if cls is None:
        known = ", ".join(sorted(ENTRY_TYPES))
        raise PydanticCustomError("unknown_kind", "variant '{name}' is of kind {kind}, which no module here has "
                                  "registered (known: {known})", {"name": name, "kind": repr(kind), "known": known})
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise PydanticCustomError("invalid_entry", "variant '{name}': {problem}",
                                  {"name": name, "problem": first_error(e)}) from None


ModelPattern = Annotated[str, StringConstraints(pattern=r"^(\*|[A-Za-z0-9][A-Za-z0-9._/-]{0,128}\*?)$")]
"""A model a tenant may call: a name ("support/topic"), a prefix ("acme-*"), or "*" for every model."""


class TenantLimits(StrictModel):
    """Past any of these a tenant's request is refused with 429 and Retry-After (serve/http/tenant_limits.py).
    None: no limit of that kind."""

    requests_per_s: Annotated[float, Field(gt=0)] | None = None
    """Requests admitted per second, a token bucket holding one second's worth (at least one request)."""
    tokens_per_min: Annotated[int, Field(ge=1)] | None = None
    """Prompt and completion tokens per minute, a token bucket holding one minute's worth: a request is admitted
    while the bucket is not empty and its tokens are taken when it is answered (so one request may overdraw it)."""
    max_concurrent: Annotated[int, Field(ge=1)] | None = None
    """Requests of the tenant in flight at once."""


class TenantEntry(StrictModel):
    """A tenant: the keys it calls with, what it may call, its share of the engine and its limits."""

    name: Name
    key_sha256: list[Sha256] = []
    """sha256 of each API key of this tenant (keys themselves are never stored)."""
    admin_key_sha256: list[Sha256] = []
    """Keys that may add, replace and remove this tenant's own variants: those named "<tenant>-..."."""
    models: list[ModelPattern] = ["*"]
    weight: Annotated[float, Field(gt=0, le=1000)] = 1.0
    """Its share of the engine when tenants wait for it: served tokens count 1/weight on its virtual counter
    (serve/engine/scheduling/fairness.py)."""
    limits: TenantLimits = TenantLimits()

    def may_call(self, model: str) -> bool:
        return any(p == "*" or p == model or (p.endswith("*") and model.startswith(p[:-1])) for p in self.models)

    def owns(self, variant: str) -> bool:
        """Whether `variant` is this tenant's own, which its admin keys may change."""
        return variant.startswith(f"{self.name}-")

    @property
    def revision(self) -> str:
        """A digest of everything the entry says, as a variant entry's revision: what the audit log records."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]


def alias_problem(aliases: dict[str, str], variants: dict, bases: dict) -> str | None:
    """Why a manifest's aliases cannot stand (None where they can): each points at a variant entry, never at
    another alias, and no base's name is one. Read and written alike (StoreManifest, upgrade.point)."""
    for name, target in aliases.items():
        if target not in variants or target in aliases:
            return f"cannot point '{name}' at '{target}': no such variant (an alias names a variant entry)"
        if name in bases:
            return f"'{name}' is a base; a base's name cannot be pointed elsewhere"
    return None


class StoreManifest(StrictModel):
    format: Literal["manyfold.store"] = "manyfold.store"
    version: Literal[1] = VERSION
    bases: dict[Name, BaseEntry] = {}
    variants: dict[Name, SerializeAsAny[VariantEntryBase]] = {}
    """Each read with the entry class its kind registered."""
    tenants: dict[Name, TenantEntry] = {}
    """Tenants added at run time (POST /v1/admin/tenants), seen by every process that follows the store; a config
    file's tenants of the same name are replaced by these."""
    aliases: dict[Name, Name] = {}
    """A model name -> the variant entry that answers it (`manyfold store upgrade`: a tenant's adapter moved to a
    new base keeps the name clients call). An alias shadows the entry of its own name, if any, and is changed in
    one manifest write, so every process switches a name at once (within store_refresh_s); removing it points
    the name back."""

    @model_validator(mode="after")
    def _aliases_name_variants(self) -> "StoreManifest":
        problem = alias_problem(self.aliases, self.variants, self.bases)
        if problem is not None:
            raise ValueError(problem)
        return self

    @field_validator("variants", mode="before")
    @classmethod
    def _each_by_its_kind(cls, value: object) -> object:
        return {name: _entry(name, e) for name, e in value.items()} if isinstance(value, dict) else value


def read_manifest(root: Path) -> StoreManifest:
    path = root / MANIFEST
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise ArtifactError(f"{root}: not a Manyfold store (no {MANIFEST})") from None
    try:
        data = from_json(text, cache_strings="all")  # a name listed by thousands of entries is one object
        if isinstance(data, dict) and data.get("version") not in (None, VERSION):
            raise ArtifactError(f"{path}: store version {data.get('version')}; this Manyfold reads {VERSION}")
        return StoreManifest.model_validate(data)
    except ValidationError as e:
        raise ArtifactError(f"{path}: malformed manifest ({first_error(e)})") from e
    except ValueError as e:
        raise ArtifactError(f"{path}: malformed manifest ({e})") from e


def write_manifest(root: Path, manifest: StoreManifest) -> None:
    atomic_write(root / MANIFEST, [manifest.model_dump_json(indent=2).encode() + b"\n"])
