"""The store's manifest: one versioned JSON file listing bases and variants with their files and digests."""

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from serve.errors import ArtifactError, first_error
from serve.store.writer import atomic_write

MANIFEST = "manifest.json"
VERSION = 1
Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
"""Names become directory names and HTTP `model` values: no slashes, no leading dot, 64 chars at most."""
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class StrictModel(BaseModel):
    """Schemas of files Manyfold reads: unknown fields and type coercions are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


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


class _OneModel(StrictModel):
    """An entry that serves one model, under its own name."""

    name: Name
    labels: list[str] | None = None
    """Class labels, for classifier variants."""

    def models(self) -> dict[str, list[str] | None]:
        """Model id -> class labels, for every model the entry serves."""
        return {self.name: self.labels}

    @property
    def directory(self) -> str:
        """Its files' directory under variants/."""
        return self.name


class FullVariantEntry(_OneModel):
    """A full fine-tune stored as an FM-Delta file against its parent base."""

    kind: Literal["full"] = "full"
    base: Name
    architecture: str
    raw_bytes: int
    """Size of the fine-tune's tensors uncompressed."""
    files: list[FileEntry]


class _AdapterEntry(_OneModel):
    """A PEFT LoRA-form adapter (adapter_config.json + adapter_model.safetensors) of its parent base; `labels`
    for a classifier adapter (its head saved through PEFT's modules_to_save)."""

    base: Name
    architecture: str
    """The parent base's architecture (an adapter has none of its own)."""
    raw_bytes: int
    rank: Annotated[int, Field(ge=1)]
    """The largest rank over its modules, as served (a converted PiSSA adapter's 2r)."""
    target_modules: list[str]
    """Base module names it corrects."""
    files: list[FileEntry]


class LoraVariantEntry(_AdapterEntry):
    kind: Literal["lora"] = "lora"


class PissaVariantEntry(_AdapterEntry):
    """A trained PiSSA adapter, stored converted: a rank-2r LoRA on the original base."""

    kind: Literal["pissa"] = "pissa"


class EmrTaskEntry(StrictModel):
    name: Name
    labels: list[str] | None = None


class EmrVariantEntry(StrictModel):
    """An EMR-Merging group (serve/codecs/emr.py): one bundle, one model per task, "<group>/<task>"."""

    kind: Literal["emr"] = "emr"
    name: Name
    base: Name
    architecture: str
    """The tasks' architecture (the first task's, as the bundle records it)."""
    raw_bytes: int
    """Size of the bundle's files."""
    bundle: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")]
    """Its directory under variants/: each bundle added gets a new one, so replacing a group (a task added,
    re-merged) swaps the manifest entry from one whole directory to another."""
    tasks: list[EmrTaskEntry]
    files: list[FileEntry]

    def models(self) -> dict[str, list[str] | None]:
        return {f"{self.name}{MEMBER_SEP}{t.name}": t.labels for t in self.tasks}

    @property
    def directory(self) -> str:
        return self.bundle


VariantEntry = Annotated[FullVariantEntry | LoraVariantEntry | PissaVariantEntry | EmrVariantEntry,
                         Field(discriminator="kind")]
"""Every variant kind's manifest entry, tagged by `kind`; serve.variants registers how each is served."""


class StoreManifest(StrictModel):
    format: Literal["manyfold.store"] = "manyfold.store"
    version: Literal[1] = VERSION
    bases: dict[Name, BaseEntry] = {}
    variants: dict[Name, VariantEntry] = {}


def read_manifest(root: Path) -> StoreManifest:
    path = root / MANIFEST
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise ArtifactError(f"{root}: not a Manyfold store (no {MANIFEST})") from None
    try:
        data = json.loads(text)
        if isinstance(data, dict) and data.get("version") not in (None, VERSION):
            raise ArtifactError(f"{path}: store version {data.get('version')}; this Manyfold reads {VERSION}")
        return StoreManifest.model_validate(data)
    except ValidationError as e:
        raise ArtifactError(f"{path}: malformed manifest ({first_error(e)})") from e
    except ValueError as e:
        raise ArtifactError(f"{path}: malformed manifest ({e})") from e


def write_manifest(root: Path, manifest: StoreManifest) -> None:
    atomic_write(root / MANIFEST, [manifest.model_dump_json(indent=2).encode() + b"\n"])
