"""Where a store's bytes live: a local directory or object storage (s3://, gs://, az://, file://), through obstore.

A store writes objects that never change once written:
    objects/<sha256>                      a file's bytes, named by their digest (the same bytes twice: one object)
    manifests/<generation, 20 digits>     the manifest, one object per generation
The only write that must not collide is a new manifest generation, and it is put-if-absent: of two writers racing
for generation N + 1, one wins and the other reads N + 1 and tries N + 2 (Delta Lake's log does this). Every
backend has put-if-absent (S3's If-None-Match, GCS's ifGenerationMatch=0, a local file created exclusively), so
a directory and a bucket behave alike, and a reader never sees an object half-written.

obstore over s3fs (`manyfold bench objects`: both against moto's S3 server on loopback, 2-core VM, median of 3):
a 64 MB get in 0.087 s against 0.269, 200 gets of 4 KB in 0.50 s against 1.61 (s3fs batched), 200 small puts
0.63 against 0.89, the 64 MB put 0.56 against 0.46; both refuse a put-if-absent on an existing key, obstore with
a typed AlreadyExistsError; one API for S3, GCS, Azure, local directories and memory. The endpoint comes from
AWS_ENDPOINT_URL and the credentials from each cloud's standard variables (obstore reads them). With none of them
set, an s3://, gs:// or az:// store is refused before any request, naming what was looked for (check_credentials):
obstore would otherwise ask the cloud's instance-metadata service, which off the cloud is a wait and an address
nobody meant; MANYFOLD_S3_INSTANCE_METADATA=1 (MANYFOLD_GCS_..., MANYFOLD_AZURE_...) lets it. A request is
retried for at most RETRY_S, and what object storage answers (a missing bucket, a denial, no answer) is one line
naming the URL (StoreUnreachable).
"""

import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

import obstore
from obstore.exceptions import (AlreadyExistsError, BaseError, NotFoundError, PermissionDeniedError,
                                 UnauthenticatedError)
from obstore.store import LocalStore, from_url

from serve.errors import ArtifactError, ConfigError, SourceTooLarge, StoreUnreachable
from serve.store.progress import Progress

SCHEMES = ("s3://", "gs://", "az://", "file://", "memory://")
CHUNK = 8 << 20
MIB = 1 << 20
RETRY_S = 10.0
"""How long a request to object storage is retried (5xx answers, connections refused or dropped) before it fails:
obstore's default of three minutes would hold a command, or a request's variant load, that long."""
S3_CREDENTIALS = (("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"), ("AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN"),
                  ("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",), ("AWS_CONTAINER_CREDENTIALS_FULL_URI",))
"""The credential sources obstore reads for S3, each a set of variables that must all be set (files are named by
the variables, and ~/.aws is not read)."""
GCS_ADC = Path(".config/gcloud/application_default_credentials.json")
"""gcloud's application default credentials under $HOME, which obstore reads for GCS when no variable names any."""


@dataclass(frozen=True)
class Cloud:
    """What obstore reads for one scheme's credentials, and the variables that let it go without them."""

    name: str
    sources: tuple[tuple[str, ...], ...]
    """Each a set of variables that must all be set."""
    anonymous: str
    """The variable asking for unsigned requests (a public bucket)."""
    metadata: str
    """The variable letting obstore ask this machine's instance-metadata service, its fallback with no source."""
    where: str
    """Where that service answers."""
    files: tuple[Path, ...] = ()
    """Credential files obstore reads under $HOME."""
    unread: str = ""
    """What the error says obstore does not read, where a user would expect it to."""


CLOUDS = {
    "s3://": Cloud("S3", S3_CREDENTIALS, "AWS_SKIP_SIGNATURE", "MANYFOLD_S3_INSTANCE_METADATA", "on EC2",
                  unread=" (~/.aws is not read)"),
    "gs://": Cloud("GCS", (("GOOGLE_SERVICE_ACCOUNT",), ("GOOGLE_SERVICE_ACCOUNT_PATH",),
                           ("GOOGLE_SERVICE_ACCOUNT_KEY",), ("GOOGLE_APPLICATION_CREDENTIALS",),
                           ("GOOGLE_BEARER_TOKEN",)),
                   "GOOGLE_SKIP_SIGNATURE", "MANYFOLD_GCS_INSTANCE_METADATA", "on GCE or GKE", (GCS_ADC,)),
    "az://": Cloud("Azure", (("AZURE_STORAGE_ACCOUNT_KEY",), ("AZURE_STORAGE_SAS_TOKEN",), ("AZURE_STORAGE_TOKEN",),
                             ("AZURE_CLIENT_ID", "AZURE_CLIENT_SECRET", "AZURE_TENANT_ID"),
                             ("AZURE_CLIENT_ID", "AZURE_FEDERATED_TOKEN_FILE", "AZURE_TENANT_ID"),
                             ("AZURE_USE_AZURE_CLI",), ("AZURE_STORAGE_USE_EMULATOR",)),
                   "AZURE_SKIP_SIGNATURE", "MANYFOLD_AZURE_INSTANCE_METADATA", "on an Azure VM"),
}
"""By scheme."""
SPELLINGS = {"AZURE_STORAGE_ACCOUNT_KEY": ("AZURE_STORAGE_ACCESS_KEY", "AZURE_STORAGE_MASTER_KEY"),
             "AZURE_STORAGE_SAS_TOKEN": ("AZURE_STORAGE_SAS_KEY",),
             "AZURE_CLIENT_ID": ("AZURE_STORAGE_CLIENT_ID",),
             "AZURE_CLIENT_SECRET": ("AZURE_STORAGE_CLIENT_SECRET",),
             "AZURE_TENANT_ID": ("AZURE_STORAGE_TENANT_ID", "AZURE_AUTHORITY_ID", "AZURE_STORAGE_AUTHORITY_ID")}
"""The other names obstore reads a variable by: a source is named by its first, and any of them counts."""


def _set(name: str) -> bool:
    """A variable is set: a flag (unsigned requests, the CLI, the emulator, the metadata service) when 1 or true."""
    value = os.environ.get(name, "")
    if name.endswith(("_SKIP_SIGNATURE", "_USE_AZURE_CLI", "_USE_EMULATOR", "_INSTANCE_METADATA")):
        return value.lower() in ("1", "true")
    return bool(value)


def check_credentials(location: str) -> None:
    """ConfigError naming what was looked for when a cloud store has no credential source set, unsigned requests
    are not asked for and the instance-metadata service is not allowed: obstore's fallback would ask that service,
    which off the cloud is a wait and an address nobody meant. A file:// or memory:// store needs none."""
    cloud = next((c for scheme, c in CLOUDS.items() if location.startswith(scheme)), None)
    if cloud is None:
        return
    found = any(all(any(_set(v) for v in (name, *SPELLINGS.get(name, ()))) for name in source)
                for source in cloud.sources)
    if found or _set(cloud.anonymous) or _set(cloud.metadata) or any((Path.home() / f).is_file() for f in cloud.files):
        return
    looked = "; ".join(" and ".join(source) for source in cloud.sources)
    files = "".join(f", or ~/{f}" for f in cloud.files) + cloud.unread
    raise ConfigError(f"store {location}: no {cloud.name} credentials: set {looked}{files}, or {cloud.anonymous}=true "
                      f"for a public bucket, or {cloud.metadata}=1 to ask this machine's instance-metadata service "
                      f"({cloud.where})")


@contextmanager
def reaching(location: str) -> Iterator[None]:
    """Object storage's answers as one line naming the location (StoreUnreachable): a bucket that does not exist, a
    denial or unknown credentials, an endpoint that does not answer. A missing object is the caller's to handle."""
    try:
        yield
    except (NotFoundError, FileNotFoundError, AlreadyExistsError):
        raise
    except BaseError as e:
        raise StoreUnreachable(f"store {location}: {_gist(e)}") from None


_STATUS = re.compile(r"status code: (\d{3})")
_S3_ERROR = re.compile(r"<Code>(.*?)</Code>\s*<Message>(.*?)</Message>", re.S)


def _gist(e: BaseException) -> str:
    """What obstore's error (many lines: the request, the answer's XML, a debug dump) says, in a few words."""
    text = str(e)
    status, said = _STATUS.search(text), _S3_ERROR.search(text)
    answer = f"{said[1]}: {said[2]}" if said else (status[1] if status else "")
    if said and said[1] == "NoSuchBucket":
        return "the bucket does not exist (NoSuchBucket)"
    if isinstance(e, (PermissionDeniedError, UnauthenticatedError)) or (status and status[1] in ("401", "403")):
        return f"access denied ({answer or type(e).__name__})"
    if "error sending request" in text:
        endpoint = os.environ.get("AWS_ENDPOINT_URL") or "its endpoint"
        return f"no answer from {endpoint} within {RETRY_S:g} s of retries (error sending request)"
    first = (text.strip().splitlines() or [type(e).__name__])[0]
    return answer or (first if len(first) <= 200 else first[:200] + "...")


def is_url(location: str | Path) -> bool:
    """Whether a store location is a URL (else it is a local directory)."""
    return isinstance(location, str) and "://" in location


class Objects:
    """One store's objects, by key relative to the store's root."""

    def __init__(self, location: str | Path):
        """location: s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, az://..., file:///PATH, memory://, or a local path
        (created if missing)."""
        self.location = str(location)
        if is_url(location):
            if not self.location.startswith(SCHEMES):
                raise ConfigError(f"store {self.location}: unknown scheme; expected a local path or one of "
                                  f"{', '.join(SCHEMES)}")
            if self.location.startswith("file://"):  # created if missing, as a local path is: obstore opens none
                Path(url2pathname(urlparse(self.location).path)).mkdir(parents=True, exist_ok=True)
            check_credentials(self.location)
            options = {}
            if os.environ.get("AWS_ENDPOINT_URL", "").startswith("http://"):
                options["client_options"] = {"allow_http": True}
            if self.location.startswith(("s3://", "gs://", "az://")):
                options["retry_config"] = {"max_retries": 10, "retry_timeout": timedelta(seconds=RETRY_S)}
            try:
                self._store = from_url(self.location, **options)
            except Exception as e:  # obstore raises its own types for an unknown scheme, a bad bucket name, ...
                raise ConfigError(f"store {self.location}: cannot be opened ({e})".splitlines()[0]) from None
        else:
            Path(location).mkdir(parents=True, exist_ok=True)
            self._store = LocalStore(Path(location).resolve())

    def __repr__(self) -> str:
        return f"Objects({self.location!r})"

    def put_new(self, key: str, data: bytes) -> bool:
        """Write key once: False (nothing written) when it exists already."""
        try:
            with reaching(self.location):
                obstore.put(self._store, key, data, mode="create")
        except AlreadyExistsError:
            return False
        return True

    def put_file(self, key: str, path: Path) -> None:
        """Upload a file (in parts when large). For content-addressed keys: a racing upload writes the same bytes."""
        with open(path, "rb") as f, reaching(self.location):
            obstore.put(self._store, key, f, chunk_size=CHUNK)

    def exists(self, key: str) -> bool:
        try:
            with reaching(self.location):
                obstore.head(self._store, key)
        except (NotFoundError, FileNotFoundError):
            return False
        return True

    def read(self, key: str) -> bytes:
        try:
            with reaching(self.location):
                return obstore.get(self._store, key).bytes().to_bytes()
        except (NotFoundError, FileNotFoundError):
            raise ArtifactError(f"{self.location}: object '{key}' is missing") from None

    def download(self, key: str, dest: Path, sha256: str | None = None, progress: Progress | None = None) -> int:
        """Stream key into dest (written beside it, then renamed: dest is whole or absent); with sha256, the bytes
        are checked on the way and a mismatch leaves nothing; progress counts each chunk as it is written. -> bytes
        written."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256() if sha256 is not None else None
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
        size = 0
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in self._chunks(key):
                    f.write(chunk)
                    size += len(chunk)
                    if progress is not None:
                        progress.update(len(chunk))
                    if h is not None:
                        h.update(chunk)
                f.flush()
                os.fsync(f.fileno())
            if h is not None and h.hexdigest() != sha256:
                raise ArtifactError(f"{self.location}: object '{key}' has sha256 {h.hexdigest()[:12]}…, expected "
                                    f"{sha256[:12]}…")
            os.replace(tmp, dest)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return size

    def _chunks(self, key: str) -> Iterator[bytes | memoryview]:
        try:
            with reaching(self.location):
                yield from obstore.get(self._store, key).stream(min_chunk_size=CHUNK)
        except (NotFoundError, FileNotFoundError):
            raise ArtifactError(f"{self.location}: object '{key}' is missing") from None

    def listing(self, prefix: str | None = None) -> list[tuple[str, int, float]]:
        """(key, bytes, last modified as a Unix time) of every object under the directory `prefix` (None: the
        whole location), sorted."""
        with reaching(self.location):
            return sorted((m["path"], int(m["size"]), m["last_modified"].timestamp())
                          for batch in obstore.list(self._store, prefix=prefix) for m in batch)

    def keys(self, prefix: str | None = None, after: str | None = None) -> list[str]:
        """Keys under the directory `prefix` (None: the whole location), sorted; with `after`, only those that
        sort after it."""
        return [key for key, _, _ in self.listing(prefix) if after is None or key > after]

    def download_tree(self, dest: Path, max_bytes: int | None = None) -> int:
        """Every object under this location into dest, at its key's path (a directory a caller put in object
        storage: an adapter, a fine-tune); -> files written. Nothing there is an error naming the location; more
        than max_bytes in all (as the listing says, before anything is downloaded) is SourceTooLarge."""
        listed = self.listing()
        if not listed:
            raise ArtifactError(f"{self.location}: nothing there")
        refuse_over(self.location, sum(size for _, size, _ in listed), max_bytes)
        keys = [key for key, _, _ in listed]
        for key in keys:
            if ".." in key.split("/"):
                raise ArtifactError(f"{self.location}: object '{key}' would land outside the directory")
            self.download(key, dest / key)
        return len(keys)

    def delete(self, key: str) -> None:
        try:
            with reaching(self.location):
                obstore.delete(self._store, key)
        except (NotFoundError, FileNotFoundError):
            pass


def tree_bytes(path: Path) -> int:
    """The bytes a copy of a local directory reads: every file under it, a symlink counted as what it points at
    (shutil.copytree follows them)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name)).st_size
            except OSError:  # a dangling link or a file gone meanwhile: the copy will name it
                continue
    return total


def refuse_over(where: str | Path, size: int, max_bytes: int | None) -> None:
    """SourceTooLarge when a source's `size` bytes pass the cap on one add (None: no cap)."""
    if max_bytes is not None and size > max_bytes:
        raise SourceTooLarge(f"{where}: {size / MIB:.1f} MiB, more than one add may copy "
                             f"(admin.max_add_mib = {max_bytes / MIB:g})")


@contextmanager
def fetched(paths: list[str], max_bytes: int | None = None) -> Iterator[list[Path]]:
    """Local directories for variant sources: a path on this machine as it is, an object-storage URL (s3://...)
    downloaded into a temporary directory for the block. With max_bytes, every source is measured first (a local
    tree's file sizes, a URL's listing) and one larger than it is refused before anything is copied, so a refused
    add leaves nothing behind."""
    for p in paths:
        if max_bytes is not None and not is_url(p) and Path(p).is_dir():
            refuse_over(p, tree_bytes(Path(p)), max_bytes)
    with tempfile.TemporaryDirectory(prefix="manyfold-fetch-") as tmp:
        out = []
        for i, p in enumerate(paths):
            if is_url(p):
                dest = Path(tmp) / str(i)
                Objects(p).download_tree(dest, max_bytes)
                out.append(dest)
            else:
                out.append(Path(p))
        yield out
