"""Every `manyfold ...` command the docs show that can run here runs as written, through the CLI's own entry point
(`serve.cli.main`), on tiny models: each form of it (tests/doc_commands.py: every `a|b` alternative, with its
optional parts and without them) with each placeholder bound to a real artefact (PLACEHOLDERS), each `store`
command against a store in a local directory, one at a `file://` URL and one at an `s3://` URL (moto on loopback),
its exit status 0 and its effect checked (CHECKS). A command that cannot run here is in NOT_HERE with the reason and
where it is tested; one that the docs name in a sentence is in PROSE with the documented line it names, which runs.
"""

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from serve.cli import main
from tests.doc_commands import PLACEHOLDER, command_of, documented, forms, parts, slots
from tests.doc_world import BASE, DOOMED, FULL, STORE_KINDS, World, build_world

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")  # peft -> transformers

NOT_HERE = {
    "manyfold serve": "runs a server until stopped: tests/test_demo_serve.py (--store, and its drain on Ctrl-C) "
                      "and tests/test_fleet.py (--ray-address, an s3:// --store, --config) start it through the CLI",
    "manyfold demo": "fine-tunes the real packaged models on real data (minutes; tests/test_demo.py, slow), then "
                     "serves until stopped (tests/test_demo_serve.py, on a small demo store)",
    "manyfold bench": "minutes to hours on real models, for bench-results/; the parts with a small form are tested "
                      "in tests/bench/ (engine traffic, logprobs, neuzip-gpu, translora; gpu-check's CPU half)",
    "manyfold translora": "a transfer the guard lets through needs an adapter that learned a task its target has "
                          "not (minutes of training); on tiny random models the CLI runs it in a second to the "
                          "guard's one-line refusal, exit 1 by design: tests/adapters/test_translora.py",
    "manyfold store translora": "as `manyfold translora`, for every adapter of a store base: "
                                "tests/adapters/test_translora.py (resuming, skipping, one failure among others)",
    "manyfold store upgrade": "a transfer per tenant (minutes of training on real adapters): "
                              "tests/adapters/test_upgrade.py runs an upgrade, its --dry-run and --rollback through "
                              "the CLI on tiny models (interrupted, resumed, the names the guard kept switched)",
}
"""Command prefix -> why it does not run here, and where it is tested."""

PROSE = {
    "manyfold ...": "manyfold store list --store DIR|URL [--json]",  # "...": any command; this one, say
    "manyfold --debug ...": "manyfold store list --store DIR|URL [--json]",
    "manyfold store add": "manyfold store add --store DIR --kind base --name N --model DIR "
                          "[--neuzip-bits 0|1|3|7 [--neuzip-lane cpu|gpu|N]]",
    "manyfold store add --kind": "manyfold store add --store DIR --kind full --name N --base BASE --model DIR",
    "manyfold store add --kind auto": "manyfold store add --store DIR --kind auto --name N --base BASE --model DIR "
                                      "[--tolerance T] [--calibration FILE]",
    "manyfold store add --store s3://...": "manyfold store add --store s3://BUCKET/store --kind base --name smollm2 "
                                           "--model ./SmolLM2-135M-Instruct",
    "manyfold store gc": "manyfold store gc --store URL [--grace-s 3600]",
    "manyfold emr merge": "manyfold emr merge --base B --task NAME=DIR [--task ...] [--rescaler mean|global] "
                          "--out BUNDLE",
    "manyfold adapter convert": "manyfold adapter convert --adapter TRAINED --initial INIT --out DIR",
    "manyfold adapter train": "manyfold adapter train --base B --data train.jsonl --init pissa|pissa_niter_K|lora "
                              "--rank R --steps N --lr LR --out DIR",
}
"""A command named in a sentence, not a line to run (exactly as the docs show it) -> the documented line it names,
which runs here."""


@dataclass
class Run:
    """One form of a documented command, bound: its argv and what each placeholder stood for."""

    world: World
    form: str
    store: str | None
    command: str = ""
    kind: str | None = None
    argv: list[str] = field(default_factory=list)
    bound: dict[str, str | list[str]] = field(default_factory=dict)

    def value(self, flag: str) -> str:
        """What the argv gives the flag (also where a "..." stood for it)."""
        return self.argv[self.argv.index(flag) + 1]

    def new_name(self, what: str = "n") -> str:
        return f"{what}{self.world.count()}"

    def names_file(self) -> str:
        """A --names file naming each directory under --from-dir anew."""
        from_dir = Path(self.bound["--from-dir"])
        path = self.world.fresh("names", ".txt")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"{d.name} {self.new_name(d.name + '-')}\n" for d in sorted(from_dir.iterdir())))
        return str(path)


def _model(r: Run) -> str:
    w = r.world
    return str({"base": w.base, "full": w.finetune, "auto": w.finetune2}[r.kind])


PLACEHOLDERS: dict[tuple[str, str, str], Callable[[Run], str | list[str]]] = {
    ("*", "--store", "DIR"): lambda r: r.store,
    ("*", "--store", "URL"): lambda r: r.store,
    ("*", "--store", "s3://BUCKET/store"): lambda r: r.store,
    ("store add", "--name", "N"): lambda r: r.new_name(),
    ("store add", "--name", "GROUP"): lambda r: r.new_name("group"),
    ("store add", "--base", "BASE"): lambda r: BASE,
    ("store add", "--model", "DIR"): _model,
    ("store add", "--model", "./SmolLM2-135M-Instruct"): lambda r: str(r.world.base),
    ("store add", "--model", "ADAPTER_DIR"): lambda r: str({"lora": r.world.lora, "pissa": r.world.pissa}[r.kind]),
    ("store add", "--model", "BUNDLE"): lambda r: str(r.world.bundle),
    ("store add", "--from-dir", "DIR"): lambda r: str({"lora": r.world.loras, "pissa": r.world.pissas}[r.kind]),
    ("store add", "--names", "FILE"): Run.names_file,
    ("store add", "--neuzip-lane", "N"): lambda r: "64",
    ("store add", "--tolerance", "T"): lambda r: "2%",
    ("store add", "--calibration", "FILE"): lambda r: str(r.world.calibration),
    ("store extract", "--name", "N"): lambda r: FULL,
    ("store extract", "--out", "DIR"): lambda r: str(r.world.fresh("extracted")),
    ("store remove", "", "NAME"): lambda r: DOOMED,
    ("store verify", "", "NAME"): lambda r: FULL,
    ("fmdelta compress", "--base", "B"): lambda r: str(r.world.base),
    ("fmdelta compress", "--finetuned", "F"): lambda r: str(r.world.finetune),
    ("fmdelta compress", "--out", "X.fmd"): lambda r: str(r.world.fresh("delta", ".fmd")),
    ("fmdelta compress", "--workers", "N"): lambda r: "2",
    ("fmdelta decompress", "--base", "B"): lambda r: str(r.world.base),
    ("fmdelta decompress", "--delta", "X.fmd"): lambda r: str(r.world.fmd),
    ("fmdelta decompress", "--out", "F2.safetensors"): lambda r: str(r.world.fresh("decoded", ".safetensors")),
    ("neuzip compress", "--model", "DIR"): lambda r: str(r.world.base),
    ("neuzip compress", "--out", "OUT"): lambda r: str(r.world.fresh("neuzip")),
    ("neuzip compress", "--lane", "N"): lambda r: "64",
    ("neuzip decompress", "--in", "OUT"): lambda r: str(r.world.neuzip),
    ("neuzip decompress", "--out", "DIR"): lambda r: str(r.world.fresh("bf16")),
    ("emr merge", "--base", "B"): lambda r: str(r.world.base),
    ("emr merge", "--task", "NAME=DIR"): lambda r: f"a={r.world.finetune}",
    ("emr merge", "--task", "..."): lambda r: f"b={r.world.finetune2}",
    ("emr merge", "--out", "BUNDLE"): lambda r: str(r.world.fresh("bundle")),
    ("emr extract", "--bundle", "BUNDLE"): lambda r: str(r.world.bundle),
    ("emr extract", "--task", "NAME"): lambda r: "a",
    ("emr extract", "--out", "DIR"): lambda r: str(r.world.fresh("task")),
    ("emr extract", "--base", "B"): lambda r: str(r.world.base),
    ("adapter convert", "--adapter", "TRAINED"): lambda r: str(r.world.pissa_trained),
    ("adapter convert", "--initial", "INIT"): lambda r: str(r.world.pissa_initial),
    ("adapter convert", "--out", "DIR"): lambda r: str(r.world.fresh("converted")),
    ("adapter train", "--base", "B"): lambda r: str(r.world.base),
    ("adapter train", "--data", "train.jsonl"): lambda r: str(r.world.data),
    ("adapter train", "--init", "pissa_niter_K"): lambda r: "pissa_niter_2",
    ("adapter train", "--rank", "R"): lambda r: "4",
    ("adapter train", "--steps", "N"): lambda r: "2",
    ("adapter train", "--lr", "LR"): lambda r: "1e-3",
    ("adapter train", "--out", "DIR"): lambda r: str(r.world.fresh("adapter")),
    ("adapter train", "--task-name", "NAME"): lambda r: "toy",
    ("adapter train", "", "..."): lambda r: ["--base", str(r.world.base), "--data", str(r.world.data), "--steps", "2",
                                             "--out", str(r.world.fresh("adapter"))],
}
"""(command, flag or "" for a positional, the value as the docs show it) -> its value here; "*": any command.
A value the docs show that is no placeholder (3600, mean, smollm2) is passed as shown."""


def binding(slot: tuple[str, str, str]) -> Callable[[Run], str | list[str]] | None:
    """What a value the docs show is bound to here; None: passed as shown (a placeholder never is)."""
    _, flag, shown = slot
    return PLACEHOLDERS.get(slot) or PLACEHOLDERS.get(("*", flag, shown))


def bind(run: Run) -> list[str]:
    """The form as argv, each placeholder bound in the order shown (--from-dir before the --names file that lists
    it); run.bound keeps what each flag stood for."""
    words = shlex.split(run.form)[1:]
    run.command = command_of(run.form)
    run.kind = words[words.index("--kind") + 1] if "--kind" in words else None
    argv = run.command.split()
    for flag, slot in parts(run.form):
        argv += [flag] if flag else []
        if slot is None:
            continue
        fn = binding(slot)
        assert fn is not None or not PLACEHOLDER.match(slot[2]), f"`{run.form}`: nothing bound to {slot}"
        value = fn(run) if fn else slot[2]
        run.bound[slot[1] or slot[2]] = value
        argv += value if isinstance(value, list) else [value]
    run.argv = argv
    return argv


def placement(command: str) -> str:
    """"prose" (PROSE), "not here" (a NOT_HERE prefix) or "run"."""
    if command in PROSE:
        return "prose"
    return "not here" if reason(command) else "run"


def reason(command: str) -> str | None:
    return next((why for prefix, why in NOT_HERE.items()
                 if command == prefix or command.startswith(prefix + " ")), None)


def store_kinds(form: str) -> tuple[str | None, ...]:
    """The stores a form runs against: a DIR any of them (the CLI takes a URL wherever it takes a directory), a URL
    the two on object storage, an s3:// URL the one on S3; None: the form names no store."""
    shown = next((s[2] for s in slots(form) if s[1] == "--store"), None)
    if shown is None:
        return (None,)
    return {"DIR": STORE_KINDS, "URL": ("file", "s3")}.get(shown, ("s3",) if shown.startswith("s3://") else ())


def run_cases() -> list:
    commands = sorted({c for _, c in documented() if placement(c) == "run"})
    cases = dict.fromkeys((c, f, k) for c in commands for f in forms(c) for k in store_kinds(f))
    return [pytest.param(c, f, k, id=f.removeprefix("manyfold ") + (f" @{k}" if k else "")) for c, f, k in cases]


@pytest.fixture(scope="module")
def world(tmp_path_factory, s3_server):
    """Built once: the tiny artefacts every placeholder stands for, and the three stores. One torch thread (tiny
    models gain nothing from more on a shared machine) and this module's own node cache for the URL stores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("docs-run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MANYFOLD_CACHE_DIR", str(root / "node-cache"))
        yield build_world(root, s3_server)
    torch.set_num_threads(threads)


def _listing(store: str, capsys) -> dict[str, dict]:
    """`store list --json`, by name."""
    assert main(["store", "list", "--store", store, "--json"]) == 0
    return {row["name"]: row for row in json.loads(capsys.readouterr().out)}


def _entries(store: str) -> list[str]:
    from serve.store.store import open_store

    manifest = open_store(store).manifest
    return [*manifest.bases, *manifest.variants]


def check_store_add(r: Run, out: str, capsys) -> None:
    """`store list` shows each name added, as the kind added (auto: in the form it chose, recorded)."""
    if "--from-dir" not in r.bound:
        added = [r.value("--name")]
    elif "--names" in r.bound:
        added = [line.split()[1] for line in Path(r.value("--names")).read_text().splitlines()]
    else:
        added = [d.name for d in Path(r.value("--from-dir")).iterdir()]
    rows = _listing(r.store, capsys)
    for name in added:
        assert name in rows, f"`store list` after `{shlex.join(r.argv)}` has no '{name}': {sorted(rows)}"
        if r.kind == "auto":
            assert rows[name]["form_records"], rows[name]
        else:
            assert rows[name]["kind"] == r.kind
    if "--neuzip-bits" in r.argv:
        bits = r.value("--neuzip-bits")
        assert "in NeuZip form" in out and ("lossless" if bits == "7" else f"{bits} mantissa bits kept") in out


def check_store_list(r: Run, out: str, capsys) -> None:
    names = _entries(r.store)
    if "--json" in r.argv:
        assert sorted(row["name"] for row in json.loads(out)) == sorted(names)
    else:
        assert all(any(line.startswith(f"{name} ") for line in out.splitlines()) for name in names), out


def check_store_verify(r: Run, out: str, capsys) -> None:
    names = [r.bound["NAME"]] if "NAME" in r.bound else _entries(r.store)
    assert out.splitlines() == [f"{name}: ok" for name in names]


def check_store_extract(r: Run, out: str, capsys) -> None:
    from serve.store.tensors import SafetensorsSource

    extracted = Path(r.value("--out"))
    assert out.strip() == str(extracted) and (extracted / "config.json").is_file()
    assert set(SafetensorsSource(extracted)) == set(SafetensorsSource(r.world.finetune))


def check_store_remove(r: Run, out: str, capsys) -> None:
    assert out.strip() == f"removed '{DOOMED}'" and DOOMED not in _listing(r.store, capsys)


def check_store_gc(r: Run, out: str, capsys) -> None:
    """Nothing a manifest names is collected: the store still verifies."""
    assert out.startswith("deleted ")
    assert main(["store", "verify", "--store", r.store]) == 0, capsys.readouterr().err


def check_fmdelta_compress(r: Run, out: str, capsys) -> None:
    assert Path(r.value("--out")).is_file() and "tensors by codec" in out


def check_fmdelta_decompress(r: Run, out: str, capsys) -> None:
    from serve.store.tensors import SafetensorsSource
    from tests.conftest import same_bits

    decoded, fine = SafetensorsSource(r.value("--out")), SafetensorsSource(r.world.finetune)
    assert set(decoded) == set(fine) and all(same_bits(decoded[k], fine[k]) for k in fine)


def check_neuzip_compress(r: Run, out: str, capsys) -> None:
    bits = r.value("--bits") if "--bits" in r.argv else "7"
    assert (Path(r.value("--out")) / "neuzip.nzp").is_file()
    assert ("lossless" if bits == "7" else f"{bits} mantissa bits kept") in out


def check_neuzip_decompress(r: Run, out: str, capsys) -> None:
    from serve.store.tensors import SafetensorsSource

    assert set(SafetensorsSource(r.value("--out"))) == set(SafetensorsSource(r.world.base))


def check_emr_merge(r: Run, out: str, capsys) -> None:
    from serve.codecs.emr import read_bundle

    tasks = [t.split("=")[0] for t in r.argv[1:] if "=" in t]
    assert read_bundle(r.value("--out")).task_names == tasks


def check_emr_extract(r: Run, out: str, capsys) -> None:
    from serve.store.tensors import SafetensorsSource

    task = Path(r.value("--out"))
    assert (task / "config.json").is_file() and set(SafetensorsSource(task)) == set(SafetensorsSource(r.world.base))


def check_adapter_convert(r: Run, out: str, capsys) -> None:
    config = json.loads((Path(r.value("--out")) / "adapter_config.json").read_text())
    assert config["r"] == 8  # rank 2r


def check_adapter_train(r: Run, out: str, capsys) -> None:
    adapter = Path(r.value("--out"))
    assert (adapter / "adapter_config.json").is_file() and (adapter / "train_log.json").is_file()
    assert (adapter / "translora").is_dir() == ("--discriminator" in r.argv)


CHECKS: dict[str, Callable[[Run, str, object], None]] = {
    "store add": check_store_add, "store list": check_store_list, "store verify": check_store_verify,
    "store extract": check_store_extract, "store remove": check_store_remove, "store gc": check_store_gc,
    "fmdelta compress": check_fmdelta_compress, "fmdelta decompress": check_fmdelta_decompress,
    "neuzip compress": check_neuzip_compress, "neuzip decompress": check_neuzip_decompress,
    "emr merge": check_emr_merge, "emr extract": check_emr_extract,
    "adapter convert": check_adapter_convert, "adapter train": check_adapter_train,
}
"""Command -> the check of a run's effect (stdout given): what makes it a runner."""


@pytest.mark.parametrize("command,form,store", run_cases())
def test_a_documented_command_runs_as_written(world, capsys, command, form, store):
    run = Run(world, form, store and world.stores[store])
    argv = bind(run)
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, f"`{form}` (of `{command}`) as `{shlex.join(argv)}`: exit {code}: {err.strip()}"
    CHECKS[run.command](run, out, capsys)


def test_debug_shows_the_traceback_the_one_line_error_hides(tmp_path, capsys):
    """`manyfold --debug ...` shows the traceback: the error is raised rather than printed as one line."""
    from serve.errors import ArtifactError

    assert main(["store", "list", "--store", str(tmp_path)]) == 1
    assert capsys.readouterr().err.count("\n") == 1
    with pytest.raises(ArtifactError):
        main(["--debug", "store", "list", "--store", str(tmp_path)])


def test_every_documented_command_runs_here_or_says_why_not():
    """Each documented command is run above (a runner in CHECKS, every placeholder bound) or has its reason (NOT_HERE,
    or PROSE naming a line that runs); and no reason, prose entry, runner or binding is left over from a command the
    docs no longer show."""
    docs = {c for _, c in documented()}
    runs = {c for c in docs if placement(c) == "run"}
    problems = [f"`{c}`: no runner (CHECKS['{command_of(c)}']) and no reason (NOT_HERE)"
                for c in sorted(runs) if command_of(c) not in CHECKS]
    problems += [f"`{f}`: nothing bound to {s}" for c in sorted(runs) for f in forms(c) for s in slots(f)
                 if binding(s) is None and PLACEHOLDER.match(s[2])]
    problems += [f"`{f}`: no store to run against" for c in sorted(runs) for f in forms(c) if not store_kinds(f)]
    problems += [f"PROSE['{c}'] names `{line}`, which {'does not run' if line in docs else 'the docs do not show'}"
                 for c, line in PROSE.items() if line not in runs]
    problems += [f"PROSE['{c}']: not in the docs" for c in PROSE if c not in docs]
    problems += [f"NOT_HERE['{p}']: no documented command" for p in NOT_HERE
                 if not any(c == p or c.startswith(p + " ") for c in docs - set(PROSE))]
    problems += [f"CHECKS['{k}']: no documented command runs it" for k in CHECKS
                 if k not in {command_of(c) for c in runs}]
    used = {s for c in runs for f in forms(c) for s in slots(f)}
    problems += [f"PLACEHOLDERS[{k}]: no documented command shows it" for k in PLACEHOLDERS
                 if k not in used and not (k[0] == "*" and any(s[1:] == k[1:] for s in used))]
    assert not problems, "\n".join(problems)
