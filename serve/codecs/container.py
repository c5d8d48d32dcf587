"""The framing Manyfold's coded files share (.fmd, .nzp): a fixed prefix, a checksummed JSON header, a payload.

Layout (little-endian):
  0   8 bytes   magic
  8   u32       format version
  12  u32       reserved (0)
  16  u64       header length H
  24  32 bytes  sha256 of the header
  56  H bytes   header, UTF-8 JSON (a strict pydantic model)
  ..  zero padding to a multiple of 64
  P   payload; offsets in the header are relative to P
The reader maps the file, checks the prefix and the header's checksum, then validates the header before anything
else is read.
"""

import hashlib
import json
import math
import mmap
import os
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Annotated, Literal, TypeVar

import numpy as np
import torch
from pydantic import BaseModel, Field, StringConstraints, ValidationError

from serve.errors import ArtifactError, first_error
from serve.store.manifest import StrictModel
from serve.store.tensors import DTYPES, digest_hex
from serve.store.writer import atomic_write

PREFIX = struct.Struct("<8sIIQ32s")
ALIGN = 64
MAX_HEADER_BYTES = 64 << 20

H = TypeVar("H", bound=BaseModel)

NonNeg = Annotated[int, Field(ge=0)]
Digest = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]
"""XXH3-128, hex."""


class PayloadTensor(StrictModel):
    """A tensor's place in the payload and the digests that guard it; each format adds its codec's fields."""

    name: Annotated[str, StringConstraints(min_length=1)]
    dtype: Literal[tuple(DTYPES)]  # type: ignore[valid-type]
    shape: list[NonNeg]
    digest: Digest
    """Of the tensor's bytes as decoding gives them (checked after decoding)."""
    offset: NonNeg
    length: NonNeg
    payload_digest: Digest
    """Of its payload bytes (checked before decoding)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)  # Python ints: a hostile shape cannot wrap around to a small count

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty(0, dtype=DTYPES[self.dtype]).element_size()


def write(out: str | Path, magic: bytes, version: int, header: BaseModel, payload: Iterable[bytes | memoryview]) -> int:
    """Write the file atomically; returns its size."""
    header_bytes = header.model_dump_json(exclude_none=True).encode()
    prefix = PREFIX.pack(magic, version, 0, len(header_bytes), hashlib.sha256(header_bytes).digest())
    pad = b"\0" * (-(len(prefix) + len(header_bytes)) % ALIGN)
    return atomic_write(out, [prefix, header_bytes, pad, *payload])


class Mapped:
    """A container file, memory-mapped, its header validated as `header_cls`; `what` names the format in errors."""

    def __init__(self, path: str | Path, magic: bytes, version: int, header_cls: type[H], what: str):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except OSError as e:
            raise ArtifactError(f"{self.path}: cannot open ({e.strerror})") from e
        if size < PREFIX.size:
            raise self.fail(f"truncated: {size} bytes, not {what}")
        got_magic, got_version, _, header_len, header_sha = PREFIX.unpack_from(self.map, 0)
        if got_magic != magic:
            raise self.fail(f"not {what} (bad magic)")
        if got_version != version:
            raise self.fail(f"format version {got_version}; this Manyfold reads version {version}")
        if header_len > min(MAX_HEADER_BYTES, size - PREFIX.size):
            raise self.fail(f"truncated: header of {header_len} bytes does not fit in {size} bytes")
        raw = self.map[PREFIX.size:PREFIX.size + header_len]
        if hashlib.sha256(raw).digest() != header_sha:
            raise self.fail("header checksum mismatch (file is corrupt)")
        try:
            self.header = header_cls.model_validate(json.loads(raw))
        except ValidationError as e:
            raise self.fail(f"malformed header ({first_error(e)})") from e
        except ValueError as e:
            raise self.fail(f"malformed header ({str(e).splitlines()[0]})") from e
        self.payload_start = PREFIX.size + header_len + (-(PREFIX.size + header_len) % ALIGN)
        self.payload_size = size - self.payload_start

    def check_spans(self, tensors: Sequence[PayloadTensor], max_tensor_bytes: int) -> None:
        """Every name once, every size sane, every payload inside the file and none overlapping another."""
        seen: set[str] = set()
        spans = []
        for r in tensors:
            where = f"tensor '{r.name}'"
            if r.name in seen:
                raise self.fail(f"{where} appears twice")
            seen.add(r.name)
            if r.nbytes > max_tensor_bytes:
                raise self.fail(f"{where} claims {r.nbytes} bytes")
            if r.offset + r.length > self.payload_size:
                raise self.fail(f"truncated: {where} ends at {r.offset + r.length}, payload has {self.payload_size}")
            spans.append((r.offset, r.length, r.name))
        spans.sort()
        for (o1, l1, n1), (o2, _, n2) in zip(spans, spans[1:]):
            if o1 + l1 > o2:
                raise self.fail(f"payloads of '{n1}' and '{n2}' overlap")

    def payload(self, r: PayloadTensor) -> np.ndarray:
        """A tensor's payload bytes (a view of the map), checked against their digest."""
        start = self.payload_start + r.offset
        data = np.frombuffer(self.map, np.uint8, r.length, start) if r.length else np.empty(0, np.uint8)
        if digest_hex(data) != r.payload_digest:
            raise self.fail(f"tensor '{r.name}': payload checksum mismatch (file is corrupt)")
        return data

    def release(self, offset: int, length: int) -> None:
        """Drop the mapped pages of payload bytes [offset, offset + length) from this process's memory (they are
        read again from the file if touched): a reader that copies what it keeps does not also hold the file."""
        if not isinstance(self.map, mmap.mmap) or length <= 0:
            return
        start = self.payload_start + offset
        aligned = start - start % mmap.PAGESIZE
        self.map.madvise(mmap.MADV_DONTNEED, aligned, start + length - aligned)

    def fail(self, what: str) -> ArtifactError:
        return ArtifactError(f"{self.path}: {what}")
