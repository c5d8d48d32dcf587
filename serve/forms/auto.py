"""`manyfold store add --kind auto`: a full fine-tune registered in the form with the least resident bytes whose
disagreement with the fine-tune on a calibration set is within a tolerance.

The candidates: FM-Delta (exact, nothing to measure), the delta cut to rank 1, 2, 4, ... (each a LoRA, measured)
while it weighs less than FM-Delta, and a task of every EMR group of the same base and architecture (re-merged,
measured). They are measured from the lightest up and the first within tolerance wins: with tolerance 0 only an
exact form can. The store records the candidates, their bytes and agreement, and the choice (FormRecord); the
SVD, the re-merge and a generated calibration set are deterministic, so the same inputs choose the same form.
"""

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from serve.config import SlotsConfig
from serve.errors import ConfigError
from serve.forms.agreement import Agreement, Calibration, Reference, generated_calibration, read_calibration
from serve.forms.emr_member import Remerged, groups_for, remerge
from serve.forms.lowrank import DeltaFactors, factor_delta, lowrank_state, write_lora
from serve.store.manifest import FormCandidate, FormRecord, FullVariantEntry, VariantEntry, check_name
from serve.store.model_dir import architecture_of, is_causal_lm, read_model_config
from serve.store.store import Store
from serve.store.tensors import SafetensorsSource
from serve.variants.full import DELTA_FILE, resident_bytes, stage_full_variant

RANKS = (1, 2, 4, 8, 16, 32, 64)
Progress = Callable[[str], None]


def parse_tolerance(text: str) -> float:
    """"2%" or "0.02" -> 0.02: the share of labels (or greedy tokens) allowed to differ from the fine-tune's."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise ConfigError(f"--tolerance {text!r}: expected a fraction (0.02) or a percentage (2%)") from None
    if not 0 <= value < 1:
        raise ConfigError(f"--tolerance {text!r}: must be at least 0 and below 100%")
    return value


@dataclass(eq=False)
class Candidate:
    form: str
    resident_bytes: int
    stored_bytes: int
    state: Callable[[], dict[str, torch.Tensor]] | None = None
    """The state dict serving it amounts to (None: exact, nothing to measure); a re-merged group's is read."""
    rank: int | None = None
    """A low-rank form's rank."""
    remerged: Remerged | None = None
    agreement: Agreement | None = None

    def record(self) -> FormCandidate:
        a = self.agreement
        return FormCandidate(form=self.form, resident_bytes=self.resident_bytes, stored_bytes=self.stored_bytes,
                             agreement=None if a is None else round(a.agreement, 6),
                             kl=None if a is None or a.kl is None else round(a.kl, 6))


@dataclass(frozen=True)
class Fine:
    """The fine-tune being placed: its directory, model (the reference every form is measured against)."""

    path: Path
    architecture: str
    causal: bool
    model: torch.nn.Module
    tokenizer: object


def load_fine(path: Path) -> Fine:
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    arch = architecture_of(read_model_config(path), path)
    cls = getattr(transformers, arch, None)
    if cls is None:
        raise ConfigError(f"{path}: architecture {arch!r} is not one transformers builds")
    model = cls.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return Fine(path, arch, is_causal_lm(arch), model, tokenizer)


def exact_candidate(store: Store, name: str, base: str, finetuned: Path, staged: Path
                    ) -> tuple[FullVariantEntry, Candidate]:
    """The fine-tune's FM-Delta file coded into `staged`: (its entry, for a commit; its candidate)."""
    entry, stats = stage_full_variant(store, name, base, finetuned, staged)
    return entry, Candidate("fmdelta", resident_bytes(staged / DELTA_FILE), stats.file_bytes)


def measured_candidates(store: Store, base: str, name: str, fine: Fine, limit: int, max_rank: int, work: Path
                        ) -> tuple[list[Candidate], DeltaFactors]:
    """Every form that must be measured, lighter than `limit` where its weight is known beforehand: the delta at
    rising ranks, then a task of each EMR group it can join; and the delta's factors (what a LoRA is cut from)."""
    factors = factor_delta(store.base_dir(base), fine.path)
    candidates = lowrank_candidates(factors, fine, store.base_dir(base), limit, max_rank)
    return candidates + emr_candidates(store, base, name, fine, work), factors


def lowrank_candidates(factors: DeltaFactors, fine: Fine, base_dir: Path, limit: int, max_rank: int
                       ) -> list[Candidate]:
    """The delta at every rank in RANKS up to the slots' maximum, while it weighs less than `limit`."""
    state = fine.model.state_dict()
    base = SafetensorsSource(base_dir)
    out = []
    for r in RANKS:
        if r > max_rank or factors.nbytes(r) >= limit:
            break
        out.append(Candidate(f"lora r{r}", factors.nbytes(r), factors.nbytes(r), rank=r,
                             state=lambda r=r: lowrank_state(state, base, factors, r)))
        if r >= factors.max_rank():
            break
    return out


def emr_candidates(store: Store, base: str, name: str, fine: Fine, work: Path) -> list[Candidate]:
    out = []
    for group in groups_for(store, base, fine.architecture, name):
        re = remerge(store, group, name, fine.path, work / group.name)
        def state(d: Path = re.model_dir) -> dict[str, torch.Tensor]:
            return type(fine.model).from_pretrained(d, dtype=torch.float32).state_dict()

        out.append(Candidate(f"emr {group.name}", re.added_bytes, re.added_bytes, remerged=re, state=state))
    return out


def calibration_for(fine: Fine, base: str, given: Calibration | None) -> Calibration:
    if given is not None:
        return given
    if not fine.causal:
        raise ConfigError("a classifier's forms are measured on its task's text: pass --calibration FILE (JSONL "
                          "of {\"text\": ...}) with --tolerance above 0")
    return generated_calibration(fine.model, fine.tokenizer, base)


def choose(candidates: list[Candidate], fine: Fine, reference: Reference | None, tolerance: float,
           progress: Progress) -> Candidate:
    """Measure from the lightest up; the first within tolerance (an exact one always is) is chosen. At tolerance
    0 only an exact form is, whatever a measurement says: agreeing on every calibration text is not being exact."""
    probe = None
    for c in sorted(candidates, key=lambda c: c.resident_bytes):
        if c.state is None:
            return c
        if tolerance == 0:
            continue
        if c.agreement is None:  # a benchmark measures every candidate first
            if probe is None:
                probe = type(fine.model).from_pretrained(fine.path, dtype=torch.float32).eval()
            probe.load_state_dict(c.state())
            c.agreement = reference.measure(probe)
            progress(f"{c.form}: agreement {c.agreement.agreement:.2%}")
        if c.agreement.disagreement <= tolerance:
            return c
    raise AssertionError("the exact form is always a candidate")


def add_auto(store: Store, name: str, base: str, finetuned: Path, tolerance: float = 0.0,
             calibration: Path | None = None, slots: SlotsConfig = SlotsConfig(),
             progress: Progress | None = None) -> tuple[VariantEntry, str]:
    """Register `finetuned` in its cheapest form within `tolerance`; -> (the entry written, the model id)."""
    check_name(name)
    if name in store.manifest.variants:
        raise ConfigError(f"store {store.root}: a variant named '{name}' exists already")
    progress = progress or (lambda _: None)
    finetuned = Path(finetuned)
    given = read_calibration(calibration) if calibration is not None else None  # a bad file fails first
    # work beside the staged entry: a store on object storage stages on this node, and its root is a URL
    with store.stage() as staged_full, tempfile.TemporaryDirectory(dir=staged_full.parent) as work:
        full_entry, exact = exact_candidate(store, name, base, finetuned, staged_full)
        candidates, chosen, reference, factors = [exact], exact, None, None
        if tolerance > 0:
            fine = load_fine(finetuned)
            reference = Reference(fine.model, fine.tokenizer, calibration_for(fine, base, given), fine.causal)
            measured, factors = measured_candidates(store, base, name, fine, exact.resident_bytes, slots.max_rank,
                                                    Path(work))
            candidates += measured
            chosen = choose(candidates, fine, reference, tolerance, progress)
        record = FormRecord(chosen=chosen.form, tolerance=tolerance,
                            calibration=reference.source if reference else None,
                            candidates=[c.record() for c in sorted(candidates, key=lambda c: c.resident_bytes)])
        if chosen is exact:
            return store.commit(staged_full, full_entry.model_copy(update={"form": record})), name
        return register(store, chosen, name, base, finetuned, factors, Path(work), slots, record)


def register(store: Store, c: Candidate, name: str, base: str, finetuned: Path, factors: DeltaFactors, work: Path,
             slots: SlotsConfig, record: FormRecord | None) -> tuple[VariantEntry, str]:
    """A measured candidate registered as what it is, with its form record: a LoRA named `name` cut from
    `factors`, or the task its group was re-merged with; -> (the entry written, the model id)."""
    from serve.variants import variant_kind

    if c.remerged is not None:
        return register_member(store, c.remerged, base, record)
    adapter = write_lora(factors, c.rank, finetuned, work / f"adapter-r{c.rank}")
    with store.stage() as staged:
        entry = variant_kind("lora").stage(store, name, base, adapter, staged, store.base_shapes(base), slots)
        return store.commit(staged, entry.model_copy(update={"form": record})), name


def register_member(store: Store, re: Remerged, base: str, record: FormRecord | None) -> tuple[VariantEntry, str]:
    """Replace the group by its re-merged bundle, the new task carrying its form record."""
    from serve.store.manifest import MEMBER_SEP
    from serve.variants import variant_kind

    with store.stage() as staged:
        entry = variant_kind("emr").stage(store, re.group, base, re.bundle, staged)
        tasks = [t.model_copy(update={"form": record}) if t.name == re.task else t for t in entry.tasks]
        entry = store.commit(staged, entry.model_copy(update={"tasks": tasks}), replace=True)
    return entry, f"{re.group}{MEMBER_SEP}{re.task}"
