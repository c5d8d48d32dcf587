"""PEFT LoRA adapters (kind "lora"): validated against their base, stored as given, applied per row.

For the rows of an adapter each targeted Linear (or GPT-2 Conv1D) adds `s (x A^T) B^T` with PEFT's
conventions: A is (r, in), B is (out, r), s = alpha / r (alpha / sqrt(r) with rslora), r and alpha per module
through `rank_pattern` / `alpha_pattern`. fan_in_fan_out (PEFT sets it for Conv1D) only says the base weight
is stored (in, out); the correction is the same. A classifier adapter may carry its head through `modules_to_save`
(classifier or score): heads are per row. Every other PEFT option that changes the maths is refused by name.
"""

import contextlib
import json
import math
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from serve.codecs.fmdelta_file import match_base_name
from serve.config import SlotsConfig
from serve.errors import ArtifactError, VariantIncompatible
from serve.store.manifest import LoraVariantEntry, VariantEntry, check_name
from serve.store.store import Store
from serve.store.tensors import Alloc
from serve.variants.base import (
    BaseView,
    Failures,
    LoadedVariant,
    Progress,
    VariantKind,
    register_variant,
    stage_each,
)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PICKLE_WEIGHTS = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
LABELS_CONFIG = "config.json"
"""Optional, beside a classifier adapter: a transformers config whose id2label names its classes."""
HEAD_MODULES = ("classifier", "score")
_PREFIX = "base_model.model."
TRANSLORA_DIR = "translora"
"""Beside an adapter: seed examples and a discriminator for a Trans-LoRA transfer (serve/adapters/translora.py);
kept with the adapter in the store."""
_MUTATED_BASE_INITS = ("olora", "corda", "loftq", "lora_ga")
"""init_lora_weights whose adapter is relative to a changed base, not the one it names."""
_UNSUPPORTED = {  # option: the value that means "not used"
    "use_dora": False, "lora_bias": False, "bias": "none", "layer_replication": None,
    "trainable_token_indices": None, "target_parameters": None, "use_qalora": False,
    "alora_invocation_tokens": None, "use_bdlora": None, "megatron_config": None,
}


def matmul_dims(module: torch.nn.Module) -> tuple[int, int] | None:
    """(in, out) of a layer computing x W^T (Linear: W is [out, in]) or x W (GPT-2's Conv1D: W is [in, out]);
    None for any other module, which an adapter cannot target."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, Conv1D):
        return module.nx, module.nf
    return None


def convert_hint(path: Path) -> str:
    return (f"{path} is a raw PiSSA adapter, relative to its residual base, not to the base it names; convert "
            f"it first: manyfold adapter convert --adapter {path} --initial INITIAL_ADAPTER_DIR --out OUT")


def is_raw_pissa(config: dict) -> bool:
    """init_lora_weights "pissa..." (as PEFT tests it): B A is then relative to the residual base."""
    init = config.get("init_lora_weights")
    return isinstance(init, str) and init.lower().startswith("pissa")


def read_peft_adapter(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, tensors) of a PEFT adapter directory, read strictly: safetensors only (a pickle
    is never opened), the config a JSON object. What the options mean is checked by the caller."""
    path = Path(path)
    if not path.is_dir():
        raise ArtifactError(f"{path}: no such adapter directory")
    if any((path / p).exists() for p in PICKLE_WEIGHTS):
        raise ArtifactError(f"{path}: adapter weights are a pickle file, which can run code when loaded; Manyfold "
                            f"reads {ADAPTER_WEIGHTS} only (save with safe_serialization=True)")
    cfg_path, weights = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    if not cfg_path.is_file():
        raise ArtifactError(f"{path}: not a PEFT adapter directory (no {ADAPTER_CONFIG})")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{cfg_path}: not valid JSON ({str(e).splitlines()[0]})") from e
    if not isinstance(cfg, dict):
        raise ArtifactError(f"{cfg_path}: expected a JSON object")
    if not weights.is_file():
        raise ArtifactError(f"{path}: no {ADAPTER_WEIGHTS}")
    try:
        with safe_open(weights, framework="pt") as f:
            return cfg, {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own SafetensorError and OSError
        raise ArtifactError(f"{weights}: not a readable safetensors file ({str(e).splitlines()[0]})") from e


def check_servable(path: Path, cfg: dict) -> None:
    """Every option Manyfold cannot serve is refused by name."""
    cfg_path = path / ADAPTER_CONFIG
    if cfg.get("peft_type") != "LORA":
        raise VariantIncompatible(f"{cfg_path}: peft_type is {cfg.get('peft_type')!r}; Manyfold serves LORA")
    for option, unused in _UNSUPPORTED.items():
        if cfg.get(option, unused) not in (unused, None, False, {}, []):
            raise VariantIncompatible(f"{cfg_path}: {option}={cfg[option]!r} is not supported")
    extra = [m for m in cfg.get("modules_to_save") or [] if m not in HEAD_MODULES]
    if extra:
        raise VariantIncompatible(f"{cfg_path}: modules_to_save {extra} is not supported (only a classifier "
                                  f"head: {', '.join(HEAD_MODULES)})")
    if is_raw_pissa(cfg):
        raise VariantIncompatible(convert_hint(path))
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_MUTATED_BASE_INITS):
        raise VariantIncompatible(f"{cfg_path}: init_lora_weights={init!r} leaves the adapter relative to a "
                                  f"changed base; Manyfold serves adapters of the unchanged base")
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key), int | float) or isinstance(cfg.get(key), bool) or cfg[key] <= 0:
            raise ArtifactError(f"{cfg_path}: '{key}' must be a positive number, got {cfg.get(key)!r}")


def module_scale(cfg: dict, module: str, rank: int) -> float:
    """PEFT's scaling for one module: alpha / r, or alpha / sqrt(r) with rslora (patterns resolved)."""
    expected = _per_module(cfg.get("rank_pattern"), module, cfg["r"])
    if rank != expected:
        raise VariantIncompatible(f"module '{module}' has rank {rank}; its adapter_config.json says {expected}")
    alpha = _per_module(cfg.get("alpha_pattern"), module, cfg["lora_alpha"])
    return alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


def _per_module(patterns: dict | None, module: str, default: float) -> float:
    """A module's value in PEFT's rank_pattern or alpha_pattern, resolved as PEFT resolves it. peft is imported only
    for an adapter that has patterns: every process that serves imports this module, and peft's own import adds about
    a quarter of a second to it."""
    if not patterns:
        return default
    from peft.utils.other import get_pattern_key

    return patterns.get(get_pattern_key(list(patterns), module), default)


def parse_adapter(path: Path, shapes: dict[str, list[int]], base: str, max_rank: int
                  ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor, float]], dict[str, torch.Tensor]]:
    """A PEFT adapter directory against its base's tensor shapes -> ({base module: (A, B, scale)}, head).

    Every module must be a 2-D weight of the base with A (r, in) and B (out, r), r <= max_rank; the weight is
    (out, in), or (in, out) where the adapter says fan_in_fan_out (Conv1D)."""
    cfg, tensors = read_peft_adapter(path)
    check_servable(path, cfg)
    heads = tuple(cfg.get("modules_to_save") or ())
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    head: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        inner = key.removeprefix(_PREFIX)
        module, _, part = inner.rpartition(".lora_")
        if module and part in ("A.weight", "B.weight"):
            pairs.setdefault(module, {})[part[0]] = t
        elif inner.split(".")[0] in heads and inner.rsplit(".", 1)[-1] in ("weight", "bias"):
            head[inner.rsplit(".", 1)[-1]] = t
        else:
            raise VariantIncompatible(f"{path / ADAPTER_WEIGHTS}: tensor '{key}' is not a LoRA A/B pair or a "
                                      f"classifier head (embedding LoRA, DoRA and biases are not supported)")
    if not pairs:
        raise ArtifactError(f"{path / ADAPTER_WEIGHTS}: no LoRA tensors")
    out = {}
    for module, ab in sorted(pairs.items()):
        missing = {"A", "B"} - set(ab)
        if missing:
            raise ArtifactError(f"{path / ADAPTER_WEIGHTS}: module '{module}' has no lora_{missing.pop()}")
        out.update(_check_module(module, ab["A"], ab["B"], cfg, shapes, base, max_rank))
    return out, head


def _check_module(module: str, a: torch.Tensor, b: torch.Tensor, cfg: dict, shapes: dict[str, list[int]],
                  base: str, max_rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    target = match_base_name(f"{module}.weight", set(shapes))
    if target is None or len(shapes[target]) != 2:
        raise VariantIncompatible(f"adapter module '{module}' is no linear layer of base '{base}'")
    out_f, in_f = reversed(shapes[target]) if cfg.get("fan_in_fan_out") else shapes[target]
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or not a.is_floating_point():
        raise VariantIncompatible(f"adapter module '{module}': lora_A {list(a.shape)} and lora_B {list(b.shape)} "
                                  f"are no rank-r pair")
    if a.shape[1] != in_f or b.shape[0] != out_f:
        raise VariantIncompatible(f"adapter module '{module}' maps {a.shape[1]} -> {b.shape[0]}; base '{base}' "
                                  f"has {in_f} -> {out_f} (an adapter of another base?)")
    rank = a.shape[0]
    if rank > max_rank:
        raise VariantIncompatible(f"adapter module '{module}' has rank {rank}; the slot maximum is {max_rank}")
    return {target.removesuffix(".weight"): (a, b, module_scale(cfg, module, rank))}


def adapter_labels(path: Path, head: dict[str, torch.Tensor]) -> list[str] | None:
    """Class names of a classifier adapter: id2label of a config.json beside it, else LABEL_i as transformers."""
    if "weight" not in head:
        return None
    n = head["weight"].shape[0]
    try:
        id2label = json.loads((path / LABELS_CONFIG).read_text()).get("id2label") or {}
    except (OSError, ValueError, AttributeError):
        id2label = {}
    return [str(id2label.get(str(i), f"LABEL_{i}")) for i in range(n)]


class LoraVariant(VariantKind):
    kind = "lora"
    family = "lora"
    help = "a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors)"
    entry_type: type[LoraVariantEntry] = LoraVariantEntry

    def add(self, store: Store, name: str, base: str, path: Path, progress: Progress | None = None,
            slots: SlotsConfig = SlotsConfig()) -> LoraVariantEntry:
        with store.stage() as staged:
            entry = self.stage(store, name, base, Path(path), staged, store.base_shapes(base), slots)
            return store.commit(staged, entry)

    def add_many(self, store: Store, base: str, items: list[tuple[str, Path]], slots: SlotsConfig = SlotsConfig(),
                 progress: Progress | None = None) -> tuple[list[VariantEntry], Failures]:
        """add() for many adapters of one base: the base's shapes are read once, each adapter is validated and
        staged as add() does, and the store commits them all with one manifest write (Store.commit_many)."""
        shapes = store.base_shapes(base)
        with contextlib.ExitStack() as stack:
            def stage_one(name: str, path: Path) -> tuple[Path, VariantEntry]:
                staged = stack.enter_context(store.stage())
                return staged, self.stage(store, name, base, Path(path), staged, shapes, slots)

            ready, failed = stage_each(items, stage_one, progress)
            added, refused = store.commit_many(ready)
        return added, failed + refused

    def stage(self, store: Store, name: str, base: str, path: Path, staged: Path, shapes: dict[str, list[int]],
              slots: SlotsConfig) -> LoraVariantEntry:
        """Validate the adapter at `path` against the base's tensor shapes and copy its files into `staged`;
        -> its entry, whose files the store's commit describes once they are in place."""
        check_name(name)
        modules, head = parse_adapter(path, shapes, base, slots.max_rank)
        for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS, LABELS_CONFIG):
            if (path / f).is_file():
                shutil.copy2(path / f, staged / f)
        if (path / TRANSLORA_DIR).is_dir():  # what a later transfer to another base needs
            shutil.copytree(path / TRANSLORA_DIR, staged / TRANSLORA_DIR,
                            ignore=shutil.ignore_patterns(".*", "*.bin", "*.pt", "*.pth"))
        raw = sum(t.numel() * t.element_size() for a, b, _ in modules.values() for t in (a, b))
        return self.entry_type(name=name, base=base, architecture=store.base(base).architecture,
                               raw_bytes=raw + sum(t.numel() * t.element_size() for t in head.values()),
                               rank=max(a.shape[0] for a, _, _ in modules.values()),
                               target_modules=sorted(modules), labels=adapter_labels(path, head), files=[])

    def verify(self, store: Store, entry: LoraVariantEntry) -> None:
        store.verify(entry)
        parse_adapter(store.variant_dir(entry), store.base_shapes(entry.base), entry.base, max_rank=1 << 30)

    def load(self, store: Store, entry: LoraVariantEntry, base: BaseView, alloc: Alloc) -> LoadedVariant:
        store.verify(entry)
        path = store.variant_dir(entry)
        shapes = {n: list(t.shape) for n, t in base.tensors.items()}
        modules, head = parse_adapter(path, shapes, base.name, max_rank=1 << 30)
        tensors, scales = {}, {}
        for module, (a, b, scale) in modules.items():
            dtype = base.tensors[f"{module}.weight"].dtype
            tensors[f"{module}.A"], tensors[f"{module}.B"] = a.to(dtype), b.to(dtype)
            scales[module] = scale
        return LoadedVariant(entry.name, self.kind, self.family, tensors, scales, head, entry.labels, key=entry.key)

    def extract(self, store: Store, name: str, out_dir: Path) -> Path:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        for p in store.variant_dir(name).iterdir():
            shutil.copy2(p, out_dir / p.name)
        return out_dir


register_variant(LoraVariant())
