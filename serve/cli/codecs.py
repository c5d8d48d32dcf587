"""`manyfold fmdelta | neuzip | emr`: the codecs' files on their own, outside any store."""

import argparse
import json
from pathlib import Path

from serve.cli.args import add_command, base_dir
from serve.cli.console import human_bytes, progress, table
from serve.errors import ConfigError


def _tensors(path: str):
    from serve.store.tensors import SafetensorsSource

    return SafetensorsSource(path)


def cmd_fmdelta_compress(args: argparse.Namespace) -> None:
    from serve.codecs.fmdelta_file import compress

    base, fine = _tensors(args.base), _tensors(args.finetuned)
    with progress("compress", len(fine)) as tick:
        stats = compress(base, fine, args.out, metadata=fine.metadata, workers=args.workers, progress=tick)
    print(f"{args.out}: {human_bytes(stats.raw_bytes)} -> {human_bytes(stats.file_bytes)} ({stats.ratio:.1%}); "
          f"tensors by codec: {json.dumps(stats.codecs)}")


def cmd_fmdelta_decompress(args: argparse.Namespace) -> None:
    from serve.codecs.fmdelta_file import FmdFile, decompress

    total = len(FmdFile(args.delta).records)
    with progress("decompress", total) as tick:
        n = decompress(args.delta, _tensors(args.base), args.out, workers=args.workers, progress=tick)
    print(f"{args.out}: {n} tensors, bit-identical to the fine-tune (checksums verified)")


def neuzip_summary(stats, cast: bool) -> str:
    """One line on a NeuZip coding: what was coded, how small it became, what was kept raw."""
    what = "lossless" if stats.bits == 7 else f"{stats.bits} mantissa bits kept"
    return (f"{stats.codecs['neuzip']} weights coded ({what}): {human_bytes(stats.coded_raw_bytes)} of bf16 -> "
            f"{human_bytes(stats.coded_raw_bytes * stats.coded_ratio)} ({stats.coded_ratio:.1%}); "
            f"{stats.codecs['raw']} tensors kept raw (embeddings, norms, biases)"
            + ("; float32 weights were cast to bfloat16 first" if cast else ""))


def neuzip_lane(value: str) -> int:
    """--lane / --neuzip-lane as a number of symbols; a bad one is a ConfigError."""
    from serve.codecs.neuzip import lane_of

    try:
        return lane_of(value)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def cmd_neuzip_compress(args: argparse.Namespace) -> None:
    from serve.codecs.neuzip_file import compress_dir

    lane = neuzip_lane(args.lane)
    with progress("neuzip") as tick:
        stats, cast = compress_dir(args.model, args.bits, args.out, progress=tick, lane=lane)
    print(f"{args.out}: {neuzip_summary(stats, cast)}")


def cmd_neuzip_decompress(args: argparse.Namespace) -> None:
    from serve.codecs.neuzip_file import decompress_dir

    n = decompress_dir(getattr(args, "in"), args.out)
    print(f"{args.out}: {n} tensors, bf16 as decoded (checksums verified)")


def cmd_emr_merge(args: argparse.Namespace) -> None:
    from serve.codecs.emr import describe, merge, read_merge_args

    tasks = read_merge_args(args.task)
    with progress("merge") as tick:
        bundle = merge(base_dir(args), tasks, Path(args.out), rescaler=args.rescaler, progress=tick)
    m = bundle.manifest
    print(f"{bundle.path}: {len(m.tasks)} tasks over {m.merged_params:,} merged weights ({m.rescaler} rescalers)")
    cells = [[r["task"], f"{r['rescaler']:.4f}", f"{r['mask_bits']:,}", f"{r['mask_share']:.1%}",
              ", ".join(r["labels"] or []) or "-"] for r in describe(bundle)]
    print("\n".join(table(["task", "lambda", "mask bits set", "share", "labels"], cells,
                           right=frozenset({1, 2, 3}))))


def cmd_emr_extract(args: argparse.Namespace) -> None:
    from serve.codecs.emr import extract

    print(extract(Path(args.bundle), args.task, Path(args.out), base_dir=Path(args.base) if args.base else None))


def add_fmdelta_commands(sub: argparse._SubParsersAction) -> None:
    fmd = sub.add_parser("fmdelta", help="lossless FM-Delta files").add_subparsers(dest="action", required=True)
    c = add_command(fmd, "compress", cmd_fmdelta_compress, "code a fine-tune as an FM-Delta file against its base")
    c.add_argument("--base", required=True, help="base: .safetensors file or HF model directory")
    c.add_argument("--finetuned", required=True, help="fine-tune: .safetensors file or HF model directory")
    c.add_argument("--out", required=True, help="the .fmd file to write")
    c.add_argument("--workers", type=int, default=None, help="threads (default: all cores)")
    d = add_command(fmd, "decompress", cmd_fmdelta_decompress, "rebuild the fine-tune, bit-identical")
    d.add_argument("--base", required=True)
    d.add_argument("--delta", required=True)
    d.add_argument("--out", required=True, help="the .safetensors file to write")
    d.add_argument("--workers", type=int, default=None)


LANE_HELP = ("symbols a lane: cpu (the default), gpu (shorter: a GPU's decoder runs a lane's steps one after "
             "another in one thread) or a number")


def add_neuzip_commands(sub: argparse._SubParsersAction) -> None:
    nz = sub.add_parser("neuzip", help="NeuZip model directories").add_subparsers(dest="action", required=True)
    c = add_command(nz, "compress", cmd_neuzip_compress, "a HF model directory -> NeuZip form (float32 cast to bf16)")
    c.add_argument("--model", required=True, help="a HF model directory")
    c.add_argument("--bits", type=int, choices=[0, 1, 3, 7], default=7, help="mantissa bits kept (7: lossless)")
    c.add_argument("--out", required=True, help="a new directory")
    c.add_argument("--lane", default="cpu", help=LANE_HELP)
    d = add_command(nz, "decompress", cmd_neuzip_decompress, "NeuZip form -> a HF model directory of bf16 weights")
    d.add_argument("--in", required=True, help="a directory written by neuzip compress")
    d.add_argument("--out", required=True, help="a new directory")


def add_emr_commands(sub: argparse._SubParsersAction, default_store: str | None) -> None:
    em = sub.add_parser("emr", help="EMR-Merging groups").add_subparsers(dest="action", required=True)
    mg = add_command(em, "merge", cmd_emr_merge, "merge full fine-tunes of one base into an EMR bundle")
    mg.add_argument("--base", required=True, help="a HF model directory, or a base's name in --store")
    mg.add_argument("--store", default=default_store)
    mg.add_argument("--task", action="append", required=True, metavar="NAME=DIR",
                    help="a task and its fine-tune (a HF model directory); repeat for each task")
    mg.add_argument("--rescaler", choices=["mean", "global"], default="mean",
                    help="mean: per-tensor means, as the reference code (default); global: the paper's sums")
    mg.add_argument("--out", required=True, help="the bundle directory (an old bundle is replaced when complete)")
    ex = add_command(em, "extract", cmd_emr_extract, "write one task of a bundle as a HF model directory")
    ex.add_argument("--bundle", required=True)
    ex.add_argument("--task", required=True)
    ex.add_argument("--base", help="the base's HF model directory (default: where merge read it)")
    ex.add_argument("--out", required=True)
