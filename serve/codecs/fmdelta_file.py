"""The .fmd container: a fine-tune as FM-Delta streams against its base, read strictly before decoding.

Framing as serve/codecs/container.py gives it (magic b"MFDELTA\\0", version 1, an FmdHeader); the payload holds,
per tensor, for each chunk its rANS words then its raw-bit words (uint32). Every tensor records the digest
(XXH3-128) of its payload (checked before decoding), of the base tensor it was coded against (a wrong base fails
clearly) and of its own bytes (checked after decoding: lossless means bit-identical).
"""

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch
import xxhash
from pydantic import Field, model_validator

from serve.codecs import container, entropy
from serve.codecs.container import Digest, NonNeg, PayloadTensor
from serve.codecs.fmdelta import (CHUNK_ELEMS, Chunk, Mapper, alphabet_size, decode_delta, encode_delta,
                                  map_tensors, pool_map)
from serve.errors import ArtifactError, VariantIncompatible
from serve.store.manifest import Sha256, StrictModel
from serve.store.tensors import (DIGEST, DTYPES, FLOAT_BITS, Alloc, as_bytes, digest_hex, dtype_name,
                                 fingerprint, save_tensors)

MAGIC = b"MFDELTA\0"
VERSION = 1
MAX_TENSOR_BYTES = 1 << 40



class ChunkRecord(StrictModel):
    elems: Annotated[int, Field(ge=1)]
    words: Annotated[int, Field(ge=4)]
    raw_words: NonNeg


class TensorRecord(PayloadTensor):
    codec: Literal["delta", "same", "raw"]
    """delta: coded against base_name; same: identical to base_name; raw: stored standalone."""
    base_name: str | None = None
    base_digest: Digest | None = None
    freqs: list[NonNeg] | None = None
    chunks: list[ChunkRecord] | None = None

    @model_validator(mode="after")
    def _fields_match_codec(self) -> "TensorRecord":
        has_base = self.base_name is not None and self.base_digest is not None
        has_model = self.freqs is not None and self.chunks is not None
        want = {"delta": (True, True), "same": (True, False), "raw": (False, False)}[self.codec]
        if (has_base, has_model) != want or (self.base_name is None) != (self.base_digest is None):
            raise ValueError(f"fields do not match codec '{self.codec}'")
        return self


class FmdHeader(StrictModel):
    format: Literal["manyfold.fmdelta"] = "manyfold.fmdelta"
    scale_bits: Literal[16] = entropy.SCALE_BITS
    checksum: Literal["xxh3_128"] = DIGEST
    base_fingerprint: Sha256
    """fingerprint() of the whole base this file was made against."""
    metadata: dict[str, str] = {}
    """The fine-tune's safetensors metadata, restored on decompression."""
    tensors: list[TensorRecord]


@dataclass(frozen=True)
class CompressStats:
    raw_bytes: int
    file_bytes: int
    order0_bytes: float
    """Order-0 bound of the delta streams plus raw bits, plus every tensor not delta-coded at full size."""
    codecs: dict[str, int]
    base_fingerprint: str
    """fingerprint() of the base the file was coded against, as its header records it."""

    @property
    def ratio(self) -> float:
        return self.file_bytes / self.raw_bytes if self.raw_bytes else 1.0


def _bits_view(t: torch.Tensor) -> np.ndarray:
    return as_bytes(t).view(FLOAT_BITS[dtype_name(t)])


def match_base_name(name: str, base_names: set[str]) -> str | None:
    """The base tensor a fine-tuned tensor derives from: the same name, or the name less its head prefix
    ('bert.encoder...' in a classifier <-> 'encoder...' in the bare encoder), or the base's prefix added."""
    if name in base_names:
        return name
    if "." in name and name.split(".", 1)[1] in base_names:
        return name.split(".", 1)[1]
    prefixed = [b for b in base_names if "." in b and b.split(".", 1)[1] == name]
    return prefixed[0] if len(prefixed) == 1 else None


@dataclass
class _Encoded:
    record: dict
    parts: list[np.ndarray]
    order0_bytes: float


def _encode_tensor(name: str, fine: torch.Tensor, base: torch.Tensor | None, base_name: str | None,
                   base_digest: str | None, map_fn) -> _Encoded:
    dtype = dtype_name(fine)
    fine_bytes = as_bytes(fine)
    record = {"name": name, "dtype": dtype, "shape": list(fine.shape), "digest": digest_hex(fine_bytes)}
    deltable = (base is not None and dtype in FLOAT_BITS and base.dtype == fine.dtype
                and base.shape == fine.shape and fine.numel() > 0)
    if deltable:
        base_ref = {"base_name": base_name, "base_digest": base_digest}
        if base_digest == record["digest"]:
            return _Encoded({**record, "codec": "same", **base_ref}, [], 0.0)
        coded = encode_delta(_bits_view(base), _bits_view(fine), CHUNK_ELEMS, map_fn)
        if coded.nbytes < fine_bytes.nbytes:
            chunks = [{"elems": c.n_elems, "words": int(c.words.size), "raw_words": int(c.raw.size)}
                      for c in coded.chunks]
            parts = [a for c in coded.chunks for a in (c.words, c.raw)]
            return _Encoded({**record, "codec": "delta", **base_ref, "freqs": coded.freqs.tolist(),
                             "chunks": chunks}, parts, coded.order0_bytes())
    return _Encoded({**record, "codec": "raw"}, [fine_bytes], float(fine_bytes.nbytes))


def compress(base: Mapping[str, torch.Tensor], fine: Mapping[str, torch.Tensor], out: str | Path,
             metadata: dict[str, str] | None = None, workers: int | None = None,
             progress: Callable[[str], None] | None = None) -> CompressStats:
    """Write fine as an .fmd file against base, atomically; tensors are matched by match_base_name."""
    workers = workers or os.cpu_count() or 1
    base = {n: base[n] for n in base}  # read each tensor once: the sources may be lazy
    fine = {n: fine[n] for n in fine}
    base_names = set(base)
    names = list(fine)
    base_digests = dict(zip(base, pool_map(workers)(lambda n: digest_hex(as_bytes(base[n])), list(base))))

    def one(name: str, map_fn) -> _Encoded:
        base_name = match_base_name(name, base_names)
        enc = _encode_tensor(name, fine[name], base.get(base_name), base_name, base_digests.get(base_name), map_fn)
        if progress:
            progress(name)
        return enc

    encoded = map_tensors(names, lambda n: fine[n].numel() > CHUNK_ELEMS, one, workers)

    records, parts, offset = [], [], 0
    for name in names:
        enc = encoded[name]
        blob = [np.ascontiguousarray(p).view(np.uint8) for p in enc.parts]
        digest = xxhash.xxh3_128()
        for b in blob:
            digest.update(b)
        length = sum(b.nbytes for b in blob)
        records.append({**enc.record, "offset": offset, "length": length, "payload_digest": digest.hexdigest()})
        parts.extend(blob)
        offset += length
    header = FmdHeader(base_fingerprint=fingerprint(base, base_digests), metadata=dict(metadata or {}),
                       tensors=[TensorRecord(**r) for r in records])
    file_bytes = container.write(out, MAGIC, VERSION, header, parts)
    codecs: dict[str, int] = {}
    for r in records:
        codecs[r["codec"]] = codecs.get(r["codec"], 0) + 1
    return CompressStats(raw_bytes=sum(r.nbytes for r in header.tensors),
                         file_bytes=file_bytes, order0_bytes=sum(e.order0_bytes for e in encoded.values()),
                         codecs=codecs, base_fingerprint=header.base_fingerprint)


class FmdFile:
    """A strictly validated .fmd file, memory-mapped; tensors decode one at a time against a base."""

    def __init__(self, path: str | Path):
        mapped = container.Mapped(path, MAGIC, VERSION, FmdHeader, "an FM-Delta file")
        self.path, self.header, self._fail = mapped.path, mapped.header, mapped.fail
        self.payload = mapped.payload
        mapped.check_spans(self.header.tensors, MAX_TENSOR_BYTES)
        self._check_codecs(self.header)
        self.records = {r.name: r for r in self.header.tensors}

    def _check_codecs(self, header: FmdHeader) -> None:
        for r in header.tensors:
            where = f"tensor '{r.name}'"
            if r.codec == "raw" and r.length != r.nbytes:
                raise self._fail(f"{where} is raw with {r.length} bytes, expected {r.nbytes}")
            if r.codec == "same" and r.length != 0:
                raise self._fail(f"{where} equals its base but has a payload")
            if r.codec == "delta":
                self._check_delta(r, where)

    def _check_delta(self, r: TensorRecord, where: str) -> None:
        if r.dtype not in FLOAT_BITS:
            raise self._fail(f"{where}: dtype {r.dtype} cannot be delta-coded")
        bits = 8 * np.dtype(FLOAT_BITS[r.dtype]).itemsize
        if len(r.freqs) != alphabet_size(bits) or sum(r.freqs) != 1 << entropy.SCALE_BITS:
            raise self._fail(f"{where}: malformed symbol model")
        if sum(c.elems for c in r.chunks) != r.numel:
            raise self._fail(f"{where}: chunks cover {sum(c.elems for c in r.chunks)} of {r.numel} elements")
        for c in r.chunks:
            if c.words > c.elems + 4 or c.raw_words > (c.elems * (bits - 1)) // 32 + 2:
                raise self._fail(f"{where}: chunk stream longer than its elements allow")
        if 4 * sum(c.words + c.raw_words for c in r.chunks) != r.length:
            raise self._fail(f"{where}: chunk lengths do not add up to the payload length")

    def check_base(self, r: TensorRecord, base: Mapping[str, torch.Tensor],
                   base_digests: Mapping[str, str] | None = None) -> torch.Tensor:
        """The base tensor r was coded against; raises VariantIncompatible if base is not that base.

        base_digests: digests of base tensors the caller has already computed (a server hashes its base once).
        """
        if r.base_name not in base:
            raise VariantIncompatible(f"{self.path}: base has no tensor '{r.base_name}'; wrong --base?")
        t = base[r.base_name]
        if dtype_name(t) != r.dtype or list(t.shape) != r.shape:
            raise VariantIncompatible(
                f"{self.path}: base tensor '{r.base_name}' is {dtype_name(t)}{list(t.shape)}, "
                f"the delta expects {r.dtype}{r.shape}; wrong --base?")
        digest = base_digests.get(r.base_name) if base_digests else None
        if (digest or digest_hex(as_bytes(t))) != r.base_digest:
            raise VariantIncompatible(
                f"{self.path}: made against a different base (tensor '{r.base_name}' differs); wrong --base?")
        return t

    def decode(self, name: str, base: Mapping[str, torch.Tensor], workers: int = 1) -> torch.Tensor:
        """One tensor, bit-identical to the fine-tune's, or an error naming the file and the tensor."""
        r = self.records[name]
        return self._decode(r, None if r.codec == "raw" else self.check_base(r, base), pool_map(workers))

    def _decode(self, r: TensorRecord, base_t: torch.Tensor | None, map_fn: Mapper,
                share_unchanged: bool = False, alloc: Alloc = torch.empty) -> torch.Tensor:
        name = r.name
        if r.codec == "same" and share_unchanged:
            return base_t  # check_base proved its bytes are this tensor's
        data = self.payload(r)
        out = alloc(r.shape, dtype=DTYPES[r.dtype])
        if r.codec == "raw":
            as_bytes(out)[:] = data
        elif r.codec == "same":
            out.copy_(base_t)
        else:
            base_bits = as_bytes(base_t).view(FLOAT_BITS[r.dtype])
            status = decode_delta(base_bits, np.asarray(r.freqs, np.uint32), self._chunks(r, data),
                                  as_bytes(out).view(FLOAT_BITS[r.dtype]), map_fn)
            if status != entropy.OK:
                raise self._fail(f"tensor '{name}': {entropy.STATUS_TEXT[status]} (file is corrupt)")
        if digest_hex(as_bytes(out)) != r.digest:
            raise self._fail(f"tensor '{name}': decoded bytes do not match their checksum")
        return out

    @staticmethod
    def _chunks(r: TensorRecord, data: np.ndarray) -> list[Chunk]:
        words = data.view(np.uint32)
        chunks, at = [], 0
        for c in r.chunks:
            chunks.append(Chunk(c.elems, words[at:at + c.words], words[at + c.words:at + c.words + c.raw_words]))
            at += c.words + c.raw_words
        return chunks

    def decode_all(self, base: Mapping[str, torch.Tensor], names: Sequence[str] | None = None,
                   workers: int | None = None, progress: Callable[[str], None] | None = None,
                   base_digests: Mapping[str, str] | None = None, share_unchanged: bool = False,
                   alloc: Alloc = torch.empty) -> dict[str, torch.Tensor]:
        """Every tensor (or those named). share_unchanged: tensors equal to the base are returned as the
        base's own tensor objects, not copies (a server keeps one copy of what a fine-tune left alone).
        alloc(shape, dtype=...) makes each output tensor: a server hands in recycled, already-faulted memory."""
        workers = workers or os.cpu_count() or 1
        names = list(names) if names is not None else list(self.records)
        for n in names:
            if n not in self.records:
                raise ArtifactError(f"{self.path}: no tensor '{n}'")
        # A wrong base fails before any work is done; each base tensor is read and hashed once.
        base_of = {n: self.check_base(self.records[n], base, base_digests)
                   for n in names if self.records[n].codec != "raw"}

        def one(name: str, map_fn: Mapper) -> torch.Tensor:
            t = self._decode(self.records[name], base_of.get(name), map_fn, share_unchanged, alloc)
            if progress:
                progress(name)
            return t

        return map_tensors(names, lambda n: self.records[n].numel > CHUNK_ELEMS, one, workers)


def decompress(fmd: str | Path, base: Mapping[str, torch.Tensor], out: str | Path,
               workers: int | None = None, progress: Callable[[str], None] | None = None) -> int:
    """Rebuild the fine-tune as a safetensors file, atomically; returns its tensor count."""
    f = FmdFile(fmd)
    tensors = f.decode_all(base, workers=workers, progress=progress)
    save_tensors(out, tensors, metadata=f.header.metadata or None)
    return len(tensors)
