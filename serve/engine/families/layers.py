"""The base's leaf modules, wrapped once at load: each wrapper computes base(x) for every token of the forward, then
each correction family present in the step's BatchPlan corrects the tokens of its slots.

Every module that holds parameters (Linear, Embedding, norms, the LM head) is replaced in its parent by a
SlotModule holding it (as vLLM's BaseLinearLayerWithLoRA and PEFT's LoraLayer wrap theirs), so transformers' own
code runs unchanged and a forward whose rows are all the base's costs one attribute check a module: no hooks, no
family consulted. Families see the module's tokens flattened (x [N, ...], y [N, out]) and the base module
itself (the wrapped one: a full variant runs it through functional_call with its own tensors). A family may
claim tokens of a module (it computes them whole with weights of its own, Slots.claims): the base then runs only
the other tokens. A base held in NeuZip form has its coded weight decoded around the whole call, corrections
included (serve/engine/neuzip/coded.py: CodedWeights).
"""

from collections.abc import Callable, Iterator, Mapping
import time
from contextlib import contextmanager

import torch

from kernels import rms_norm
from kernels.rms_norm import rms_norm_torch
from serve.engine.step.batch import BatchPlan
from serve.engine.families.slots import Slots
from serve.engine.stats import Seconds


def leaf_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Modules that hold parameters themselves, by qualified name: what corrections can target."""
    return {name: m for name, m in model.named_modules() if next(m.parameters(recurse=False), None) is not None}


class Corrections:
    """What every wrapper of one base reads: its families, the plan of the forward running now (set by
    `planned`), and the coded weights of a NeuZip base."""

    def __init__(self, families: Mapping[str, Slots], seconds: Seconds, coded=None):
        self.families = families
        self.seconds = seconds
        """Time in each family's corrections, by family ("lora", "weights", "emr")."""
        self.plan: BatchPlan | None = None
        self.coded = coded
        """serve/engine/neuzip/coded.py CodedWeights, or None."""

    @contextmanager
    def planned(self, plan: BatchPlan | None) -> Iterator[None]:
        """Corrections apply, for the forward run inside the block, as `plan` says."""
        self.plan = plan
        try:
            yield
        finally:
            self.plan = None


class SlotModule(torch.nn.Module):
    """One base module and the corrections its tokens get."""

    def __init__(self, name: str, base: torch.nn.Module, corrections: Corrections):
        super().__init__()
        self.base = base
        self.name = name
        self.corrections = corrections
        self.fused = fused_norm(base)
        """On CUDA, a Llama-style RMSNorm's forward as one kernel (its base rows' path); None otherwise."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        c = self.corrections
        if c.coded is None or not c.coded.is_coded(self.name):
            return self._forward(x, args, kwargs)
        c.coded.install(self.name, self.base)
        try:
            return self._forward(x, args, kwargs)
        finally:
            c.coded.restore(self.name, self.base)

    def _forward(self, x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        plan = self.corrections.plan
        families = [] if plan is None else [f for f in (self.corrections.families[n] for n in plan.families)
                                            if f.touches(self.name, plan)]
        if families:
            return self._corrected(families, plan, x, args, kwargs)
        return self.fused(x) if self.fused is not None else self.base(x, *args, **kwargs)

    def _corrected(self, families: list[Slots], plan: BatchPlan, x: torch.Tensor, args: tuple, kwargs: dict
                   ) -> torch.Tensor:
        # Rows of equal length whose input is broadcast over them (BERT's position ids): one per row now.
        broadcast = plan.tokens is None and x.dim() >= 1 and x.shape[0] == 1 and plan.rows > 1
        if broadcast:
            x = x.expand(plan.rows, *x.shape[1:])
        per_token = torch.is_floating_point(x)  # features per token; an embedding reads token ids
        tokens = x.numel() // x.shape[-1] if per_token else x.numel()
        x2 = x.reshape(tokens, x.shape[-1]) if per_token else x.reshape(tokens)  # [N, in] or [N] (token ids)
        claimed = self._claimed(families, plan, tokens, x)
        if claimed is None:
            y = self.base(x, *args, **kwargs)
            y = y.clone() if broadcast else y
        else:  # the base computes only the tokens no family claimed; the claimed ones are the families' to fill
            base_out = self.base(x2[~claimed], *args, **kwargs)
            y = base_out.new_empty((tokens, base_out.shape[-1]))
            y[~claimed] = base_out
        shape = (*(x.shape[:-1] if per_token else x.shape), y.shape[-1])
        y2 = y.reshape(tokens, y.shape[-1])
        seconds = self.corrections.seconds
        for family in families:
            t0 = time.perf_counter()
            y2 = family.apply(self.name, self.base, x2, y2, plan)
            seconds.add(family.family.partition(":")[0], time.perf_counter() - t0)
        return y2.view(shape)

    def _claimed(self, families: list[Slots], plan: BatchPlan, tokens: int, x: torch.Tensor) -> torch.Tensor | None:
        """[N] bool: the tokens a family computes whole, or None when no family claims any."""
        idx = [t for f in families for t in f.claims(self.name, plan, tokens)]
        if not idx:
            return None
        claimed = torch.zeros(tokens, dtype=torch.bool, device=x.device)
        claimed[idx] = True
        return claimed


def fused_norm(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """kernels.rms_norm for a CUDA module that computes exactly its twin (transformers' Llama-style RMSNorm:
    checked on a probe input, so a norm of another formula keeps its own forward); None for anything else."""
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_cuda or weight.dim() != 1 or not isinstance(eps, float):
        return None
    probe = torch.randn(3, weight.shape[0], device=weight.device).to(weight.dtype)
    with torch.no_grad():
        if not torch.equal(module(probe), rms_norm_torch(probe, weight, eps)):
            return None
    return lambda x: rms_norm(x, module.weight, eps)


def wrap_modules(model: torch.nn.Module, modules: Mapping[str, torch.nn.Module], corrections: Corrections
                 ) -> dict[str, SlotModule]:
    """Replace each named module in its parent by a SlotModule holding it; -> the wrappers by name."""
    wrappers = {}
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        wrappers[name] = SlotModule(name, module, corrections)
        setattr(model.get_submodule(parent) if parent else model, child, wrappers[name])
    return wrappers
