"""`manyfold adapter train | convert` and `manyfold translora`: LoRA and PiSSA adapters, and moving one to
another base."""

import argparse
from pathlib import Path

from serve.adapters.budget import MINUTES
from serve.cli.args import add_command, base_dir
from serve.cli.console import progress


def cmd_adapter_train(args: argparse.Namespace) -> None:
    from serve.adapters.data import read_jsonl
    from serve.adapters.train import train_adapter
    from serve.adapters.validation import trained_on

    targets = args.target_modules if args.target_modules == "all-linear" else args.target_modules.split(",")
    examples = read_jsonl(args.data)
    if args.discriminator:  # the validation set is held out from the adapter too: nobody trains on it
        examples = trained_on(examples, args.seeds, args.validation)
    result = train_adapter(base_dir(args), examples, Path(args.out), init=args.init, rank=args.rank,
                           alpha=args.alpha, steps=args.steps, lr=args.lr, batch_size=args.batch_size,
                           max_length=args.max_length, target_modules=targets, seed=args.seed)
    print(f"{result.out_dir}: {args.init} adapter, rank {args.rank}, {args.steps} steps on {len(examples)} "
          f"examples, loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f} ({result.train_seconds:.0f} s); "
          f"train_log.json beside it")
    if args.discriminator:
        from serve.adapters.translora import train_discriminator

        name = args.task_name or Path(args.data).stem
        d = train_discriminator(base_dir(args), result.out_dir, read_jsonl(args.data), name, seeds=args.seeds,
                                seed=args.seed, validation=args.validation)
        print(f"{result.out_dir}/translora: a discriminator for '{name}' ({d['real']} real inputs against "
              f"{d['generated']} generated, loss {d['losses'][0]:.3f} -> {d['losses'][-1]:.3f}); kept beside it: "
              f"{d['seeds']} seed examples and {d['validation']} validation examples")


def cmd_adapter_convert(args: argparse.Namespace) -> None:
    from serve.adapters.convert import convert_pissa

    print(f"{convert_pissa(Path(args.adapter), Path(args.initial), Path(args.out))}: a rank-2r LoRA on the "
          f"original base")


def _print_transfer(report, out: Path) -> None:
    from serve.adapters.transfer_guard import summary

    kept = ("the source adapter unchanged (not transferred: the student did not beat it on validation)"
            if report.outcome == "unchanged" else f"a student, best at step {report.validation['best_step']}")
    filtered = f" ({report.generation['acceptance_rate']:.1%} passed the filter)" if report.filtered else " (no filter)"
    learnt = f" (taught on the inputs {report.inputs['chosen']})" if len(report.inputs.get("sets", {})) > 1 else ""
    print(f"{out}: {kept}{learnt}; {report.accepted} of {report.attempts} generated inputs accepted{filtered}; "
          f"loss {report.losses[0]:.3f} -> {report.losses[-1]:.3f}; {summary(report.compared)}; "
          f"{out / 'translora_report.json'}" + (f"; {report.note}" if report.note else ""))


def cmd_translora(args: argparse.Namespace) -> None:
    from serve.adapters.transfer_guard import TransferFailed
    from serve.adapters.translora import transfer

    try:
        with progress("translora") as tick:
            report = transfer(args.source_base, args.adapter, args.target_base, Path(args.out),
                              use_filter=not args.no_filter, init=args.init, progress=lambda *a: tick(a),
                              **transfer_options(args))
    except TransferFailed as e:
        raise TransferFailed(f"{args.adapter}: failed: {e}; nothing written to {args.out}") from e
    _print_transfer(report, Path(args.out))


def add_adapter_commands(sub: argparse._SubParsersAction, default_store: str | None) -> None:
    ad = sub.add_parser("adapter", help="LoRA / PiSSA adapters with PEFT").add_subparsers(dest="action",
                                                                                          required=True)
    t = add_command(ad, "train", cmd_adapter_train, "train an adapter (PiSSA by default) and write its servable form")
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
                   help="for Trans-LoRA: the data's owner consents to Manyfold keeping some of these examples beside "
                        "the adapter (--seeds for the generator, --validation to check every transfer on, held out "
                        "from training), and a discriminator is trained beside it")
    t.add_argument("--task-name", help="the task's name in the discriminator's prompt (default: the data file's)")
    t.add_argument("--seeds", type=int, default=5, help="seed examples kept for a later transfer")
    t.add_argument("--validation", type=int, default=32,
                   help="validation examples kept, at most (and at most half of those past the seeds)")
    cv = add_command(ad, "convert", cmd_adapter_convert,
                     "a trained PiSSA adapter -> a rank-2r LoRA on the original base")
    cv.add_argument("--adapter", required=True, help="the trained (raw) PiSSA adapter directory")
    cv.add_argument("--initial", required=True, help="the untrained PiSSA adapter saved before training")
    cv.add_argument("--out", required=True, help="a new directory")


def add_translora_command(sub: argparse._SubParsersAction) -> None:
    tl = add_command(sub, "translora", cmd_translora,
                     "move an adapter to another base with synthetic data (Trans-LoRA)")
    tl.add_argument("--source-base", required=True, help="the HF model directory the adapter was trained on")
    tl.add_argument("--adapter", required=True, help="an adapter trained with --discriminator")
    tl.add_argument("--target-base", required=True, help="the HF model directory to move it to")
    tl.add_argument("--out", required=True, help="a new directory")
    add_sampling_arguments(tl)
    tl.add_argument("--no-filter", action="store_true", help="keep every generated input (the ablation)")
    tl.add_argument("--init", default="pissa", help="the new adapter's init: pissa, pissa_niter_K or lora")
    add_student_arguments(tl)


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """How many synthetic inputs a transfer wants, writes and needs; shared by `translora` and `store translora`."""
    p.add_argument("--samples", type=int, default=256,
                   help="synthetic inputs to keep at most: a transfer wants as many as the adapter's real training "
                        "examples (its train_log.json), up to this")
    p.add_argument("--max-attempts", type=int, default=None,
                   help="inputs generated at most (default: 16x --samples); fewer are written when the acceptance "
                        "rate measured on the first batches fills --samples sooner")
    p.add_argument("--min-accepted", type=int, default=None,
                   help="the fewest accepted inputs a student is trained on (default: a quarter of --samples); a "
                        "transfer that cannot reach it fails with one line and writes nothing")


def transfer_options(args: argparse.Namespace) -> dict:
    """translora.transfer's options from add_sampling_arguments' and add_student_arguments' flags."""
    from serve.adapters.distill import Distillation

    return {"samples": args.samples, "max_attempts": args.max_attempts, "min_accepted": args.min_accepted,
            "steps": args.steps, "lr": args.lr, "seed": args.seed,
            "keep_unchanged": not args.always_student, "start_from_source": not args.from_init,
            "budget_min": args.budget_min, "measure_inputs": not args.filtered_only,
            "distillation": None if args.no_distill else
            Distillation() if args.kd_temperature is None else Distillation(temperature=args.kd_temperature)}


def add_student_arguments(p: argparse.ArgumentParser) -> None:
    """The student's options, shared by `translora` and `store translora`."""
    p.add_argument("--steps", type=int, default=None,
                   help="the student's steps at most (default: 10 epochs of the accepted inputs, 20 to 200); it "
                        "stops early on its validation score (accuracy first where the completions are labels) "
                        "and keeps its best point")
    p.add_argument("--lr", type=float, default=None,
                   help="the student's lr (default: 1e-4 for a student that starts from the source adapter or its "
                        "projection, 5e-4 for a fresh one; either x accepted / 64 where fewer than 64 are accepted)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-min", type=float, default=MINUTES,
                   help="minutes a transfer may take: inputs are written for half of it at most and the student "
                        "stops at 85%% of it (keeping its best validated point); the report says what it cut")
    p.add_argument("--filtered-only", action="store_true",
                   help="train one student, on the inputs the discriminator kept (by default, where it refused a "
                        "quarter or more of those written, a second learns from them as written and the better on "
                        "validation is kept)")
    p.add_argument("--no-distill", action="store_true",
                   help="the student learns the teacher's sampled completions alone (by default, where the two "
                        "bases number tokens alike, also its next-token distributions)")
    p.add_argument("--kd-temperature", type=float, default=None,
                   help="the temperature both distributions are softened by in the distillation's KL term "
                        "(default: distill.KD_TEMPERATURE, 2)")
    p.add_argument("--from-init", action="store_true",
                   help="the student starts from its init even where the source adapter fits the target (by "
                        "default it starts from the source adapter there)")
    p.add_argument("--always-student", action="store_true",
                   help="keep the student wherever it beats the target alone (by default, where the source adapter "
                        "applied unchanged fits the target and beats the target alone, it is kept, marked as not "
                        "transferred, unless the student beats it on validation)")
