"""`manyfold`: the command line. Every failure is one line on stderr and a non-zero exit (2 for usage)."""

import argparse
import json
import os
import sys
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from serve.errors import ConfigError, ManyfoldError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@contextmanager
def _progress(desc: str, total: int | None = None):
    """A tqdm bar on stderr, advanced by calling the yielded function once per item."""
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, leave=False,
              disable=None if sys.stderr.isatty() else True) as bar:
        yield lambda _name: bar.update(1)


def _human(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def _tensors(path: str):
    from serve.store.tensors import SafetensorsSource

    return SafetensorsSource(path)


def cmd_fmdelta_compress(args: argparse.Namespace) -> None:
    from serve.codecs.fmdelta_file import compress

    base, fine = _tensors(args.base), _tensors(args.finetuned)
    with _progress("compress", len(fine)) as tick:
        stats = compress(base, fine, args.out, metadata=fine.metadata, workers=args.workers, progress=tick)
    print(f"{args.out}: {_human(stats.raw_bytes)} -> {_human(stats.file_bytes)} ({stats.ratio:.1%}); "
          f"tensors by codec: {json.dumps(stats.codecs)}")


def cmd_fmdelta_decompress(args: argparse.Namespace) -> None:
    from serve.codecs.fmdelta_file import FmdFile, decompress

    total = len(FmdFile(args.delta).records)
    with _progress("decompress", total) as tick:
        n = decompress(args.delta, _tensors(args.base), args.out, workers=args.workers, progress=tick)
    print(f"{args.out}: {n} tensors, bit-identical to the fine-tune (checksums verified)")


def _store(args: argparse.Namespace, create: bool = False):
    from serve.store.store import Store

    return Store(args.store, create=create)


def cmd_store_list(args: argparse.Namespace) -> None:
    rows = _store(args).summary()
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'name':<24} {'kind':<6} {'base':<10} {'architecture':<34} {'stored':>10} {'raw':>10} {'ratio':>7}")
    for r in rows:
        ratio = f"{r['stored_bytes'] / r['raw_bytes']:.1%}" if r["raw_bytes"] else "-"
        print(f"{r['name']:<24} {r['kind']:<6} {r['base']:<10} {r['architecture']:<34} "
              f"{_human(r['stored_bytes']):>10} {_human(r['raw_bytes']):>10} {ratio:>7}")


def cmd_store_add(args: argparse.Namespace) -> None:
    store = _store(args, create=True)
    if args.kind == "base" and args.neuzip_bits is not None:
        from serve.codecs.neuzip_file import add_base

        with _progress("neuzip") as tick:
            entry, stats, cast = add_base(store, args.name, args.model, args.neuzip_bits, progress=tick)
        print(f"added base '{entry.name}' ({entry.architecture}, {entry.params:,} params) in NeuZip form: "
              f"{_neuzip_summary(stats, cast)}")
        return
    if args.kind == "base":
        entry = store.add_base(args.name, args.model)
        print(f"added base '{entry.name}' ({entry.architecture}, {entry.params:,} params)")
        return
    if args.neuzip_bits is not None:
        raise ConfigError("--neuzip-bits is for --kind base")
    from serve.config import SlotsConfig
    from serve.variants import variant_kind

    kind = variant_kind(args.kind)
    if not args.base:
        raise ConfigError(f"store add --kind {args.kind} needs --base NAME (a base in the store)")
    with _progress(f"add {args.kind}") as tick:
        entry = kind.add(store, args.name, args.base, Path(args.model), progress=tick,
                         slots=SlotsConfig(max_rank=args.max_rank))
    stored = sum(f.bytes for f in entry.files)
    print(f"added {entry.kind} variant '{entry.name}' of '{entry.base}': {_human(entry.raw_bytes)} stored as "
          f"{_human(stored)} ({stored / max(entry.raw_bytes, 1):.1%})")


def cmd_store_remove(args: argparse.Namespace) -> None:
    _store(args).remove(args.name)
    print(f"removed '{args.name}'")


def cmd_store_verify(args: argparse.Namespace) -> None:
    from serve.variants import variant_kind

    store = _store(args)
    names = [args.name] if args.name else [*store.manifest.bases, *store.manifest.variants]
    for name in names:
        if name in store.manifest.bases:
            store.verify(store.manifest.bases[name])
        else:
            entry = store.variant(name)
            variant_kind(entry.kind).verify(store, entry)
        print(f"{name}: ok")


def cmd_store_extract(args: argparse.Namespace) -> None:
    from serve.store.manifest import MEMBER_SEP
    from serve.variants import variant_kind

    store = _store(args)
    entry = store.variant(args.name.split(MEMBER_SEP, 1)[0])  # an EMR task's model id names its group first
    print(variant_kind(entry.kind).extract(store, args.name, Path(args.out)))


def _base_dir(args: argparse.Namespace) -> Path:
    """--base as a HF model directory, or as the name of a base in --store."""
    if Path(args.base).is_dir():
        return Path(args.base)
    if not args.store:
        raise ConfigError(f"--base '{args.base}' is not a directory (give --store to name a store base)")
    return _store(args).base_dir(args.base)


def cmd_adapter_train(args: argparse.Namespace) -> None:
    from serve.adapters.train import train_adapter

    targets = args.target_modules if args.target_modules == "all-linear" else args.target_modules.split(",")
    result = train_adapter(_base_dir(args), Path(args.data), Path(args.out), init=args.init, rank=args.rank,
                           alpha=args.alpha, steps=args.steps, lr=args.lr, batch_size=args.batch_size,
                           max_length=args.max_length, target_modules=targets, seed=args.seed)
    print(f"{result.out_dir}: {args.init} adapter, rank {args.rank}, {args.steps} steps, loss "
          f"{result.losses[0]:.3f} -> {result.losses[-1]:.3f} ({result.train_seconds:.0f} s); "
          f"train_log.json beside it")
    if args.discriminator:
        from serve.adapters.data import read_jsonl
        from serve.adapters.translora import train_discriminator

        name = args.task_name or Path(args.data).stem
        d = train_discriminator(_base_dir(args), result.out_dir, read_jsonl(args.data), name, seeds=args.seeds,
                                seed=args.seed)
        print(f"{result.out_dir}/translora: a discriminator for '{name}' ({d['real']} real inputs against "
              f"{d['generated']} generated, loss {d['losses'][0]:.3f} -> {d['losses'][-1]:.3f}) and "
              f"{args.seeds} seed examples")


def _print_transfer(report, out: Path) -> None:
    print(f"{out}: {report.accepted} of {report.attempts} generated inputs accepted"
          f"{'' if report.filtered else ' (no filter)'}; loss {report.losses[0]:.3f} -> {report.losses[-1]:.3f}; "
          f"{out / 'translora_report.json'}" + (f"; {report.note}" if report.note else ""))


def cmd_translora(args: argparse.Namespace) -> None:
    from serve.adapters.translora import transfer

    with _progress("translora") as tick:
        report = transfer(args.source_base, args.adapter, args.target_base, Path(args.out), samples=args.samples,
                          max_attempts=args.max_attempts, use_filter=not args.no_filter, init=args.init,
                          steps=args.steps, lr=args.lr, seed=args.seed, progress=lambda *a: tick(a))
    _print_transfer(report, Path(args.out))


def cmd_store_translora(args: argparse.Namespace) -> None:
    from serve.adapters.translora import TransferFailed, transfer_store

    failed = 0
    for outcome, line in transfer_store(_store(args), args.from_base, args.to_base, samples=args.samples,
                                        max_attempts=args.max_attempts, steps=args.steps, lr=args.lr, seed=args.seed):
        print(line, flush=True)
        failed += outcome == "failed"
    if failed:
        raise TransferFailed(f"{failed} adapter{'s' if failed > 1 else ''} could not move (above); the others "
                             f"did, and a second run retries only what is not done")


def cmd_adapter_convert(args: argparse.Namespace) -> None:
    from serve.adapters.convert import convert_pissa

    print(f"{convert_pissa(Path(args.adapter), Path(args.initial), Path(args.out))}: a rank-2r LoRA on the "
          f"original base")


def cmd_emr_merge(args: argparse.Namespace) -> None:
    from serve.codecs.emr import describe, merge, read_merge_args

    tasks = read_merge_args(args.task)
    with _progress("merge") as tick:
        bundle = merge(_base_dir(args), tasks, Path(args.out), rescaler=args.rescaler, progress=tick)
    m = bundle.manifest
    print(f"{bundle.path}: {len(m.tasks)} tasks over {m.merged_params:,} merged weights ({m.rescaler} rescalers)")
    print(f"{'task':<24} {'lambda':>8} {'mask bits set':>14} {'share':>7}  labels")
    for r in describe(bundle):
        print(f"{r['task']:<24} {r['rescaler']:>8.4f} {r['mask_bits']:>14,} {r['mask_share']:>7.1%}  "
              f"{', '.join(r['labels'] or []) or '-'}")


def cmd_emr_extract(args: argparse.Namespace) -> None:
    from serve.codecs.emr import extract

    print(extract(Path(args.bundle), args.task, Path(args.out), base_dir=Path(args.base) if args.base else None))


def _neuzip_summary(stats, cast: bool) -> str:
    what = "lossless" if stats.bits == 7 else f"{stats.bits} mantissa bits kept"
    return (f"{stats.codecs['neuzip']} weights coded ({what}): {_human(stats.coded_raw_bytes)} of bf16 -> "
            f"{_human(stats.coded_raw_bytes * stats.coded_ratio)} ({stats.coded_ratio:.1%}); "
            f"{stats.codecs['raw']} tensors kept raw (embeddings, norms, biases)"
            + ("; float32 weights were cast to bfloat16 first" if cast else ""))


def cmd_neuzip_compress(args: argparse.Namespace) -> None:
    from serve.codecs.neuzip_file import compress_dir

    with _progress("neuzip") as tick:
        stats, cast = compress_dir(args.model, args.bits, args.out, progress=tick)
    print(f"{args.out}: {_neuzip_summary(stats, cast)}")


def cmd_neuzip_decompress(args: argparse.Namespace) -> None:
    from serve.codecs.neuzip_file import decompress_dir

    n = decompress_dir(getattr(args, "in"), args.out)
    print(f"{args.out}: {n} tensors, bf16 as decoded (checksums verified)")


def cmd_bench_emr(args: argparse.Namespace) -> None:
    from serve.bench.emr import run_emr_bench

    run_emr_bench(Path(args.out), args.examples, args.rows, args.repeats)


def cmd_bench_neuzip(args: argparse.Namespace) -> None:
    from serve.bench.neuzip import run_neuzip_bench

    run_neuzip_bench(Path(args.out), Path(args.work) if args.work else None)


def cmd_bench_translora(args: argparse.Namespace) -> None:
    from serve.bench.translora import run_translora_bench

    run_translora_bench(Path(args.out), Path(args.work) if args.work else None)


def cmd_bench_mixed(args: argparse.Namespace) -> None:
    from serve.bench.mixed import run_mixed_bench

    run_mixed_bench(Path(args.out), tuple(int(r) for r in args.rows.split(",")), args.repeats)


def cmd_demo(args: argparse.Namespace) -> None:
    from serve.demo import build_demo_store, demo_store_dir

    root = Path(args.store) if args.store else demo_store_dir()
    build_demo_store(root, log=lambda m: print(m, file=sys.stderr))
    print(f"demo store: {root}")
    cmd_store_list(argparse.Namespace(store=root, json=False))
    if args.no_serve:
        return
    from serve.app import run_server

    config = _serve_config(args, root)
    run_server(config, ready=lambda url: _print_examples(url, config))


def _serve_config(args: argparse.Namespace, store: Path):
    from serve.config import load_config, parse_config

    if getattr(args, "config", None):
        return load_config(args.config, store=str(store) if store else None, port=args.port)
    if store is None:
        raise ConfigError("serve needs --store DIR or --config FILE")
    return parse_config({"store": str(store), "port": args.port or 8000})


def _print_examples(url: str, config) -> None:
    from serve.store.store import Store

    store = Store(config.store)
    lines = [f"serving {config.store} at {url}  (Ctrl-C to stop)", "", "try:"]
    classifiers = [m for v in store.manifest.variants.values() for m, labels in v.models().items() if labels]
    if classifiers:
        lines.append(f"  curl -s {url}/v1/classify -H 'Content-Type: application/json' "
                     f"-d '{{\"model\": \"{classifiers[0]}\", \"input\": \"a short text to classify\"}}'")
    for b in store.manifest.bases.values():
        if b.architecture.endswith("ForCausalLM"):
            lines.append(f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' "
                         f"-d '{{\"model\": \"{b.name}\", \"messages\": [{{\"role\": \"user\", "
                         f"\"content\": \"Hello!\"}}], \"max_tokens\": 32}}'")
        elif b.architecture == "BertModel":
            lines.append(f"  curl -s {url}/v1/embeddings -H 'Content-Type: application/json' "
                         f"-d '{{\"model\": \"{b.name}\", \"input\": \"hello\"}}'")
    lines += [f"  curl -s {url}/v1/models", f"  curl -s {url}/metrics", "",
              f"  python -c \"from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key='none'); "
              f"print([m.id for m in c.models.list()])\""]
    print("\n".join(lines), flush=True)


def cmd_serve(args: argparse.Namespace) -> None:
    from serve.app import run_server

    config = _serve_config(args, Path(args.store) if args.store else None)
    run_server(config, ready=lambda url: _print_examples(url, config))


def cmd_bench_fmdelta(args: argparse.Namespace) -> None:
    from serve.bench.fmdelta import run_fmdelta_bench

    run_fmdelta_bench(Path(args.store) if args.store else None, Path(args.out), args.repeats, args.max_mb)


def cmd_bench_coldstart(args: argparse.Namespace) -> None:
    from serve.bench.coldstart import run_coldstart_bench

    run_coldstart_bench(Path(args.store) if args.store else None, Path(args.out), args.repeats)


def cmd_bench_generation(args: argparse.Namespace) -> None:
    from serve.bench.generation import run_generation_bench

    run_generation_bench(Path(args.store) if args.store else None, Path(args.out), args.rate, args.duration,
                         args.max_tokens)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="manyfold", description="Serve many fine-tuned variants of one base model.")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True)

    def add(parent, name: str, fn: Callable, help: str) -> argparse.ArgumentParser:
        sp = parent.add_parser(name, help=help, description=help)
        sp.set_defaults(fn=fn)
        return sp

    demo = add(sub, "demo", cmd_demo, "build the demo store (cached) and show what it holds")
    demo.add_argument("--store", help="where to build it (default: $MANYFOLD_HOME/demo-store)")
    demo.add_argument("--port", type=int, default=8000, help="HTTP port on 127.0.0.1")
    demo.add_argument("--no-serve", action="store_true", help="build the store and stop")

    srv = add(sub, "serve", cmd_serve, "serve a store over HTTP on Ray Serve (127.0.0.1 by default)")
    srv.add_argument("--store", help="the store (or `store:` in --config)")
    srv.add_argument("--config", help="ServeConfig as YAML or JSON (see deploy/serve-config.yaml)")
    srv.add_argument("--port", type=int, default=None)

    fmd = sub.add_parser("fmdelta", help="lossless FM-Delta files").add_subparsers(dest="action", required=True)
    c = add(fmd, "compress", cmd_fmdelta_compress, "code a fine-tune as an FM-Delta file against its base")
    c.add_argument("--base", required=True, help="base: .safetensors file or HF model directory")
    c.add_argument("--finetuned", required=True, help="fine-tune: .safetensors file or HF model directory")
    c.add_argument("--out", required=True, help="the .fmd file to write")
    c.add_argument("--workers", type=int, default=None, help="threads (default: all cores)")
    d = add(fmd, "decompress", cmd_fmdelta_decompress, "rebuild the fine-tune, bit-identical")
    d.add_argument("--base", required=True)
    d.add_argument("--delta", required=True)
    d.add_argument("--out", required=True, help="the .safetensors file to write")
    d.add_argument("--workers", type=int, default=None)

    nz = sub.add_parser("neuzip", help="NeuZip model directories").add_subparsers(dest="action", required=True)
    c = add(nz, "compress", cmd_neuzip_compress, "a HF model directory -> NeuZip form (float32 cast to bf16)")
    c.add_argument("--model", required=True, help="a HF model directory")
    c.add_argument("--bits", type=int, choices=[0, 1, 3, 7], default=7, help="mantissa bits kept (7: lossless)")
    c.add_argument("--out", required=True, help="a new directory")
    d = add(nz, "decompress", cmd_neuzip_decompress, "NeuZip form -> a HF model directory of bf16 weights")
    d.add_argument("--in", required=True, help="a directory written by neuzip compress")
    d.add_argument("--out", required=True, help="a new directory")

    st = sub.add_parser("store", help="the variant store").add_subparsers(dest="action", required=True)
    default_store = os.environ.get("MANYFOLD_STORE")
    for name, fn, help in [("list", cmd_store_list, "list bases and variants with their sizes"),
                           ("add", cmd_store_add, "add a base model or a variant of any kind"),
                           ("remove", cmd_store_remove, "remove a variant (or a base without variants)"),
                           ("verify", cmd_store_verify, "check every file's checksum and decode full variants"),
                           ("extract", cmd_store_extract, "write a variant back out as a HF model directory"),
                           ("translora", cmd_store_translora, "move every adapter of one base to another "
                                                              "(Trans-LoRA; resumable)")]:
        sp = add(st, name, fn, help)
        sp.add_argument("--store", default=default_store, required=default_store is None)
    st.choices["list"].add_argument("--json", action="store_true")
    st.choices["add"].add_argument("--kind", required=True,
                                   help="base, or a variant kind: full, lora, pissa, emr (see serve/variants/)")
    st.choices["add"].add_argument("--name", required=True)
    st.choices["add"].add_argument("--model", required=True,
                                   help="a HF model directory (base, full), a PEFT adapter directory (lora, pissa) "
                                        "or an EMR bundle (emr: adding a group again replaces it whole)")
    st.choices["add"].add_argument("--base", help="for a variant: the store base it was fine-tuned from")
    st.choices["add"].add_argument("--neuzip-bits", type=int, choices=[0, 1, 3, 7], default=None,
                                   help="for a base: serve it in NeuZip form keeping this many mantissa bits "
                                        "(7: lossless)")
    st.choices["add"].add_argument("--max-rank", type=int, default=64,
                                   help="adapters: the largest rank the server's slots take (slots.max_rank)")
    st.choices["remove"].add_argument("name")
    st.choices["verify"].add_argument("name", nargs="?")
    st.choices["extract"].add_argument("--name", required=True, help="a variant, or an EMR task: GROUP/TASK")
    st.choices["extract"].add_argument("--out", required=True)
    tr = st.choices["translora"]
    tr.add_argument("--from", dest="from_base", required=True, help="the base whose adapters move")
    tr.add_argument("--to", dest="to_base", required=True, help="the base they move to")
    tr.add_argument("--samples", type=int, default=64)
    tr.add_argument("--max-attempts", type=int, default=None)
    tr.add_argument("--steps", type=int, default=100)
    tr.add_argument("--lr", type=float, default=5e-4)
    tr.add_argument("--seed", type=int, default=0)

    ad = sub.add_parser("adapter", help="LoRA / PiSSA adapters with PEFT").add_subparsers(dest="action",
                                                                                          required=True)
    t = add(ad, "train", cmd_adapter_train, "train an adapter (PiSSA by default) and write its servable form")
    t.add_argument("--base", required=True, help="a HF model directory, or a base's name in --store")
    t.add_argument("--store", default=default_store)
    t.add_argument("--data", required=True, help='JSONL: {"prompt", "completion"} or {"text"} per line')
    t.add_argument("--init", default="pissa", help="pissa, pissa_niter_K (randomised SVD, K iterations) or lora")
    t.add_argument("--rank", type=int, default=16)
    t.add_argument("--alpha", type=float, default=None, help="lora_alpha (default: the rank)")
    t.add_argument("--steps", type=int, default=100)
    t.add_argument("--lr", type=float, default=2e-4)
    t.add_argument("--batch-size", type=int, default=4)
    t.add_argument("--max-length", type=int, default=128)
    t.add_argument("--target-modules", default="all-linear", help="all-linear, or names joined by commas")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", required=True, help="a new directory")
    t.add_argument("--discriminator", action="store_true",
                   help="also keep seed examples and train a Trans-LoRA discriminator beside the adapter")
    t.add_argument("--task-name", help="the task's name in the discriminator's prompt (default: the data file's)")
    t.add_argument("--seeds", type=int, default=5, help="seed examples kept for a later transfer")
    cv = add(ad, "convert", cmd_adapter_convert, "a trained PiSSA adapter -> a rank-2r LoRA on the original base")
    cv.add_argument("--adapter", required=True, help="the trained (raw) PiSSA adapter directory")
    cv.add_argument("--initial", required=True, help="the untrained PiSSA adapter saved before training")
    cv.add_argument("--out", required=True, help="a new directory")

    tl = add(sub, "translora", cmd_translora, "move an adapter to another base with synthetic data (Trans-LoRA)")
    tl.add_argument("--source-base", required=True, help="the HF model directory the adapter was trained on")
    tl.add_argument("--adapter", required=True, help="an adapter trained with --discriminator")
    tl.add_argument("--target-base", required=True, help="the HF model directory to move it to")
    tl.add_argument("--out", required=True, help="a new directory")
    tl.add_argument("--samples", type=int, default=64, help="synthetic inputs to keep")
    tl.add_argument("--max-attempts", type=int, default=None, help="inputs generated at most (default: 4x samples)")
    tl.add_argument("--no-filter", action="store_true", help="keep every generated input (the ablation)")
    tl.add_argument("--init", default="pissa", help="the new adapter's init: pissa, pissa_niter_K or lora")
    tl.add_argument("--steps", type=int, default=100)
    tl.add_argument("--lr", type=float, default=5e-4)
    tl.add_argument("--seed", type=int, default=0)

    em = sub.add_parser("emr", help="EMR-Merging groups").add_subparsers(dest="action", required=True)
    mg = add(em, "merge", cmd_emr_merge, "merge full fine-tunes of one base into an EMR bundle")
    mg.add_argument("--base", required=True, help="a HF model directory, or a base's name in --store")
    mg.add_argument("--store", default=default_store)
    mg.add_argument("--task", action="append", required=True, metavar="NAME=DIR",
                    help="a task and its fine-tune (a HF model directory); repeat for each task")
    mg.add_argument("--rescaler", choices=["mean", "global"], default="mean",
                    help="mean: per-tensor means, as the reference code (default); global: the paper's sums")
    mg.add_argument("--out", required=True, help="the bundle directory (an old bundle is replaced when complete)")
    ex = add(em, "extract", cmd_emr_extract, "write one task of a bundle as a HF model directory")
    ex.add_argument("--bundle", required=True)
    ex.add_argument("--task", required=True)
    ex.add_argument("--base", help="the base's HF model directory (default: where merge read it)")
    ex.add_argument("--out", required=True)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="action", required=True)
    b = add(bench, "fmdelta", cmd_bench_fmdelta, "FM-Delta against lzma, zstd and XOR baselines on the demo fine-tunes")
    b.add_argument("--store", help="store with full variants (default: the demo store, built if missing)")
    b.add_argument("--out", default="bench-results/fmdelta.json")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--max-mb", type=float, default=200.0, help="skip fine-tunes larger than this")
    cs = add(bench, "coldstart", cmd_bench_coldstart, "a variant's first and later requests against loading it in full")
    cs.add_argument("--store", help="store with full variants (default: the demo store, built if missing)")
    cs.add_argument("--out", default="bench-results/coldstart.json")
    cs.add_argument("--repeats", type=int, default=3)
    g = add(bench, "generation", cmd_bench_generation, "continuous batching against one request at a time")
    g.add_argument("--store", help="store with SmolLM2 and its variants (default: the demo store)")
    g.add_argument("--out", default="bench-results/generation.json")
    g.add_argument("--rate", type=float, default=4.0, help="offered requests per second")
    g.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per mode")
    g.add_argument("--max-tokens", type=int, default=24)
    mx = add(bench, "mixed", cmd_bench_mixed, "one forward for rows of many variants against the alternatives")
    mx.add_argument("--out", default="bench-results/mixed.json")
    mx.add_argument("--repeats", type=int, default=5)
    mx.add_argument("--rows", default="8,32", help="batch sizes, joined by commas")
    be = add(bench, "emr", cmd_bench_emr, "EMR-Merging against the individual fine-tunes, task arithmetic, TIES and "
             "averaging; its bytes per task; a mixed forward's time")
    be.add_argument("--out", default="bench-results/emr.json")
    be.add_argument("--examples", type=int, default=500, help="held-out examples per task at most")
    be.add_argument("--rows", type=int, default=16, help="rows of the timed forward (a multiple of 4)")
    be.add_argument("--repeats", type=int, default=5)
    bt = add(bench, "translora", cmd_bench_translora, "Trans-LoRA on two real tasks; PiSSA against LoRA")
    bt.add_argument("--out", default="bench-results/translora.json")
    bt.add_argument("--work", help="where adapters and the target base are kept (default: "
                                   "$MANYFOLD_HOME/bench-translora; finished parts are reused)")
    bn = add(bench, "neuzip", cmd_bench_neuzip, "NeuZip bases against bf16 and int8 on SmolLM2 and MiniLM")
    bn.add_argument("--out", default="bench-results/neuzip.json")
    bn.add_argument("--work", help="where the bf16 and NeuZip copies of the models are kept "
                                   "(default: $MANYFOLD_HOME/bench-neuzip)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.fn(args)
    except ManyfoldError as e:
        if args.debug:
            raise
        print(f"manyfold: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    except KeyboardInterrupt:
        print("manyfold: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one line for the user; the traceback with --debug
        if args.debug:
            raise
        print(f"manyfold: error: internal error: {type(e).__name__}: {e} (run with --debug for details)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
