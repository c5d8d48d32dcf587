"""`manyfold bench fmdelta`: FM-Delta against general-purpose and XOR baselines on real fine-tunes.

For every full variant of the store, as stored (fp32) and as a bf16 copy (base and fine-tune both cast):
size ratios of FM-Delta, of the order-0 bound of its streams, of lzma -9 and zstd -19 over the fine-tune's
raw bytes, and of a ZipNN-style baseline (XOR with the base, bytes grouped into planes, each plane at its
order-0 entropy: the ideal any Huffman coder of those planes could reach); then compression and
decompression speed on one core and on all cores (medians). Prints a table, writes JSON.
"""

import json
import lzma
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import zstandard

from serve.bench.report import machine, median_time
from serve.codecs.entropy import order0_bits
from serve.codecs.fmdelta_file import FmdFile, compress, match_base_name
from serve.store.store import Store
from serve.store.tensors import FLOAT_BITS, SafetensorsSource, as_bytes, dtype_name
from serve.variants.full import load_full_variant


def _raw_blob(tensors: dict[str, torch.Tensor]) -> bytes:
    return b"".join(as_bytes(t).tobytes() for t in tensors.values())


def xor_bytegroup_bytes(base: dict[str, torch.Tensor], fine: dict[str, torch.Tensor]) -> float:
    """ZipNN-style ideal: XOR each float tensor with its base, split bytes into planes, order-0 per plane."""
    planes: dict[tuple[int, int], np.ndarray] = {}
    other = 0
    for name, t in fine.items():
        b = base.get(match_base_name(name, set(base)) or "")
        if b is None or dtype_name(t) not in FLOAT_BITS or b.shape != t.shape or b.dtype != t.dtype:
            other += t.numel() * t.element_size()
            continue
        u = FLOAT_BITS[dtype_name(t)]
        x = (as_bytes(t).view(u) ^ as_bytes(b).view(u)).view(np.uint8).reshape(-1, np.dtype(u).itemsize)
        for i in range(x.shape[1]):
            key = (x.shape[1], i)
            planes[key] = planes.get(key, np.zeros(256, np.int64)) + np.bincount(x[:, i], minlength=256)
    return other + sum(order0_bits(c) for c in planes.values()) / 8


def _to_bf16(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()}


def bench_pair(label: str, base: dict[str, torch.Tensor], fine: dict[str, torch.Tensor], repeats: int,
               workdir: Path) -> dict:
    raw = _raw_blob(fine)
    n = len(raw)
    path = workdir / f"{label}.fmd"
    stats = compress(base, fine, path)
    # Lossless check on the way: every tensor's bytes after a full decode.
    decoded = FmdFile(path).decode_all(base)
    assert all(as_bytes(decoded[k]).tobytes() == as_bytes(v).tobytes() for k, v in fine.items()), label
    with ThreadPoolExecutor(2) as pool:  # both release the GIL; the slowest part of the benchmark
        lz = pool.submit(lambda: len(lzma.compress(raw, preset=9)))
        zs = pool.submit(lambda: len(zstandard.ZstdCompressor(level=19).compress(raw)))
        lzma_bytes, zstd_bytes = lz.result(), zs.result()
    cores = os.cpu_count() or 1
    speed = {}
    for workers in sorted({1, cores}):
        c = median_time(lambda: compress(base, fine, path, workers=workers), repeats)
        d = median_time(lambda: FmdFile(path).decode_all(base, workers=workers), repeats)
        speed[f"compress_mb_s_{workers}c"] = n / c / 1e6
        speed[f"decompress_mb_s_{workers}c"] = n / d / 1e6
    return {"fine_tune": label, "raw_mb": n / 1e6, "fmdelta": stats.file_bytes / n,
            "order0_bound": stats.order0_bytes / n, "vs_bound": stats.file_bytes / stats.order0_bytes,
            "lzma9": lzma_bytes / n, "zstd19": zstd_bytes / n, "xor_bytegroup": xor_bytegroup_bytes(base, fine) / n,
            "codecs": stats.codecs, **speed}


def print_table(rows: list[dict]) -> None:
    cores = os.cpu_count() or 1
    head = (f"{'fine-tune':<24} {'MB':>6} {'fmdelta':>8} {'bound':>7} {'vs bnd':>7} {'lzma-9':>7} {'zstd-19':>8} "
            f"{'xor+bg':>7} {'c 1c':>6} {'c ' + str(cores) + 'c':>6} {'d 1c':>6} {'d ' + str(cores) + 'c':>6}")
    print(head)
    for r in rows:
        print(f"{r['fine_tune']:<24} {r['raw_mb']:>6.1f} {r['fmdelta']:>8.2%} {r['order0_bound']:>7.2%} "
              f"{r['vs_bound'] - 1:>+7.3%} {r['lzma9']:>7.2%} {r['zstd19']:>8.2%} {r['xor_bytegroup']:>7.2%} "
              f"{r['compress_mb_s_1c']:>6.0f} {r[f'compress_mb_s_{cores}c']:>6.0f} "
              f"{r['decompress_mb_s_1c']:>6.0f} {r[f'decompress_mb_s_{cores}c']:>6.0f}")
    print("sizes: fraction of the fine-tune's raw bytes; bound: order-0 entropy of FM-Delta's symbol streams plus "
          "raw bits; vs bnd: FM-Delta file over that bound; xor+bg: XOR + byte grouping at its order-0 ideal; "
          "c/d: compression/decompression MB/s of fine-tune bytes (median), checksums included")


def run_fmdelta_bench(store_dir: Path | None, out: Path, repeats: int = 3, max_mb: float = 200.0) -> list[dict]:
    """max_mb: skip fine-tunes larger than this (lzma -9 runs at ~1.5 MB/s here: SmolLM2 would take an hour)."""
    if store_dir is None:
        from serve.demo import build_demo_store

        store = build_demo_store()
    else:
        store = Store(store_dir)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for v in store.manifest.variants.values():
            if v.kind != "full" or v.raw_bytes > max_mb * 1e6:
                continue
            src = SafetensorsSource(store.base_dir(v.base))
            base = {k: src[k] for k in src}
            fine = load_full_variant(store, v.name)
            rows.append(bench_pair(f"{v.name} fp32", base, fine, repeats, Path(tmp)))
            rows.append(bench_pair(f"{v.name} bf16", _to_bf16(base), _to_bf16(fine), repeats, Path(tmp)))
    print(f"machine: {machine()}")
    print_table(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "repeats": repeats, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return rows
