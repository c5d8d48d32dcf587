"""The base's leaf modules, wrapped once at load: each computes base(x) for every row of the forward, then
each correction family present in the step's BatchPlan corrects the rows of its slots.

The wrapping is a forward hook on every module that holds parameters (Linear, Embedding, norms, the LM head),
so the base module, its parameter names and transformers' own code stay as they are; a base held in another
form (NeuZip) only changes how base(x) is computed, not this seam. A family may claim rows of a module (it runs
them whole with weights of its own, Slots.claims): a pre-hook then hands the base only the other rows, and the
forward hook puts the base's rows back in place before the families fill theirs.
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
        self._claimed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        """module -> (its full input, [rows] bool: rows a family claimed) while its forward runs."""
        self._handles = [h for name, m in modules.items()
                         for h in (m.register_forward_pre_hook(self._narrow(name)),
                                   m.register_forward_hook(self._hook(name)))]

    @contextmanager
    def planned(self, plan: BatchPlan | None) -> Iterator[None]:
        """Corrections apply, for the forward run inside the block, as `plan` says."""
        self.plan = plan
        try:
            yield
        finally:
            self.plan = None

    def _narrow(self, name: str):
        def narrow(module: torch.nn.Module, args: tuple) -> tuple | None:
            plan = self.plan
            self._claimed.pop(name, None)  # left by a forward of this module that raised
            if plan is None or self._correcting or not args or args[0].dim() < 2 or args[0].shape[0] != plan.rows:
                return None
            x = args[0]
            per_row = x[0].numel() // max(x.shape[-1], 1)  # tokens of one row
            rows = [r for f in plan.slot_ids for r in self.families[f].claims(name, plan, per_row)]
            if not rows:
                return None
            claimed = torch.zeros(plan.rows, dtype=torch.bool, device=x.device)
            claimed[rows] = True
            self._claimed[name] = (x, claimed)
            return (x[~claimed], *args[1:])  # [unclaimed rows, ...]: the base computes only these

        return narrow

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
            if name in self._claimed:  # the base ran the unclaimed rows only: back in place, claimed rows to fill
                x, claimed = self._claimed.pop(name)
                full = output.new_empty((plan.rows, *output.shape[1:]))
                full[~claimed] = output
                output = full
            elif x.shape[0] == 1 and plan.rows > 1:  # broadcast over rows (BERT's position ids): one per row now
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
