"""Where a Trans-LoRA student starts: from the source adapter where it fits the target (the same tokenizer and
depth, every adapted module's shape), from the source adapter projected onto the target where only the depth or
the MLPs' width differ and the projection's validation loss is lower than the target alone's, else from a fresh
adapter: chosen per target by what the projection measures, not by how the target was built. The report says
which (TransferReport.started_from).

The projection: each source layer is matched with a target layer, in order (a layer inserted, or several,
between them), by how alike their weights are: the sum over the layer's linear modules of the cosine similarity
of the two weight matrices, maximised over every order-keeping match (dynamic programming). A base grown from the
source by inserting layers keeps its old layers' weights, or moves them little by training, so the match finds
where each went; the adapter's tensors are then renamed to their layers' new numbers. Target layers matched by no
source layer get no adapter. Onto wider modules (an MLP of more neurons), each adapted module's A gets zero
columns for the new inputs and B zero rows for the new outputs: the new neurons' share of the change is zero,
what the adapter changed of the old ones is kept.
"""

import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from serve.adapters.data import PromptExample
from serve.adapters.distill import same_tokens
from serve.adapters.load import load_lm
from serve.adapters.transfer_guard import MIN_GAIN, other_depth, unfit_reason
from serve.adapters.validation import completion_loss
from serve.store.tensors import SafetensorsSource
from serve.variants.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS

LAYER = re.compile(r"\.layers\.(\d+)\.")
FROM_SOURCE = "the source adapter"
"""TransferReport.started_from where the student started from the source adapter (a plain LoRA of its rank)."""


@contextmanager
def student_start(source_base: str | Path, adapter_dir: str | Path, target_base: str | Path, init: str, rank: int,
                  from_source: bool, held: list[PromptExample]) -> Iterator[tuple[Path | None, int, str]]:
    """(the adapter the student starts from, or None for a fresh `init`; its rank: the start's, else `rank`;
    what the report says of it), for the duration of the block (a projection lives in a temporary folder)."""
    stored = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text())["r"]
    unfit = unfit_reason(source_base, adapter_dir, target_base) if from_source else None
    if not from_source:
        yield None, rank, init
    elif unfit is None:
        yield Path(adapter_dir), stored, FROM_SOURCE
    else:
        with tempfile.TemporaryDirectory() as scratch:
            projected = _projection(source_base, adapter_dir, target_base, held, Path(scratch) / "projected")
            if projected is not None:
                yield projected[0], stored, f"the source adapter projected onto the target ({projected[1]})"
            else:
                yield None, rank, f"{init} (the source adapter does not fit the target: {unfit})"


def _projection(source_base: str | Path, adapter_dir: str | Path, target_base: str | Path,
                held: list[PromptExample], out: Path) -> tuple[Path, str] | None:
    """The source adapter projected onto the target, where only the depth or the MLPs' width keep it from fitting
    and the projection's validation loss is lower than the target alone's; with what it moved."""
    if same_tokens(source_base, target_base) is not None:
        return None
    projected, done = Path(adapter_dir), []
    if other_depth(source_base, target_base) is not None:
        mapping = layer_map(source_base, target_base)
        projected = project_adapter(projected, mapping, out / "layers")
        done.append(f"{sum(i != j for i, j in mapping.items())} layers moved")
    wider = project_width(projected, source_base, target_base, out / "width")
    if wider is not None:
        projected = wider[0]
        done.append(f"{wider[1]} modules widened")
    if not done or unfit_reason(source_base, projected, target_base, depth=False) is not None:
        return None
    target, tok = load_lm(target_base)  # a start needs a lower validation loss only: the guard judges the student
    alone = completion_loss(target, tok, held)
    if not completion_loss(load_lm(target_base, projected)[0], tok, held) < alone - MIN_GAIN:
        return None
    return projected, ", ".join(done)


def _layers(base: SafetensorsSource) -> dict[int, dict[str, str]]:
    """{layer: {module suffix: tensor name}} of the base's 2-d ".weight" tensors inside numbered layers."""
    out: dict[int, dict[str, str]] = {}
    for name, shape in base.shapes().items():
        m = LAYER.search(name)
        if m and len(shape) == 2 and name.endswith(".weight"):
            out.setdefault(int(m.group(1)), {})[name[m.end():]] = name
    return out


def layer_map(source_base: str | Path, target_base: str | Path) -> dict[int, int]:
    """{source layer: target layer}, order kept, maximising the summed weight similarity (module docstring)."""
    a, b = _unit_weights(source_base), _unit_weights(target_base)
    ls, lt = sorted(a), sorted(b)
    if len(ls) > len(lt):
        raise ValueError(f"the target has fewer layers ({len(lt)}) than the source ({len(ls)})")
    sim = torch.zeros(len(ls), len(lt))
    for i, si in enumerate(ls):
        for j, tj in enumerate(lt):
            sim[i, j] = sum(float(a[si][k] @ b[tj][k]) for k in a[si].keys() & b[tj].keys()
                            if a[si][k].shape == b[tj][k].shape)
    return {ls[i]: lt[j] for i, j in _aligned(sim)}


def _unit_weights(base_dir: str | Path) -> dict[int, dict[str, torch.Tensor]]:
    """{layer: {module suffix: its weight flattened to unit length}} (a dot product is then their cosine)."""
    base = SafetensorsSource(base_dir)
    return {layer: {k: (w := base[name].float().flatten()) / w.norm().clamp_min(1e-12) for k, name in mods.items()}
            for layer, mods in _layers(base).items()}


def _aligned(sim: torch.Tensor) -> list[tuple[int, int]]:
    """The order-keeping pairs (i, j), every row matched, that maximise the summed sim[i, j]."""
    n, m = sim.shape
    best = torch.full((n + 1, m + 1), float("-inf"))
    best[0, :] = 0.0
    for i in range(1, n + 1):
        for j in range(i, m + 1):  # row i-1 matched with column j-1, or column j-1 left unmatched
            best[i, j] = max(best[i - 1, j - 1] + sim[i - 1, j - 1], best[i, j - 1])
    pairs, j = [], m
    for i in range(n, 0, -1):
        while best[i, j] == best[i, j - 1] and j > i:
            j -= 1
        pairs.append((i - 1, j - 1))
        j -= 1
    return pairs[::-1]


def project_adapter(adapter_dir: str | Path, mapping: dict[int, int], out_dir: str | Path) -> Path:
    """The adapter at adapter_dir with each tensor of source layer i renamed to layer mapping[i], in out_dir (a
    new directory, the adapter's config beside it)."""
    out = Path(out_dir)
    out.mkdir(parents=True)
    tensors = load_file(Path(adapter_dir) / ADAPTER_WEIGHTS)
    moved = {LAYER.sub(lambda m: f".layers.{mapping[int(m.group(1))]}.", name, count=1): t
             for name, t in tensors.items()}
    save_file(moved, out / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    shutil.copy2(Path(adapter_dir) / ADAPTER_CONFIG, out / ADAPTER_CONFIG)
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    if isinstance(config.get("layers_to_transform"), list):
        config["layers_to_transform"] = [mapping[i] for i in config["layers_to_transform"]]
        (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def lora_module(tensor: str) -> tuple[str, str]:
    """(the base module a PEFT adapter tensor adapts, its part): "base_model.model.model.layers.0.mlp.up_proj.
    lora_A.weight" -> ("model.layers.0.mlp.up_proj", "A.weight")."""
    module, part = re.sub(r"^base_model\.model\.", "", tensor).rsplit(".lora_", 1)
    return module, part


def project_width(adapter_dir: str | Path, source_base: str | Path, target_base: str | Path, out_dir: str | Path
                  ) -> tuple[Path, int] | None:
    """The adapter with zero columns of A and zero rows of B along the MLPs' intermediate axis, where the target's
    MLPs are wider than the source's and nothing else differs in width (the same hidden size), in out_dir (a new
    directory, the adapter's config beside it); with how many modules it widened. None where that is not so, or
    where no adapted module is an MLP's."""
    from transformers import AutoConfig

    src, tgt = (AutoConfig.from_pretrained(b).get_text_config() for b in (source_base, target_base))
    inner, wider = getattr(src, "intermediate_size", None), getattr(tgt, "intermediate_size", None)
    if src.hidden_size != tgt.hidden_size or inner is None or wider is None or wider <= inner:
        return None
    shapes = SafetensorsSource(target_base).shapes()
    tensors = load_file(Path(adapter_dir) / ADAPTER_WEIGHTS)
    padded, widened = {}, set()
    for name, t in tensors.items():
        module, part = lora_module(name)
        want = shapes.get(f"{module}.weight")
        if want is None or part not in ("A.weight", "B.weight"):
            return None
        axis = 1 if part == "A.weight" else 0  # A [r, in]: its inputs; B [out, r]: its outputs
        if t.shape[axis] == inner and want[axis] == wider:
            t = torch.cat([t, t.new_zeros((t.shape[0], wider - inner) if axis else (wider - inner, t.shape[1]))],
                          dim=axis)
            widened.add(module)
        padded[name] = t
    if not widened:
        return None
    out = Path(out_dir)
    out.mkdir(parents=True)
    save_file(padded, out / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    shutil.copy2(Path(adapter_dir) / ADAPTER_CONFIG, out / ADAPTER_CONFIG)
    return out, len(widened)
