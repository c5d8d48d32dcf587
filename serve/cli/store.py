"""`manyfold store ...`: list, add, remove, verify and extract what a store holds, and move its adapters."""

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from serve.cli.adapters import add_sampling_arguments, add_student_arguments, transfer_options
from serve.cli.args import add_command, open_store
from serve.cli.codecs import LANE_HELP, neuzip_lane, neuzip_summary
from serve.cli.console import human_bytes, progress, table
from serve.errors import BatchIncomplete, ConfigError

if TYPE_CHECKING:
    from serve.store.store import Store

BULK_KINDS = ("lora", "pissa")
"""Kinds `store add --from-dir` registers in one batch (one manifest write for thousands of adapters)."""


def cmd_store_list(args: argparse.Namespace) -> None:
    rows = open_store(args).summary()
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    cells = []
    for r in rows:
        ratio = f"{r['stored_bytes'] / r['raw_bytes']:.1%}" if r["raw_bytes"] else "-"
        forms = "; ".join(sorted({f for f in r.get("forms", {}).values() if f != r["kind"]})) or "-"
        cells.append([r["name"], r["kind"], r["base"], r["architecture"], human_bytes(r["stored_bytes"]),
                      human_bytes(r["raw_bytes"]), ratio, forms])
    header = ["name", "kind", "base", "architecture", "stored", "raw", "ratio", "form"]
    print("\n".join(table(header, cells, right=frozenset({4, 5, 6}))))


def cmd_store_add(args: argparse.Namespace) -> None:
    _check_add_arguments(args)
    store = open_store(args, create=True)
    if args.from_dir:
        _add_from_dir(args, store)
        return
    if args.kind == "base" and args.neuzip_bits is not None:
        from serve.codecs.neuzip_file import add_base

        with progress("neuzip") as tick:
            entry, stats, cast = add_base(store, args.name, args.model, args.neuzip_bits, progress=tick,
                                          lane=args.neuzip_lane)
        print(f"added base '{entry.name}' ({entry.architecture}, {entry.params:,} params) in NeuZip form: "
              f"{neuzip_summary(stats, cast)}")
        return
    if args.kind == "base":
        entry = store.add_base(args.name, args.model)
        print(f"added base '{entry.name}' ({entry.architecture}, {entry.params:,} params)")
        return
    if args.kind == "auto":
        _add_auto(args, store)
        return
    from serve.config import SlotsConfig
    from serve.variants import variant_kind

    kind = variant_kind(args.kind)
    with progress(f"add {args.kind}") as tick:
        entry = kind.add(store, args.name, args.base, Path(args.model), progress=tick,
                         slots=SlotsConfig(max_rank=args.max_rank))
    stored = sum(f.bytes for f in entry.files)
    print(f"added {entry.kind} variant '{entry.name}' of '{entry.base}': {human_bytes(entry.raw_bytes)} stored as "
          f"{human_bytes(stored)} ({stored / max(entry.raw_bytes, 1):.1%})")


def _add_auto(args: argparse.Namespace, store: "Store") -> None:
    """A full fine-tune in the form `auto` chooses: every candidate it weighed, then the one it registered."""
    from serve.config import SlotsConfig
    from serve.forms.auto import add_auto, parse_tolerance

    tolerance = parse_tolerance(args.tolerance)
    calibration = Path(args.calibration) if args.calibration else None
    with progress("auto") as tick:
        entry, model = add_auto(store, args.name, args.base, Path(args.model), tolerance, calibration,
                                SlotsConfig(max_rank=args.max_rank), progress=tick)
    record = entry.form_records()[model]
    cells = [[c.form, human_bytes(c.resident_bytes), human_bytes(c.stored_bytes),
              "exact" if c.agreement is None and c.form == "fmdelta" else (
                  "-" if c.agreement is None else f"{c.agreement:.2%}")] for c in record.candidates]
    print("\n".join(table(["form", "resident", "stored", "agreement"], cells, right=frozenset({1, 2, 3}))))
    why = "exact forms only at tolerance 0" if record.tolerance == 0 else f"tolerance {record.tolerance:.1%}"
    note = "; the group was re-merged, which changes what it serves for its other tasks" if entry.kind == "emr" else ""
    print(f"added '{model}' of '{args.base}' as {record.chosen} ({why}; calibration: "
          f"{record.calibration or 'none needed'}){note}")


def _check_add_arguments(args: argparse.Namespace) -> None:
    """Which arguments go together, checked before the store is opened (or created)."""
    if args.from_dir:
        if args.kind not in BULK_KINDS:
            raise ConfigError(f"--from-dir is for --kind {' or '.join(BULK_KINDS)}, not {args.kind}")
        if args.name or args.model:
            raise ConfigError("--from-dir names each adapter by its directory (or --names); drop --name and --model")
    else:
        if args.names:
            raise ConfigError("--names goes with --from-dir DIR")
        if not args.name or not args.model:
            raise ConfigError("store add needs --name and --model (or, for adapters, --from-dir DIR)")
    if args.kind != "base" and args.neuzip_bits is not None:
        raise ConfigError("--neuzip-bits is for --kind base")
    if args.neuzip_lane is not None and args.neuzip_bits is None:
        raise ConfigError("--neuzip-lane goes with --neuzip-bits")
    args.neuzip_lane = neuzip_lane(args.neuzip_lane or "cpu")
    if args.kind != "auto" and (args.tolerance is not None or args.calibration):
        raise ConfigError("--tolerance and --calibration go with --kind auto")
    if args.kind == "auto" and args.tolerance is None:
        args.tolerance = "0"
    if args.kind != "base" and not args.base:
        raise ConfigError(f"store add --kind {args.kind} needs --base NAME (a base in the store)")


def _add_from_dir(args: argparse.Namespace, store: "Store") -> None:
    """Every adapter under --from-dir in one batch: failures one line each on stderr, then the count."""
    from serve.config import SlotsConfig
    from serve.variants import variant_kind

    items = adapter_items(Path(args.from_dir), Path(args.names) if args.names else None)
    started = time.perf_counter()
    with progress(f"add {args.kind}", total=len(items), unit="adapter") as tick:
        added, failed = variant_kind(args.kind).add_many(store, args.base, items, progress=tick,
                                                         slots=SlotsConfig(max_rank=args.max_rank))
    for name, e in failed:
        print(f"{name}: {str(e).replace(chr(10), ' ')}", file=sys.stderr)
    stored = sum(f.bytes for e in added for f in e.files)
    summary = (f"added {len(added)} of {len(items)} adapters to base '{args.base}' ({human_bytes(stored)} stored) "
               f"in {time.perf_counter() - started:.1f} s")
    if failed:
        raise BatchIncomplete(f"{summary}; {len(failed)} not added (each named above)")
    print(summary)


def adapter_items(from_dir: Path, names: Path | None = None) -> list[tuple[str, Path]]:
    """(model name, adapter directory) for every directory directly under from_dir but hidden ones, named as the
    directory; with a names file, exactly the directories it lists, under the names it gives them."""
    if not from_dir.is_dir():
        raise ConfigError(f"--from-dir {from_dir}: not a directory")
    if names is not None:
        items = [(name, from_dir / d) for d, name in read_names(names)]
    else:
        items = [(p.name, p) for p in sorted(from_dir.iterdir()) if p.is_dir() and not p.name.startswith(".")]
    if not items:
        raise ConfigError(f"--from-dir {from_dir}: no adapter directories{' listed in ' + str(names) if names else ''}")
    return items


def read_names(path: Path) -> list[tuple[str, str]]:
    """A --names file: one `DIRECTORY NAME` per line (whitespace between; blank lines and # comments skipped)."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--names {path}: cannot be read ({e})") from None
    out: dict[str, str] = {}
    for n, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) != 2 or "/" in fields[0] or fields[0] in (".", ".."):
            raise ConfigError(f"{path}:{n}: expected 'DIRECTORY NAME' (a directory directly under --from-dir), "
                              f"got {line.strip()!r}")
        if fields[0] in out:
            raise ConfigError(f"{path}:{n}: directory '{fields[0]}' is listed twice")
        out[fields[0]] = fields[1]
    return list(out.items())


def cmd_store_remove(args: argparse.Namespace) -> None:
    open_store(args).remove(args.name)
    print(f"removed '{args.name}'")


def cmd_store_gc(args: argparse.Namespace) -> None:
    from serve.store.object_store import ObjectStore, collect

    store = open_store(args)
    if not isinstance(store, ObjectStore):
        raise ConfigError(f"store {store.root}: a local store deletes an entry's files when it is removed; gc is "
                          f"for stores on object storage")
    freed = collect(store, args.grace_s)
    print(f"deleted {freed['objects']} objects ({freed['bytes'] / (1 << 20):.1f} MiB) and {freed['generations']} "
          f"manifest generations older than {args.grace_s:g} s")


def cmd_store_verify(args: argparse.Namespace) -> None:
    from serve.variants import variant_kind

    store = open_store(args)
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

    store = open_store(args)
    entry = store.variant(args.name.split(MEMBER_SEP, 1)[0])  # an EMR task's model id names its group first
    print(variant_kind(entry.kind).extract(store, args.name, Path(args.out)))


def cmd_store_translora(args: argparse.Namespace) -> None:
    from serve.adapters.generation_schedule import AttemptPlan
    from serve.adapters.transfer_guard import TransferFailed
    from serve.adapters.translora_store import transfer_store

    AttemptPlan.build(args.samples, args.max_attempts, args.min_accepted)  # a bad flag: one line, not one per adapter
    failed = 0
    for outcome, line in transfer_store(open_store(args), args.from_base, args.to_base, **transfer_options(args)):
        print(line, flush=True)
        failed += outcome == "failed"
    if failed:
        raise TransferFailed(f"{failed} adapter{'s' if failed > 1 else ''} could not move (above, each by name; "
                             f"nothing was registered for them); the others did, and a second run retries only what "
                             f"is not done")


def cmd_store_upgrade(args: argparse.Namespace) -> None:
    from serve.adapters import upgrade
    from serve.adapters.generation_schedule import AttemptPlan

    store = open_store(args)
    if args.dry_run:
        print("\n".join(upgrade.dry_run(store, args.from_base, args.to_base, args.samples, args.budget_min,
                                          not args.filtered_only)))
        return
    if args.rollback:
        names = upgrade.rollback(store, args.from_base, args.to_base)
        print(f"{len(names)} name{'s' * (len(names) != 1)} answered by '{args.from_base}' again"
              f"{': ' + ', '.join(names) if names else ''}")
        return
    AttemptPlan.build(args.samples, args.max_attempts, args.min_accepted)  # a bad flag: one line, not one per tenant
    report_path = Path(args.report or f"upgrade-{args.from_base}-{args.to_base}.json")
    report = upgrade.upgrade(store, args.from_base, args.to_base, report_path,
                             say=lambda line: print(line, flush=True), **transfer_options(args))
    tenants = report["tenants"]
    print(f"{sum(t['switched'] for t in tenants)} of {len(tenants)} names answered by '{args.to_base}'; "
          f"{report.get('minutes', 0):.1f} minutes of transfers; report: {report_path}")


COMMANDS = [("list", cmd_store_list, "list bases and variants with their sizes"),
            ("add", cmd_store_add, "add a base model or a variant of any kind"),
            ("remove", cmd_store_remove, "remove a variant (or a base without variants)"),
            ("gc", cmd_store_gc, "on object storage: delete objects and manifest generations no reader needs"),
            ("verify", cmd_store_verify, "check every file's checksum and decode full variants"),
            ("extract", cmd_store_extract, "write a variant back out as a HF model directory"),
            ("translora", cmd_store_translora, "move every adapter of one base to another (Trans-LoRA; resumable)"),
            ("upgrade", cmd_store_upgrade, ("move every tenant's adapter to a new base and switch the names the "
                                            "guard kept (resumable; --dry-run, --rollback)"))]
"""Every `store` subcommand, in the order `manyfold store --help` lists them; each takes --store."""


def add_store_commands(sub: argparse._SubParsersAction, default_store: str | None) -> None:
    st = sub.add_parser("store", help="the variant store").add_subparsers(dest="action", required=True)
    for name, fn, help in COMMANDS:
        sp = add_command(st, name, fn, help)
        sp.add_argument("--store", default=default_store, required=default_store is None)
    st.choices["list"].add_argument("--json", action="store_true")
    _add_add_arguments(st.choices["add"])
    st.choices["remove"].add_argument("name")
    st.choices["gc"].add_argument("--grace-s", type=float, default=3600.0,
                                  help="keep what a generation newer than this names, and anything this young")
    st.choices["verify"].add_argument("name", nargs="?")
    st.choices["extract"].add_argument("--name", required=True, help="a variant, or an EMR task: GROUP/TASK")
    st.choices["extract"].add_argument("--out", required=True)
    tr = st.choices["translora"]
    tr.add_argument("--from", dest="from_base", required=True, help="the base whose adapters move")
    tr.add_argument("--to", dest="to_base", required=True, help="the base they move to")
    add_sampling_arguments(tr)
    add_student_arguments(tr)
    up = st.choices["upgrade"]
    up.add_argument("--from", dest="from_base", required=True, help="the base the tenants' adapters are on")
    up.add_argument("--to", dest="to_base", required=True, help="the new base")
    what = up.add_mutually_exclusive_group()
    what.add_argument("--dry-run", action="store_true", help="say what would move and about how long it takes here")
    what.add_argument("--rollback", action="store_true", help="point every name the upgrade switched back")
    up.add_argument("--report", help="the upgrade's JSON report (default: upgrade-FROM-TO.json here)")
    add_sampling_arguments(up)
    add_student_arguments(up)


def _add_add_arguments(add: argparse.ArgumentParser) -> None:
    add.add_argument("--kind", required=True,
                     help="base, or a variant kind: full, lora, pissa, emr (see serve/variants/); auto: a full "
                          "fine-tune in the form with the least resident bytes within --tolerance (serve/forms/)")
    add.add_argument("--name", help="the name it is served under (not with --from-dir)")
    add.add_argument("--model",
                     help="a HF model directory (base, full), a PEFT adapter directory (lora, pissa) "
                          "or an EMR bundle (emr: adding a group again replaces it whole)")
    add.add_argument("--from-dir", help="lora, pissa: add every adapter directory directly under this one, each "
                                        "named as its directory, in one batch; one that fails is named and the "
                                        "rest are added")
    add.add_argument("--names", help="with --from-dir: a file of 'DIRECTORY NAME' lines; only the directories it "
                                     "lists are added, under those names")
    add.add_argument("--base", help="for a variant: the store base it was fine-tuned from")
    add.add_argument("--neuzip-bits", type=int, choices=[0, 1, 3, 7], default=None,
                     help="for a base: serve it in NeuZip form keeping this many mantissa bits (7: lossless)")
    add.add_argument("--neuzip-lane", default=None, help="with --neuzip-bits: " + LANE_HELP)
    add.add_argument("--tolerance", default=None,
                     help="auto: the share of labels (or greedy tokens) of the calibration set a form may answer "
                          "differently from the fine-tune, as 0.02 or 2%% (default 0: exact forms only)")
    add.add_argument("--calibration", help="auto: task data the fine-tune did not train on (its validation set), "
                                           "as JSONL ({\"text\": ...} or {\"prompt\": ..., \"completion\": ...}); "
                                           "a language model without one is measured on text its base generates")
    add.add_argument("--max-rank", type=int, default=64,
                     help="adapters: the largest rank the server's slots take (slots.max_rank)")
