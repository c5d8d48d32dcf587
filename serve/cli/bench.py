"""`manyfold bench ...`: the benchmarks, each in serve/bench/, writing its JSON under bench-results/."""

import argparse
from pathlib import Path

from serve.cli.args import add_command
from serve.errors import ConfigError


def _store_dir(args: argparse.Namespace) -> Path | None:
    return Path(args.store) if args.store else None


def cmd_bench_fmdelta(args: argparse.Namespace) -> None:
    from serve.bench.fmdelta import run_fmdelta_bench

    run_fmdelta_bench(_store_dir(args), Path(args.out), args.repeats, args.max_mb)


def cmd_bench_coldstart(args: argparse.Namespace) -> None:
    from serve.bench.coldstart import run_coldstart_bench

    run_coldstart_bench(_store_dir(args), Path(args.out), args.repeats)


def cmd_bench_generation(args: argparse.Namespace) -> None:
    from serve.bench.generation import run_generation_bench

    run_generation_bench(_store_dir(args), Path(args.out), args.rate, args.duration, args.max_tokens)


def cmd_bench_structured(args: argparse.Namespace) -> None:
    from serve.bench.structured import run_structured_bench

    run_structured_bench(_store_dir(args), Path(args.out), args.max_tokens, args.repeats)


def cmd_bench_mixed(args: argparse.Namespace) -> None:
    from serve.bench.mixed import run_mixed_bench

    run_mixed_bench(Path(args.out), tuple(int(r) for r in args.rows.split(",")), args.repeats)


def cmd_bench_objects(args: argparse.Namespace) -> None:
    from serve.bench.objects import run_objects_bench

    run_objects_bench(Path(args.out), args.repeats)


def _fractions(text: str) -> tuple[float, ...]:
    """'0.5,0.9' -> (0.5, 0.9); 'none' -> (); anything else is one line."""
    if text.strip().lower() == "none":
        return ()
    try:
        out = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--traffic-rates: expected fractions such as 0.5,0.9 or 'none'; got '{text}'") from None
    if not all(0 < x for x in out):
        raise ConfigError(f"--traffic-rates: each rate must be above 0; got '{text}'")
    return out


def _layouts(text: str) -> tuple[str, ...]:
    from serve.bench.engine_traffic import LAYOUTS

    out = tuple(text.split(","))
    unknown = [x for x in out if x not in LAYOUTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown KV layout '{unknown[0]}'; expected some of {', '.join(LAYOUTS)}")
    return out


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1; got '{text}'")
    return n


def cmd_bench_engine(args: argparse.Namespace) -> None:
    from serve.bench.engine import run_engine_bench

    out = args.out or f"bench-results/engine-{'cpu' if args.device == 'cpu' else 'gpu'}.json"
    run_engine_bench(Path(out), Path(args.work), args.device, args.large, args.repeats, args.context,
                     args.shapes.split(",") if args.shapes else None, e2e=not args.no_end_to_end, rounds=args.rounds,
                     steps=not args.no_steps, profile=args.profile, traffic=args.traffic,
                     traffic_requests=args.traffic_requests, neuzip=not args.no_neuzip,
                     traffic_rates=_fractions(args.traffic_rates), kv_layouts=args.kv_layouts,
                     system_prompt_tokens=args.system_prompt_tokens, traffic_rounds=args.traffic_rounds)


def cmd_bench_gpu_check(args: argparse.Namespace) -> None:
    from serve.bench import gpu_check

    gpu_check.main(["--out", args.out, "--work", args.work, "--budget-s", str(args.budget_s)]
                   + (["--download", args.download] if args.download else []))


def cmd_bench_logprobs(args: argparse.Namespace) -> None:
    from serve.bench.logprobs_check import run_logprobs_check

    out = args.out or f"bench-results/logprobs-{'cpu' if args.device == 'cpu' else 'gpu'}.json"
    report = run_logprobs_check(Path(out), Path(args.work), args.device, args.shape, args.rows)
    if not report["passed"]:
        raise SystemExit(1)


def cmd_bench_emr(args: argparse.Namespace) -> None:
    from serve.bench.emr import run_emr_bench

    run_emr_bench(Path(args.out), args.examples, args.rows, args.repeats)


def cmd_bench_forms(args: argparse.Namespace) -> None:
    from serve.bench.forms import run_forms_bench

    run_forms_bench(Path(args.out), args.examples, args.repeats, args.only, args.mergekit)


def cmd_bench_translora(args: argparse.Namespace) -> None:
    from serve.bench.translora import TASKS, choose, merge_files, run_translora_bench
    from serve.bench.translora_ablation import CONFIGS
    from serve.bench.translora_targets import TARGETS

    if args.configs and not args.ablation:
        raise ConfigError("--configs picks configurations of the ablation: add --ablation")
    out = args.out or f"bench-results/translora{'-ablation' if args.ablation else ''}.json"
    if args.merge:
        merge_files([Path(p) for p in args.merge], Path(out))
        return
    run_translora_bench(Path(out), Path(args.work) if args.work else None, args.seeds,
                        choose(args.tasks, TASKS, "tasks"), choose(args.targets, TARGETS, "targets"),
                        inits=not args.no_inits, ablation=args.ablation, unfiltered=not args.no_unfiltered,
                        configs=choose(args.configs, CONFIGS, "configs"), first_seed=args.first_seed,
                        filtered=not args.no_filtered)


def cmd_bench_neuzip(args: argparse.Namespace) -> None:
    from serve.bench.neuzip import run_neuzip_bench

    run_neuzip_bench(Path(args.out), Path(args.work) if args.work else None, args.steps_only)


def cmd_bench_neuzip_gpu(args: argparse.Namespace) -> None:
    from serve.bench.neuzip_gpu import export, run_neuzip_gpu_bench

    if args.export:
        export(Path(args.export))
    else:
        run_neuzip_gpu_bench(Path(args.out), Path(args.src), Path(args.work), args.device, args.layers, args.repeats)


def cmd_bench_soak(args: argparse.Namespace) -> None:
    from serve.bench.soak import SoakSpec, run_soak_bench

    spec = SoakSpec(duration_s=args.duration_s, load=args.load, churn_s=args.churn_s, warmup_s=args.warmup_s,
                    probe_s=args.probe_s, probe_concurrency=args.probe_concurrency, timeout_s=args.timeout_s)
    run_soak_bench(_store_dir(args), Path(args.out), spec)


def _add_translora(bench: argparse._SubParsersAction) -> None:
    bt = add_command(bench, "translora", cmd_bench_translora,
                     "Trans-LoRA on five real tasks and five target bases over seeds; PiSSA against LoRA")
    bt.add_argument("--out", help="default: bench-results/translora.json, or translora-ablation.json")
    bt.add_argument("--work", help="where adapters, evaluations and the target bases are kept (default: "
                                   "$MANYFOLD_HOME/bench-translora; finished parts are reused)")
    bt.add_argument("--seeds", type=int, default=3, help="runs per configuration (seeds 0..N-1)")
    bt.add_argument("--first-seed", type=int, default=0, help="start at this seed (seeds K..K+N-1): the rest of a "
                    "set, run in another session, to --merge later")
    bt.add_argument("--merge", nargs="+", metavar="PART", help="instead, one report (--out) from the JSON of runs "
                    "over other seeds: their tables, seed by seed; nothing is trained")
    bt.add_argument("--tasks", help="a subset of spam,headlines,tweets,topics,sentiment, joined by commas (default: "
                                    "all; topics and sentiment: no default was chosen on them)")
    bt.add_argument("--targets", help="a subset of neuzip-k0,new-version,deeper,deeper-5,wider, joined by commas "
                                      "(default: all)")
    bt.add_argument("--no-inits", action="store_true", help="skip PiSSA against LoRA")
    bt.add_argument("--no-unfiltered", action="store_true", help="skip the transfer without the discriminator's "
                    "filter (a third of the time; --ablation measures the filter)")
    bt.add_argument("--no-filtered", action="store_true", help="skip the transfer with one student on the "
                    "discriminator's inputs only (the Trans-LoRA row measures them against the inputs as written)")
    bt.add_argument("--ablation", action="store_true", help="instead, the ablation: the transfer as issue 22 "
                    "measured it, then one choice changed at a time (serve/bench/translora_ablation.py)")
    bt.add_argument("--configs", help="with --ablation, a subset of its configurations by slug, joined by commas "
                    "(default: all), e.g. issue-36-defaults,issue-36-no-distillation")


def _add_engine(bench: argparse._SubParsersAction) -> None:
    en = add_command(bench, "engine", cmd_bench_engine, "the engine's decode step and end-to-end generation against "
                     "bare transformers and PEFT's mixed batch, with a GPU's memory floor")
    en.add_argument("--out", help="default: bench-results/engine-cpu.json or engine-gpu.json")
    en.add_argument("--work", default=".cache/bench-engine", help="models, adapters and stores it builds")
    en.add_argument("--device", default="cpu", help="cpu (the packaged SmolLM2) or cuda (config-built shapes)")
    en.add_argument("--large", action="store_true", help="on CUDA, the Llama-3-8B shape too")
    en.add_argument("--repeats", type=int, default=21, help="decode steps timed per figure (median)")
    en.add_argument("--context", type=int, help="tokens each row holds before the timed step (CPU 128, CUDA 512)")
    en.add_argument("--shapes", help="on CUDA, these shapes only (comma-separated)")
    en.add_argument("--no-end-to-end", action="store_true", help="decode steps only")
    en.add_argument("--no-steps", action="store_true", help="end to end only")
    en.add_argument("--rounds", type=int, help="end-to-end rounds, the systems taking turns (CPU 3, CUDA 1)")
    en.add_argument("--profile", action="store_true",
                    help="profile the adapters' and the four kinds' steps at the most rows (torch.profiler)")
    en.add_argument("--traffic", action="store_true", help="the real-traffic runs too: Poisson arrivals at three "
                    "rates, news-article prompts, every kind of row, beside the same requests in lockstep")
    en.add_argument("--traffic-requests", type=int, help="requests of each real-traffic run (CPU 32, CUDA 384)")
    en.add_argument("--traffic-rates", default="0.5,0.75,0.9", help="the Poisson runs' rates, fractions of lockstep's "
                    "requests/s (comma-separated; 'none': lockstep only)")
    en.add_argument("--kv-layouts", default="slots,paged", type=_layouts,
                    help="the KV layouts each traffic run is served in, at the same memory (comma-separated): one "
                    "block of max_model_len a row (slots), blocks of 16 with prefix caching (paged) or without "
                    "(paged-nocache), or paged under engine.batch_invariant (paged-invariant)")
    en.add_argument("--traffic-rounds", type=_positive, default=1, help="lockstep runs of each KV layout, the "
                    "layouts taking turns: the median's figures are reported, with every round's tokens/s")
    en.add_argument("--system-prompt-tokens", type=int, default=0, help="each model's requests behind a system "
                    "prompt of its own this long (drawn from the articles), their prompts cut to user turns of 32-128 "
                    "tokens")
    en.add_argument("--no-neuzip", action="store_true", help="on CUDA, no NeuZip row (its compression runs on the "
                    "host: minutes for Llama-3-8B's shape)")
    gc = add_command(bench, "gpu-check", cmd_bench_gpu_check, "the one check a lent GPU session runs, within 8 "
                     "minutes cold (kernels' and every kind's CUDA tests, paged decode against one block a row, the 1B "
                     "step, log probabilities); with no GPU, its CPU half (serve/bench/gpu_check.py)")
    gc.add_argument("--out", default="bench-results/gpu-check", help="the folder its gpu-check.json goes to")
    gc.add_argument("--work", default=".cache/gpu-check", help="models and stores it builds")
    gc.add_argument("--budget-s", type=float, default=420.0, help="seconds for every phase together")
    gc.add_argument("--download", metavar="DIR", help="only fetch the wheels the device's image lacks into DIR")
    lp = add_command(bench, "logprobs", cmd_bench_logprobs, "every kind's log probabilities through the engine against "
                     "transformers in fp32 with the variant's weights (vLLM's check_logprobs_close)")
    lp.add_argument("--out", help="default: bench-results/logprobs-cpu.json or logprobs-gpu.json")
    lp.add_argument("--work", default=".cache/bench-logprobs", help="the model, variants and store it builds")
    lp.add_argument("--device", default="cpu")
    lp.add_argument("--shape", default="smollm2-135m", help="the base's shape (serve/bench/engine_models.py SHAPES)")
    lp.add_argument("--rows", type=int, default=4, help="rows (prompts) of each kind")


def _add_neuzip(bench: argparse._SubParsersAction) -> None:
    bn = add_command(bench, "neuzip", cmd_bench_neuzip, "NeuZip bases against bf16 and int8 on SmolLM2 and MiniLM")
    bn.add_argument("--out", default="bench-results/neuzip.json")
    bn.add_argument("--work", help="where the bf16 and NeuZip copies of the models are kept "
                                   "(default: $MANYFOLD_HOME/bench-neuzip)")
    bn.add_argument("--steps-only", action="store_true",
                    help="only the engine's decode steps and prefill, bf16 against k7, split (a few minutes)")
    bg = add_command(bench, "neuzip-gpu", cmd_bench_neuzip_gpu, "NeuZip's Triton decoder and a NeuZip base's engine "
                     "forwards on a CUDA GPU, from a SmolLM2 stand-in built of real layers (--export them first)")
    bg.add_argument("--export", help="write the real layers, config and tokenizer the stand-in is built from "
                                     "to this folder, and stop (on a machine with the packaged model)")
    bg.add_argument("--src", default="neuzip-gpu-src", help="--export's folder")
    bg.add_argument("--work", default="neuzip-gpu-work", help="where the stand-in and its NeuZip copies are built")
    bg.add_argument("--out", default="bench-results/neuzip-gpu.json")
    bg.add_argument("--device", default="cuda")
    bg.add_argument("--layers", type=int, help="decoder layers of the stand-in (default: SmolLM2's 30)")
    bg.add_argument("--repeats", type=int, default=7)


def _add_soak(bench: argparse._SubParsersAction) -> None:
    so = add_command(bench, "soak", cmd_bench_soak, "a long mixed-kind run at a share of saturation with variants "
                     "added and removed over the admin API: errors, hung requests, latency, RSS over time")
    so.add_argument("--store", help="where the soak's small store is built once and reused "
                                    "(default: $MANYFOLD_HOME/soak-store)")
    so.add_argument("--out", default="bench-results/soak.json", help="the JSON; the PNG goes beside it")
    so.add_argument("--duration-s", type=float, default=600.0, help="seconds of open-loop arrivals")
    so.add_argument("--load", type=float, default=0.8, help="offered rate as a share of the saturation rate")
    so.add_argument("--churn-s", type=float, default=60.0, help="seconds between variant adds (and removes)")
    so.add_argument("--warmup-s", type=float, default=60.0, help="RSS is compared from the first sample past this")
    so.add_argument("--probe-s", type=float, default=30.0, help="seconds of the closed-loop saturation probe")
    so.add_argument("--probe-concurrency", type=int, default=16, help="requests in flight during the probe")
    so.add_argument("--timeout-s", type=float, default=120.0, help="a request unanswered this long counts as hung")


def add_bench_commands(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="action", required=True)
    b = add_command(bench, "fmdelta", cmd_bench_fmdelta,
                    "FM-Delta against lzma, zstd and XOR baselines on the demo fine-tunes")
    b.add_argument("--store", help="store with full variants (default: the demo store, built if missing)")
    b.add_argument("--out", default="bench-results/fmdelta.json")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--max-mb", type=float, default=200.0, help="skip fine-tunes larger than this")
    cs = add_command(bench, "coldstart", cmd_bench_coldstart,
                     "a variant's first and later requests against loading it in full")
    cs.add_argument("--store", help="store with full variants (default: the demo store, built if missing)")
    cs.add_argument("--out", default="bench-results/coldstart.json")
    cs.add_argument("--repeats", type=int, default=3)
    g = add_command(bench, "generation", cmd_bench_generation, "continuous batching against one request at a time")
    g.add_argument("--store", help="store with SmolLM2 and its variants (default: the demo store)")
    g.add_argument("--out", default="bench-results/generation.json")
    g.add_argument("--rate", type=float, default=4.0, help="offered requests per second")
    g.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per mode")
    g.add_argument("--max-tokens", type=int, default=24)
    st = add_command(bench, "structured", cmd_bench_structured, "structured outputs in the mixed step: 16 rows over "
                     "four kinds, half under a JSON schema, against all free; compile times; answers that validate")
    st.add_argument("--store", help="the demo store (default: built if missing)")
    st.add_argument("--out", default="bench-results/structured.json")
    st.add_argument("--max-tokens", type=int, default=96, help="of each answer")
    st.add_argument("--repeats", type=int, default=3, help="timed waves of each kind of step, in turn")
    mx = add_command(bench, "mixed", cmd_bench_mixed, "one forward for rows of many variants against the alternatives")
    mx.add_argument("--out", default="bench-results/mixed.json")
    mx.add_argument("--repeats", type=int, default=5)
    mx.add_argument("--rows", default="8,32", help="batch sizes, joined by commas")
    be = add_command(bench, "emr", cmd_bench_emr, "EMR-Merging against the individual fine-tunes, task arithmetic, "
                     "TIES and averaging; its bytes per task; a mixed forward's time")
    be.add_argument("--out", default="bench-results/emr.json")
    be.add_argument("--examples", type=int, default=500, help="held-out examples per task at most")
    be.add_argument("--rows", type=int, default=16, help="rows of the timed forward (a multiple of 4)")
    be.add_argument("--repeats", type=int, default=5)
    bf = add_command(bench, "forms", cmd_bench_forms, "the forms store add --kind auto weighs for the demo's and the "
                     "load test's fine-tunes: bytes, agreement, held-out quality, auto's choice, a mixed forward")
    bf.add_argument("--out", default="bench-results/forms.json")
    bf.add_argument("--examples", type=int, default=300, help="held-out examples (or LM texts) per fine-tune")
    bf.add_argument("--repeats", type=int, default=5)
    bf.add_argument("--only", help="only the fine-tunes whose name contains one of these (comma-separated)")
    bf.add_argument("--mergekit", help="a mergekit-extract-lora command (mergekit in a venv of its own) to compare "
                                       "against at the same ranks")
    ob = add_command(bench, "objects", cmd_bench_objects, "obstore against s3fs on an S3 server on loopback: large "
                     "and small puts and gets, put-if-absent")
    ob.add_argument("--out", default="bench-results/objects.json")
    ob.add_argument("--repeats", type=int, default=3)
    _add_engine(bench)
    _add_translora(bench)
    _add_neuzip(bench)
    _add_soak(bench)
