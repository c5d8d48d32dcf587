"""EMR-Merging (../shared/METHODS.md section 3): a group of full fine-tunes of one base becomes one unified task
vector tau_uni, plus per task a 1-bit mask M_t, one rescaler lambda_t and the task's own head.

Per merged tensor, with tau_t = W_t - W_pre computed in fp64:
    Elect    sign_uni = sgn(sum_t tau_t), a tie (sum exactly 0) going to -1;
             eps_uni  = max |tau_t| over the tasks whose sign equals sign_uni (0 where none does);
             tau_uni  = sign_uni * eps_uni      (so tau_uni = 0 exactly where every tau_t = 0)
    Mask     M_t = tau_t * tau_uni > 0          (strict: a zero entry is never in a mask)
    Rescale  "mean" (the 8-task reference code, the default):
                 lambda_t = sum_n mean|tau_t[n]| / sum_n mean|M_t[n] * tau_uni[n]|   (n over tensors)
             "global" (the paper's text and its 30-model script):
                 lambda_t = sum|tau_t| / sum|M_t * tau_uni|
             A zero denominator means M_t is empty: the task's vector is zero, or every entry lost the vote.
             W_t_hat is then W_pre whatever lambda_t is, and lambda_t is set to 1 (never NaN or inf).
    Task t   W_t_hat = W_pre + lambda_t * (M_t * tau_uni), served as x W_pre^T + lambda_t x (M_t * tau_uni)^T.

What is merged: every floating tensor of the base, matched by name in each checkpoint (serve.codecs.fmdelta_file
.match_base_name), which every task must hold with the base's shape. Tensors that match nothing in the base are
the task's own head (classifier., score.) and are never merged. tau_uni is stored in the base's dtype, only
for tensors some task changed.

A bundle is a directory: bundle.json (this format's schema, with every other file's size and sha256),
tau.safetensors (tau_uni by base tensor name), masks.safetensors (per tensor, the tasks' masks stacked and
bit-packed along the last dimension: uint8 [tasks, *shape[:-1], ceil(shape[-1] / 8)], as kernels.emr_delta
reads them), heads.safetensors ("<task>/<tensor>") and configs/<task>.json. It is written beside its
destination and swapped in only when whole; a reader checks every file before it trusts one.
"""

import json
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import Field, ValidationError

from kernels import pack_bits, unpack_bits
from serve.codecs.fmdelta_file import match_base_name
from serve.errors import ArtifactError, VariantIncompatible, first_error
from serve.store.manifest import Name, Sha256, StrictModel
from serve.store.model_dir import architecture_of, classifier_labels, is_tokenizer_file, read_model_config
from serve.store.tensors import SafetensorsSource, fingerprint, save_tensors
from serve.store.view import file_sha256
from serve.store.writer import atomic_dir, atomic_write

BUNDLE_JSON = "bundle.json"
TAU_FILE = "tau.safetensors"
MASKS_FILE = "masks.safetensors"
HEADS_FILE = "heads.safetensors"
HEAD_PREFIXES = ("classifier.", "score.")
"""Checkpoint tensors that are a task's own head: never merged, kept per task."""
Rescaler = Literal["mean", "global"]
TASK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""A task name: what the store's Name allows, so "<group>/<task>" is a model id."""


class BundleFile(StrictModel):
    bytes: Annotated[int, Field(ge=0)]
    sha256: Sha256


class BundleTask(StrictModel):
    name: Name
    rescaler: float
    """lambda_t."""
    architecture: str
    labels: list[str] | None = None
    mask_bits: int
    """Bits set in its masks (for `manyfold emr inspect` and tests; the masks hold one bit per merged weight)."""


class BundleManifest(StrictModel):
    format: Literal["manyfold.emr"] = "manyfold.emr"
    version: Literal[1] = 1
    base_fingerprint: Sha256
    base_architecture: str
    base_path: str
    """Where `merge` read the base: `extract` reads it there unless told otherwise (its fingerprint is checked)."""
    rescaler: Rescaler
    names: dict[str, str]
    """Checkpoint tensor name -> base tensor name, the same for every task."""
    merged_params: int
    """Weights under a mask: the elements of every tensor in tau.safetensors."""
    tasks: list[BundleTask]
    files: dict[str, BundleFile]


@dataclass
class EmrBundle:
    """A bundle read and checked: its manifest and where its files are."""

    path: Path
    manifest: BundleManifest

    @property
    def task_names(self) -> list[str]:
        return [t.name for t in self.manifest.tasks]

    def task(self, name: str) -> tuple[int, BundleTask]:
        for i, t in enumerate(self.manifest.tasks):
            if t.name == name:
                return i, t
        raise VariantIncompatible(f"{self.path}: no task '{name}' (tasks: {', '.join(self.task_names)})")

    def tensors(self, file: str) -> SafetensorsSource:
        return SafetensorsSource(self.path / file)

    def config(self, task: str) -> dict:
        return json.loads((self.path / "configs" / f"{task}.json").read_text())


# ---- the maths, one tensor at a time
def elect(taus: torch.Tensor) -> torch.Tensor:
    """[tasks, ...] task vectors -> tau_uni [...] (Elect above)."""
    sign = torch.where(taus.sum(0) > 0, 1.0, -1.0).to(taus.dtype)  # a tie goes to -1
    agree = torch.sign(taus) == sign
    eps = torch.where(agree, taus.abs(), torch.zeros((), dtype=taus.dtype)).amax(0)
    return sign * eps


def masks_of(taus: torch.Tensor, tau_uni: torch.Tensor) -> torch.Tensor:
    """[tasks, ...] bool: M_t = tau_t * tau_uni > 0."""
    return taus * tau_uni > 0


def rescalers(num: list[float], den: list[float]) -> list[float]:
    """lambda_t = num_t / den_t, 1 where den_t is 0 (an empty mask: the task reconstructs to the base)."""
    return [n / d if d > 0 else 1.0 for n, d in zip(num, den)]


def reconstruct(base: torch.Tensor, tau_uni: torch.Tensor, mask: torch.Tensor, rescaler: float) -> torch.Tensor:
    """W_t_hat = W_pre + lambda_t * (M_t * tau_uni), summed in fp32, in the base's dtype."""
    delta = torch.where(mask, tau_uni.float(), 0.0) * rescaler
    return (base.float() + delta).to(base.dtype)


# ---- merge
def _task_tensors(name: str, path: Path, base: Mapping[str, torch.Tensor]) -> tuple[dict[str, str], list[str]]:
    """A task's checkpoint -> (its name -> base name for the base tensors it holds, which include every floating
    one; its head tensor names). Integer buffers a checkpoint leaves out (position ids) are the base's."""
    base_names, names, head = set(base), {}, []
    for ckpt in SafetensorsSource(path):
        target = match_base_name(ckpt, base_names)
        if target is None:
            if not ckpt.startswith(HEAD_PREFIXES):
                raise VariantIncompatible(f"task '{name}': tensor '{ckpt}' matches nothing in the base and is no "
                                          f"head ({', '.join(HEAD_PREFIXES)})")
            head.append(ckpt)
        else:
            names[ckpt] = target
    missing = sorted(b for b in base_names - set(names.values()) if base[b].dtype.is_floating_point)
    if missing:
        raise VariantIncompatible(f"task '{name}': {path} lacks base tensor '{missing[0]}'"
                                  f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}")
    return names, head


def _shared_names(tasks: Mapping[str, str | Path], base: Mapping[str, torch.Tensor]
                  ) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Checkpoint name -> base name, which every task must share (one architecture), and each task's head."""
    names, heads = {}, {}
    for t, p in tasks.items():
        names[t], heads[t] = _task_tensors(t, Path(p), base)
    first = next(iter(tasks))
    for t in tasks:
        if names[t] != names[first]:
            raise VariantIncompatible(f"task '{t}' names its tensors unlike task '{first}': merge fine-tunes of "
                                      f"one architecture")
    return names[first], heads


def _task_vectors(sources: Mapping[str, SafetensorsSource], ckpt: str, w_pre: torch.Tensor) -> torch.Tensor:
    """tau_t = W_t - W_pre in fp64 for one tensor, every task's stacked: [tasks, ...]."""
    taus = []
    for t, source in sources.items():
        w = source[ckpt]
        if w.shape != w_pre.shape:
            raise VariantIncompatible(f"task '{t}': tensor '{ckpt}' is {list(w.shape)}; the base has "
                                      f"{list(w_pre.shape)}")
        taus.append(w.double() - w_pre.double())
    return torch.stack(taus)


@dataclass
class _Merged:
    """What merging leaves, tensor by tensor: tau_uni and the packed masks; per task, its rescaler's sums and the
    bits set in its masks."""

    rescaler: Rescaler
    num: list[float]
    den: list[float]
    bits: list[int]
    tau: dict[str, torch.Tensor] = field(default_factory=dict)
    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    params: int = 0

    def add(self, b: str, w_pre: torch.Tensor, taus: torch.Tensor) -> bool:
        """Elect and mask base tensor `b` from its task vectors [tasks, ...]; False if no task changed it."""
        tau_uni = elect(taus)
        if not tau_uni.any():
            return False  # no task changed it: no vector, no masks
        mask = masks_of(taus, tau_uni)  # [tasks, ...]
        masked = torch.where(mask, tau_uni.abs(), 0.0)  # [tasks, ...] |M_t * tau_uni|
        for k in range(len(taus)):
            if self.rescaler == "mean":
                self.num[k] += float(taus[k].abs().mean())
                self.den[k] += float(masked[k].mean())
            else:
                self.num[k] += float(taus[k].abs().sum())
                self.den[k] += float(masked[k].sum())
        self.bits = [n + int(m.sum()) for n, m in zip(self.bits, mask)]
        self.tau[b] = tau_uni.to(w_pre.dtype)
        self.masks[b] = pack_bits(mask if w_pre.dim() else mask[:, None])
        self.params += w_pre.numel()
        return True


def _merge_tensors(base: SafetensorsSource, sources: Mapping[str, SafetensorsSource], names: dict[str, str],
                   rescaler: Rescaler, progress: Callable[[str], None] | None) -> _Merged:
    """Every floating base tensor the tasks hold, merged in the base's name order."""
    n_tasks = len(sources)
    merged = _Merged(rescaler, [0.0] * n_tasks, [0.0] * n_tasks, [0] * n_tasks)
    to_ckpt = {b: c for c, b in names.items()}
    for i, b in enumerate(sorted(base)):
        w_pre = base[b]
        if not w_pre.dtype.is_floating_point or b not in to_ckpt:
            continue
        if not merged.add(b, w_pre, _task_vectors(sources, to_ckpt[b], w_pre)):
            continue
        if progress is not None and (i + 1) % 50 == 0:
            progress(f"merged {i + 1} of {len(base)} tensors")
    return merged


def _write_parts(staged: Path, merged: _Merged, sources: Mapping[str, SafetensorsSource],
                 heads: Mapping[str, list[str]], configs: Mapping[str, dict]) -> dict[str, BundleFile]:
    """Every file of a bundle but bundle.json, written into `staged`; returns their sizes and digests."""
    save_tensors(staged / TAU_FILE, merged.tau)
    save_tensors(staged / MASKS_FILE, merged.masks)
    save_tensors(staged / HEADS_FILE, {f"{t}/{h}": sources[t][h] for t in sources for h in heads[t]})
    (staged / "configs").mkdir()
    for t, cfg in configs.items():
        atomic_write(staged / "configs" / f"{t}.json", [json.dumps(cfg, indent=2).encode()])
    return {str(p.relative_to(staged)): BundleFile(bytes=p.stat().st_size, sha256=file_sha256(p))
            for p in sorted(staged.rglob("*")) if p.is_file()}


def merge(base_dir: str | Path, tasks: Mapping[str, str | Path], out: str | Path, rescaler: Rescaler = "mean",
          progress: Callable[[str], None] | None = None) -> EmrBundle:
    """Merge the fine-tunes `tasks` (name -> HF model directory) of the base at `base_dir` into a bundle at `out`.
    A bundle already at `out` is replaced only once the new one is complete."""
    if len(tasks) < 1:
        raise VariantIncompatible("an EMR group needs at least one task")
    base_dir = Path(base_dir)
    base = SafetensorsSource(base_dir)
    sources = {t: SafetensorsSource(p) for t, p in tasks.items()}
    names, heads = _shared_names(tasks, base)
    configs = {t: read_model_config(Path(p)) for t, p in tasks.items()}
    merged = _merge_tensors(base, sources, names, rescaler, progress)
    lambdas = rescalers(merged.num, merged.den)
    task_entries = [BundleTask(name=t, rescaler=lambdas[k], mask_bits=merged.bits[k], labels=classifier_labels(
        configs[t]), architecture=architecture_of(configs[t], Path(tasks[t]))) for k, t in enumerate(tasks)]
    with atomic_dir(out, replace=True) as staged:
        files = _write_parts(staged, merged, sources, heads, configs)
        manifest = BundleManifest(base_fingerprint=fingerprint(base), base_architecture=architecture_of(
            read_model_config(base_dir), base_dir), base_path=str(base_dir.resolve()), rescaler=rescaler,
            names=names, merged_params=merged.params, tasks=task_entries, files=files)
        atomic_write(staged / BUNDLE_JSON, [manifest.model_dump_json(indent=2).encode() + b"\n"])
    return read_bundle(out)


def _last(t: torch.Tensor) -> int:
    return t.shape[-1] if t.dim() else 1


# ---- read
def read_bundle(path: str | Path, verify: bool = True) -> EmrBundle:
    """Read a bundle's manifest strictly and (by default) check every file's size and sha256 against it."""
    path = Path(path)
    mpath = path / BUNDLE_JSON
    if not mpath.is_file():
        raise ArtifactError(f"{path}: not an EMR bundle (no {BUNDLE_JSON})")
    try:
        manifest = BundleManifest.model_validate_json(mpath.read_bytes())
    except ValidationError as e:
        raise ArtifactError(f"{mpath}: malformed bundle manifest ({first_error(e)})") from e
    if verify:
        for rel, f in manifest.files.items():
            p = path / rel
            if not p.is_file():
                raise ArtifactError(f"{p}: missing from the bundle")
            if p.stat().st_size != f.bytes:
                raise ArtifactError(f"{p}: {p.stat().st_size} bytes, the bundle says {f.bytes} (truncated?)")
            if file_sha256(p) != f.sha256:
                raise ArtifactError(f"{p}: sha256 mismatch: the file is corrupt")
    return EmrBundle(path, manifest)


def check_base(bundle: EmrBundle, base: Mapping[str, torch.Tensor], where: str) -> None:
    if fingerprint(base) != bundle.manifest.base_fingerprint:
        raise VariantIncompatible(f"{bundle.path}: merged against another base than {where} (fingerprints differ)")


# ---- extract
def task_tensors(bundle: EmrBundle, task: str, base: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reconstructed task model's tensors under its checkpoint names: W_t_hat for merged tensors, the base's
    for the rest, and its own head."""
    k, entry = bundle.task(task)
    tau, masks = bundle.tensors(TAU_FILE), bundle.tensors(MASKS_FILE)
    out = {}
    for ckpt, b in bundle.manifest.names.items():
        w_pre = base[b]
        if b in tau:
            t = tau[b]
            mask = unpack_bits(masks[b][k], _last(t)).reshape(t.shape)
            out[ckpt] = reconstruct(w_pre, t, mask, entry.rescaler)
        else:
            out[ckpt] = w_pre
    heads = bundle.tensors(HEADS_FILE)
    prefix = f"{task}/"
    out.update({n[len(prefix):]: heads[n] for n in heads if n.startswith(prefix)})
    return out


def extract(bundle_path: str | Path, task: str, out_dir: str | Path, base_dir: str | Path | None = None) -> Path:
    """Write task `task` of a bundle as a HF model directory: config, model.safetensors, the base's tokenizer."""
    bundle = read_bundle(bundle_path)
    bundle.task(task)
    base_dir = Path(base_dir or bundle.manifest.base_path)
    base = SafetensorsSource(base_dir)
    check_base(bundle, base, str(base_dir))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for p in base_dir.iterdir():
        if p.is_file() and (is_tokenizer_file(p.name) or p.name == "generation_config.json"):
            shutil.copy2(p, out_dir / p.name)
    atomic_write(out_dir / "config.json", [json.dumps(bundle.config(task), indent=2).encode()])
    save_tensors(out_dir / "model.safetensors", task_tensors(bundle, task, base), metadata={"format": "pt"})
    return out_dir


def read_merge_args(pairs: list[str]) -> dict[str, Path]:
    """`NAME=DIR` pairs of `manyfold emr merge --task` -> {name: dir}, names unique and well formed."""
    out = {}
    for pair in pairs:
        name, sep, d = pair.partition("=")
        if not sep or not TASK_NAME.fullmatch(name) or not d:
            raise VariantIncompatible(f"--task {pair!r}: expected NAME=DIR, NAME of letters, digits, '.', '_', '-'")
        if name in out:
            raise VariantIncompatible(f"--task {name!r} is given twice")
        out[name] = Path(d)
    return out


def describe(bundle: EmrBundle) -> list[dict]:
    """One row per task: what `manyfold emr merge` prints."""
    m = bundle.manifest
    return [{"task": t.name, "rescaler": round(t.rescaler, 4), "mask_bits": t.mask_bits,
             "mask_share": round(t.mask_bits / max(m.merged_params, 1), 4), "labels": t.labels} for t in m.tasks]
