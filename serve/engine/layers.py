"""The base's leaf modules, wrapped once at load: each computes base(x) for every row of the forward, then
each correction family present in the step's BatchPlan corrects the rows of its slots.

The wrapping is a forward hook on every module that holds parameters (Linear, Embedding, norms, the LM head),
so the base module, its parameter names and transformers' own code stay as they are; a base held in another
form (NeuZip) only changes how base(x) is computed, not this seam.
"""

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

from serve.engine.batch import BatchPlan
from serve.engine.slots import Slots
from serve.engine.stats import Seconds


def leaf_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Modules that hold parameters themselves, by qualified name: what corrections can target."""
    return {name: m for name, m in model.named_modules() if next(m.parameters(recurse=False), None) is not None}


class SlotLayers:
    """The hooks of one base model, and the plan of the forward running now (set by `planned`)."""

    def __init__(self, modules: Mapping[str, torch.nn.Module], families: Mapping[str, Slots], seconds: Seconds):
        self.families = families
        self.seconds = seconds
        """Time in each family's corrections, by family ("lora", "weights", "emr")."""
        self.plan: BatchPlan | None = None
        self._correcting = False
        self._handles = [m.register_forward_hook(self._hook(name)) for name, m in modules.items()]

    @contextmanager
    def planned(self, plan: BatchPlan | None) -> Iterator[None]:
        """Corrections apply, for the forward run inside the block, as `plan` says."""
        self.plan = plan
        try:
            yield
        finally:
            self.plan = None

    def _hook(self, name: str):
        def correct(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            plan = self.plan
            # A correction may run the module again for a subset of rows (a full variant's tensors): that
            # inner call must come back uncorrected.
            if plan is None or self._correcting or not args:
                return None
            families = [self.families[f] for f in plan.slot_ids if self.families[f].touches(name, plan)]
            if not families:
                return None
            x = args[0]
            if x.shape[0] == 1 and plan.rows > 1:  # broadcast over rows (BERT's position ids): one per row now
                x = x.expand(plan.rows, *x.shape[1:])
                output = output.expand(plan.rows, *output.shape[1:]).clone()
            elif x.shape[0] != plan.rows:
                raise RuntimeError(f"module '{name}' got {x.shape[0]} rows; the plan has {plan.rows}")
            self._correcting = True
            try:
                for family in families:
                    with self.seconds.timing(family.family.partition(":")[0]):
                        output = family.apply(name, module, x, output, plan)
            finally:
                self._correcting = False
            return output

        return correct
