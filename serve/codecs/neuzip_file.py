"""The .nzp container: a model's weights in NeuZip form (serve/codecs/neuzip.py), read strictly before decoding.

Framing as serve/codecs/container.py gives it (magic b"MFNEUZIP", version 1, an NzpHeader). The payload holds,
per tensor, 64-byte aligned: for a coded tensor its lane offsets (uint32 [lanes + 1], in words), its rANS words
(uint16) and its sign/mantissa plane (uint8); for a raw tensor its bytes. Every tensor records the digest
(XXH3-128) of its payload (checked before decoding), of its decoded bytes (checked after) and of the bytes it
was made from (equal to the decoded ones when lossless; a lossy base's variants are checked against these).

Which tensors are coded (`codable`): bf16 matrices that a forward reads whole (Linear weights). Embedding
tables stay raw (a forward reads a few rows; a tied LM head reads the table that stays raw), and so do
vectors (norms, biases: small) and anything holding Inf or NaN.
"""

import json
import math
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import numpy as np
import torch
import xxhash
from pydantic import Field

from serve.codecs import container, neuzip
from serve.codecs.container import Digest, NonNeg, PayloadTensor
from serve.codecs.entropy import order0_bits
from serve.codecs.fmdelta import pool_map
from serve.errors import ArtifactError
from serve.store.manifest import StrictModel
from serve.store.model_dir import NOT_COPIED
from serve.store.tensors import (DTYPES, INDEX_FILE, SINGLE_FILE, SafetensorsSource, as_bytes, digest_hex, dtype_name,
                                 save_tensors, weight_files)
from serve.store.writer import atomic_dir, atomic_write

if TYPE_CHECKING:
    from serve.store.manifest import BaseEntry
    from serve.store.store import Store

NEUZIP_FILE = "neuzip.nzp"
"""A NeuZip model directory's coded weights (in a store, beside the lossless safetensors)."""
MAGIC = b"MFNEUZIP"
VERSION = 1
MAX_TENSOR_BYTES = 1 << 40

class NzpTensor(PayloadTensor):
    codec: Literal["neuzip", "raw"]
    source_digest: Digest
    """Of the bytes it was made from (the lossless weights)."""
    lanes: Annotated[int, Field(ge=1)] | None = None
    words: NonNeg | None = None
    freqs: list[NonNeg] | None = None


class NzpHeader(StrictModel):
    format: Literal["manyfold.neuzip"] = "manyfold.neuzip"
    bits: Literal[neuzip.BITS]  # type: ignore[valid-type]
    lane: Annotated[int, Field(ge=1, le=neuzip.MAX_LANE)] = neuzip.LANE
    checksum: Literal["xxh3_128"] = "xxh3_128"
    metadata: dict[str, str] = {}
    tensors: list[NzpTensor]


@dataclass(frozen=True)
class NzpStats:
    bits: int
    file_bytes: int
    raw_bytes: int
    """Every tensor as bf16 (or its own dtype)."""
    coded_raw_bytes: int
    """The coded tensors as bf16: what NeuZip's ratio is of."""
    coded_bytes: int
    """The coded tensors' payloads (offsets, words, sign/mantissa)."""
    order0_bytes: float
    """The coded tensors at the order-0 entropy of their exponents plus their raw bits."""
    codecs: dict[str, int]

    @property
    def coded_ratio(self) -> float:
        """The coded tensors' share of the file (their payloads, their share of the header and padding) over
        their bf16 bytes: everything the coding adds counts against it."""
        overhead = self.file_bytes - self.coded_bytes - (self.raw_bytes - self.coded_raw_bytes)
        return (self.coded_bytes + max(overhead, 0)) / max(self.coded_raw_bytes, 1)


def codable(name: str, t: torch.Tensor) -> bool:
    """Whether compress codes this tensor (see the module's docstring)."""
    return t.dtype == torch.bfloat16 and t.dim() == 2 and t.numel() > 0 and "embed" not in name


def _finite(t: torch.Tensor) -> bool:
    return neuzip.finite(as_bytes(t).view(np.uint16))


def _encode(name: str, t: torch.Tensor, bits: int, lane: int) -> tuple[dict, list[np.ndarray], float]:
    data = as_bytes(t)
    record = {"name": name, "dtype": dtype_name(t), "shape": list(t.shape), "source_digest": digest_hex(data)}
    if not (codable(name, t) and _finite(t)):
        return {**record, "codec": "raw", "digest": record["source_digest"]}, [data], 0.0
    bits16 = data.view(np.uint16)
    enc = neuzip.encode(bits16, bits, lane)
    decoded = neuzip.decode(enc)  # what a reader will get: proves the stream before it is written
    if bits == 7 and not np.array_equal(decoded, bits16):
        raise RuntimeError(f"tensor '{name}': the lossless stream does not decode to its source")
    parts = [enc.offsets.astype(np.uint32), enc.words, enc.sm]
    order0 = order0_bits(np.bincount((decoded >> 7) & 0xFF, minlength=neuzip.EXPONENTS)) / 8 + enc.sm.nbytes
    return ({**record, "codec": "neuzip", "digest": digest_hex(decoded.view(np.uint8)), "lanes": enc.lanes,
             "words": int(enc.words.size), "freqs": enc.freqs.tolist()}, parts, order0)


def compress(tensors: Mapping[str, torch.Tensor], bits: int, out: str | Path, metadata: dict[str, str] | None = None,
             workers: int | None = None, progress: Callable[[str], None] | None = None,
             lane: int = neuzip.LANE) -> NzpStats:
    """Write `tensors` as an .nzp file keeping `bits` mantissa bits in the coded ones, `lane` symbols a lane,
    atomically."""
    neuzip.check_bits(bits)
    neuzip.check_lane(lane)
    names = list(tensors)
    for n in names:
        if tensors[n].dtype == torch.float32 and codable(n, tensors[n].to(torch.bfloat16)):
            raise ValueError(f"tensor '{n}' is float32: cast the model to bfloat16 first")

    def one(name: str):
        res = _encode(name, tensors[name].contiguous(), bits, lane)
        if progress:
            progress(name)
        return res

    encoded = dict(zip(names, pool_map(workers or os.cpu_count() or 1)(one, names)))
    records, payload, offset = [], [], 0
    for name in names:
        record, parts, _ = encoded[name]
        blob = [np.ascontiguousarray(p).view(np.uint8) for p in parts]
        digest = xxhash.xxh3_128()
        for b in blob:
            digest.update(b)
        length = sum(b.nbytes for b in blob)
        records.append(NzpTensor(**record, offset=offset, length=length, payload_digest=digest.hexdigest()))
        pad = -length % container.ALIGN
        payload.extend([*blob, b"\0" * pad])
        offset += length + pad
    header = NzpHeader(bits=bits, lane=lane, metadata=dict(metadata or {}), tensors=records)
    file_bytes = container.write(out, MAGIC, VERSION, header, payload)
    coded = [r for r in records if r.codec == "neuzip"]
    return NzpStats(bits=bits, file_bytes=file_bytes, raw_bytes=sum(r.nbytes for r in records),
                    coded_raw_bytes=sum(r.nbytes for r in coded), coded_bytes=sum(r.length for r in coded),
                    order0_bytes=sum(encoded[r.name][2] for r in coded),
                    codecs={c: sum(r.codec == c for r in records) for c in ("neuzip", "raw")})


@dataclass(frozen=True)
class Stream:
    """One coded tensor in memory: the decode kernels' arguments."""

    name: str
    shape: tuple[int, ...]
    bits: int
    words: torch.Tensor
    offsets: torch.Tensor
    table: torch.Tensor
    sm: torch.Tensor

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """What it holds in memory: its streams and its decode table."""
        return sum(t.numel() * t.element_size() for t in (self.words, self.offsets, self.table, self.sm))

    def to(self, device: torch.device | str) -> "Stream":
        move = {k: getattr(self, k).to(device) for k in ("words", "offsets", "table", "sm")}
        return Stream(self.name, self.shape, self.bits, **move)


class NzpFile:
    """A strictly validated .nzp file, memory-mapped."""

    def __init__(self, path: str | Path):
        mapped = container.Mapped(path, MAGIC, VERSION, NzpHeader, "a NeuZip file")
        self._mapped = mapped
        self.path, self.header, self._fail = mapped.path, mapped.header, mapped.fail
        self.payload = mapped.payload
        mapped.check_spans(self.header.tensors, MAX_TENSOR_BYTES)
        self._check_codecs()
        self.records = {r.name: r for r in self.header.tensors}

    @property
    def bits(self) -> int:
        return self.header.bits

    def _check_codecs(self) -> None:
        for r in self.header.tensors:
            where = f"tensor '{r.name}'"
            if (r.codec == "raw" or self.bits == 7) and r.digest != r.source_digest:
                raise self._fail(f"{where}: stored losslessly, yet its digest differs from its source's")
            if r.codec == "raw":
                if r.length != r.nbytes or r.lanes is not None or r.freqs is not None or r.words is not None:
                    raise self._fail(f"{where} is raw with {r.length} bytes, expected {r.nbytes}")
            else:
                self._check_coded(r, where)

    def _check_coded(self, r: NzpTensor, where: str) -> None:
        if r.dtype != "BF16" or r.lanes is None or r.words is None or r.freqs is None:
            raise self._fail(f"{where}: a NeuZip tensor is bf16 with lanes, words and freqs")
        if r.lanes != -(-r.numel // self.header.lane):
            raise self._fail(f"{where}: {r.lanes} lanes for {r.numel} elements of {self.header.lane} a lane")
        if len(r.freqs) != neuzip.EXPONENTS or sum(r.freqs) != 1 << neuzip.SCALE_BITS:
            raise self._fail(f"{where}: malformed exponent model")
        if r.words > r.numel + 2 * r.lanes:
            raise self._fail(f"{where}: stream longer than its elements allow")
        if r.length != self._sizes(r)[-1]:
            raise self._fail(f"{where}: payload of {r.length} bytes, its parts add up to {self._sizes(r)[-1]}")

    def _sizes(self, r: NzpTensor) -> tuple[int, int, int]:
        """Ends of a coded tensor's offsets, words and sign/mantissa plane within its payload."""
        a = 4 * (r.lanes + 1)
        b = a + 2 * r.words
        return a, b, b + -(-r.numel * (self.header.bits + 1) // 8)

    def stream(self, name: str) -> Stream:
        """A coded tensor's streams, copied into memory, checked: its payload digest, its lane offsets, and a
        full decode against its digest (a server trusts what it holds from then on)."""
        r = self.records[name]
        if r.codec != "neuzip":
            raise ArtifactError(f"{self.path}: tensor '{name}' is stored raw")
        data = self.payload(r)
        a, b, c = self._sizes(r)
        offsets = data[:a].view(np.uint32).astype(np.int64)
        if offsets[0] != 0 or offsets[-1] != r.words or (np.diff(offsets) < 2).any():
            raise self._fail(f"tensor '{name}': lane offsets out of order (file is corrupt)")
        s = Stream(name, tuple(r.shape), self.bits, torch.from_numpy(data[a:b].copy().view(np.int16)),
                   torch.from_numpy(offsets), torch.from_numpy(neuzip.decode_table(np.asarray(r.freqs))),
                   torch.from_numpy(data[b:c].copy()))
        self._mapped.release(r.offset, r.length)
        self._check(r, decode(s))
        return s

    def _check(self, r: NzpTensor, t: torch.Tensor) -> None:
        if digest_hex(as_bytes(t)) != r.digest:
            raise self._fail(f"tensor '{r.name}': decoded bytes do not match their checksum")

    def tensor(self, name: str) -> torch.Tensor:
        """A tensor as served (decoded if coded), checked against its digest."""
        r = self.records[name]
        if r.codec == "neuzip":
            return decode(self.stream(name))
        out = torch.empty(r.shape, dtype=DTYPES[r.dtype])
        as_bytes(out)[:] = self.payload(r)
        self._mapped.release(r.offset, r.length)
        self._check(r, out)
        return out


def decode(s: Stream, out: torch.Tensor | None = None, check: bool = True) -> torch.Tensor:
    """A stream's bf16 tensor, into `out` when given (a reused buffer). check: raise ArtifactError naming the
    tensor if a lane does not decode cleanly (a server checks each stream once, at load: reading the status
    back would stall a GPU at every layer)."""
    from kernels import neuzip_decode

    out = torch.empty(s.shape, dtype=torch.bfloat16, device=s.words.device) if out is None else out
    status = neuzip_decode(s.words, s.offsets, s.table, s.sm, s.bits, out.view(torch.int16).view(-1))
    if check and bool(status.any()):
        raise ArtifactError(f"tensor '{s.name}': {int(status.ne(0).sum())} lanes do not decode cleanly (corrupt)")
    return out


def decompress(nzp: str | Path, out: str | Path) -> int:
    """The weights as a safetensors file (bf16 as decoded), atomically; returns its tensor count."""
    f = NzpFile(nzp)
    tensors = {name: f.tensor(name) for name in f.records}
    save_tensors(out, tensors, metadata=f.header.metadata or None)
    return len(tensors)


# ---- model directories


def cast_to_bf16(model_dir: Path) -> bool:
    """Rewrite a HF model directory's float32 weights as bfloat16, in place, as one model.safetensors (NeuZip
    codes bf16); True if anything was cast. config.json then says bfloat16, so transformers loads it so."""
    weights = SafetensorsSource(model_dir)
    if not any(weights[n].dtype == torch.float32 for n in weights):
        return False
    tensors = {n: weights[n].to(torch.bfloat16) if weights[n].dtype == torch.float32 else weights[n] for n in weights}
    files = weight_files(model_dir)
    save_tensors(model_dir / SINGLE_FILE, tensors, metadata={"format": "pt"})
    for f in files:
        if f.name != SINGLE_FILE:
            f.unlink()
    (model_dir / INDEX_FILE).unlink(missing_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    config["dtype"] = "bfloat16"
    config.pop("torch_dtype", None)
    atomic_write(model_dir / "config.json", [json.dumps(config, indent=2).encode()])
    return True


def encode_dir(model_dir: Path, bits: int, progress: Callable[[str], None] | None = None,
               keep_weights: bool = False, lane: int = neuzip.LANE) -> tuple[NzpStats, bool]:
    """Add NEUZIP_FILE to a HF model directory, in place, float32 weights cast to bf16 first; without keep_weights
    its safetensors then go (a store keeps them: the lossless reference its variants are coded against).
    -> (stats, whether float32 was cast)."""
    cast = cast_to_bf16(model_dir)
    weights = SafetensorsSource(model_dir)
    stats = compress({n: weights[n] for n in weights}, bits, model_dir / NEUZIP_FILE, progress=progress, lane=lane)
    if not keep_weights:
        for f in weight_files(model_dir):
            f.unlink()
        (model_dir / INDEX_FILE).unlink(missing_ok=True)
    return stats, cast


def compress_dir(model_dir: str | Path, bits: int, out_dir: str | Path,
                 progress: Callable[[str], None] | None = None, lane: int = neuzip.LANE) -> tuple[NzpStats, bool]:
    """A HF model directory -> out_dir (atomically) with its config, tokenizer and NEUZIP_FILE."""
    neuzip.check_lane(lane)
    with atomic_dir(out_dir) as staged:
        shutil.copytree(model_dir, staged, dirs_exist_ok=True, ignore=shutil.ignore_patterns(*NOT_COPIED))
        return encode_dir(staged, bits, progress, lane=lane)


def decompress_dir(in_dir: str | Path, out_dir: str | Path) -> int:
    """A NeuZip model directory -> a HF model directory with the decoded bf16 weights; returns the tensor count."""
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    nzp = in_dir / NEUZIP_FILE
    if not nzp.is_file():
        raise ArtifactError(f"{in_dir}: no {NEUZIP_FILE} in this directory")
    with atomic_dir(out_dir) as staged:
        shutil.copytree(in_dir, staged, dirs_exist_ok=True, ignore=shutil.ignore_patterns(*NOT_COPIED, NEUZIP_FILE))
        return decompress(nzp, staged / SINGLE_FILE)


def add_base(store: "Store", name: str, model_dir: str | Path, bits: int,
             progress: Callable[[str], None] | None = None, lane: int = neuzip.LANE
             ) -> tuple["BaseEntry", NzpStats, bool]:
    """Store a base to be served in NeuZip form: its weights as bf16 safetensors (the lossless reference its
    variants are coded against and a lossy base's full variants decode from) and NEUZIP_FILE beside them, `lane`
    symbols a lane (neuzip.LANE_GPU for a GPU server). -> (entry, stats, whether float32 was cast)."""
    neuzip.check_bits(bits)
    neuzip.check_lane(lane)
    done: list[tuple[NzpStats, bool]] = []
    entry = store.add_base(name, model_dir, derive=lambda staged: done.append(
        encode_dir(staged, bits, progress, keep_weights=True, lane=lane)), neuzip_bits=bits)
    return entry, *done[0]
