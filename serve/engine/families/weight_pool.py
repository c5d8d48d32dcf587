"""The full fine-tunes' family ("weights"): rows of a variant that changed a module run that module with the
variant's own tensors; every module it left alone is the base's, shared with every row (a top-two-layer
fine-tune costs two layers).

Two forms, one per kind of device:
- shapes that follow the rows (a CPU): a slot refers to the cache's tensors, and a module's tokens of each variant
  that changed it run through it with those (functional_call); the base skips them (claims). Nothing is copied and
  nothing stays warm, since the cache may recycle an idle variant's buffers.
- fixed shapes (CUDA, so that steps replay as graphs): a variant's tensors are copied into a pool of stacks on the
  device (serve/engine/families/stack_pool.py) within slots.weights_mib. The variants that change the same tensors share
  a bucket: a stack per parameter of the modules they touch (the base's value where a variant left one alone), a row
  each. A module runs every token of a bucket in launches that depend only on the shapes, each token reading its
  row from a per-token map: a Linear in one kernels.linear_by_token (the base's output overwritten where the map
  names a row), an Embedding as one gather, a norm that scales by its weight (Llama's RMSNorm) with each token's
  own weight, any other module once per stack row, kept where the map names that row. The base's output is
  computed for every token and overwritten (no claims: those would change the shapes). Idle fine-tunes stay until
  their room is needed, least recently used first.
"""

from math import prod

import torch
from torch.func import functional_call

from kernels import NO_SLOT, linear_by_token
from serve.config import SlotsConfig
from serve.engine.step.batch import BatchPlan
from serve.engine.families.slots import register_family, tensor_owners
from serve.engine.families.stack_pool import MIB, StackPool, Stacks
from serve.variants.base import BaseView, LoadedVariant

BucketKey = tuple[str, ...]
"""The parameters its variants change, by their stack names (sorted)."""


def parameter_names(base: BaseView) -> tuple[dict[tuple[str, str], str], dict[str, list[str]]]:
    """({(module, parameter): the name of its stack}, {stack name: every state_dict name of that parameter}). A
    parameter held by several modules (a tied LM head and embedding) is one stack, named by its first holder."""
    first: dict[int, str] = {}
    of: dict[tuple[str, str], str] = {}
    for mname, module in base.modules.items():
        for local, p in module.named_parameters(recurse=False):
            of[(mname, local)] = first.setdefault(id(p), f"{mname}.{local}")
    aliases: dict[str, list[str]] = {}
    for (mname, local), name in of.items():
        aliases.setdefault(name, []).append(f"{mname}.{local}")
    return of, aliases


class WeightBucket(Stacks):
    """The fine-tunes that change one set of parameters: a stack per parameter of the modules they touch."""

    def __init__(self, key: BucketKey, base: BaseView, names: dict[tuple[str, str], str], aliases: dict[str, list[str]],
                 device: torch.device):
        changed = set(key)
        by_module: dict[str, dict[str, str]] = {}
        for (mname, local), name in names.items():
            by_module.setdefault(mname, {})[local] = name
        self.modules = {m: params for m, params in by_module.items() if changed & set(params.values())}
        """module -> {its parameter: the stack holding it}, for every module with a changed parameter."""
        self.base = base
        self.aliases = aliases
        stacks = sorted({n for params in self.modules.values() for n in params.values()})
        self.layout = {n: (tuple(base.tensors[n].shape), base.tensors[n].dtype) for n in stacks}
        super().__init__(sum(prod(shape) * dtype.itemsize for shape, dtype in self.layout.values()), device)
        self.stacks: dict[str, torch.Tensor] = {}
        """stack name -> [rows, *shape]."""
        self._resize([], 0)

    def _resize_stacks(self, keep: list[int], rows: int) -> None:
        for n, (shape, dtype) in self.layout.items():
            self.stacks[n] = self.resized(self.stacks.get(n), torch.empty((rows, *shape), dtype=dtype,
                                                                          device=self.device), keep)

    def put(self, row: int, slot: int, variant: LoadedVariant) -> None:
        for n, stack in self.stacks.items():
            value = next((variant.tensors[a] for a in self.aliases[n] if a in variant.tensors), None)
            if value is None:  # left alone by the variant: the base's (held coded on a NeuZip base: the stored one)
                value = self.base.tensors[n] if not self.base.tensors[n].is_meta else self.base.host[n]
            stack[row].copy_(value)
        self.owners[row] = slot


class WeightPool(StackPool):
    family = "weights"
    pool_name = "full fine-tune pool"
    graphable = True

    def __init__(self, base: BaseView, device: torch.device, config: SlotsConfig, family: str = "weights"):
        self._fixed = False
        super().__init__(base, device, int(config.weights_mib * MIB), "slots.weights_mib")
        self._names, self._aliases = parameter_names(base)
        self._holders = tensor_owners(base)
        """state_dict name -> every (module, parameter) holding it."""
        self.overrides: list[dict[str, dict[str, torch.Tensor]]] = []
        """Without fixed shapes: slot -> module -> {parameter: the cache's tensor}."""
        self._how: dict[str, str] = {}
        """module -> how fixed shapes run it: "linear", "embedding", "scale" or "each row"."""

    # ---- the form follows the runtime's shapes
    @property
    def fixed_shapes(self) -> bool:
        return self._fixed

    @fixed_shapes.setter
    def fixed_shapes(self, on: bool) -> None:
        """Idle slots are emptied when the form changes: each form writes a slot its own way."""
        if on != self._fixed:
            for slot, refs in enumerate(self.refs):
                if refs == 0 and self.names[slot] is not None:
                    self._empty(slot)
        self._fixed = on

    @property
    def keep_warm(self) -> bool:
        return self._fixed

    def check(self, variant: LoadedVariant) -> None:
        if self._fixed:
            self.check_fits(variant, "full variant")

    def bucket_key(self, variant: LoadedVariant) -> BucketKey:
        return tuple(sorted({self._names[h] for n in variant.tensors for h in self._holders.get(n, ())}))

    def row_bytes(self, key: BucketKey) -> int:
        return self.new_bucket(key).row_bytes

    def new_bucket(self, key: BucketKey) -> WeightBucket:
        return WeightBucket(key, self.base, self._names, self._aliases, self.device)

    def _room(self, variant: LoadedVariant) -> bool:
        return super()._room(variant) if self._fixed else True

    def _write(self, slot: int, variant: LoadedVariant) -> None:
        self.overrides.extend({} for _ in range(slot + 1 - len(self.overrides)))
        if self._fixed:
            super()._write(slot, variant)
            return
        by_module: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in variant.tensors.items():
            for mname, local in self._holders.get(name, ()):
                by_module.setdefault(mname, {})[local] = t
        self.overrides[slot] = by_module

    def _clear(self, slot: int) -> None:
        if slot < len(self.overrides):
            self.overrides[slot] = {}
        super()._clear(slot)

    # ---- forwards: with fixed shapes StackPool's (every bucket a forward); without, the cache's tensors
    def touches(self, name: str, plan: BatchPlan) -> bool:
        if self._fixed:
            return super().touches(name, plan)
        return any(name in self.overrides[slot] for slot in plan.slot_set(self.family))

    def claims(self, name: str, plan: BatchPlan, num_tokens: int) -> list[int]:
        if self._fixed:
            return []
        return [t for t, slot in enumerate(plan.token_slots(self.family, num_tokens))
                if slot != NO_SLOT and name in self.overrides[slot]]

    def apply(self, name: str, module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
              plan: BatchPlan) -> torch.Tensor:
        if not self._fixed:
            for slot, tokens in plan.groups(self.family, y.shape[0]):
                params = self.overrides[slot].get(name)
                if params:
                    y[tokens] = functional_call(module, params, (x[tokens],))  # [n, out] with the variant's tensors
            return y
        for key, bucket in self._keys(plan):
            params = bucket.modules.get(name)
            if params is not None:
                y = self._run(name, module, bucket, params, x, y, self.rows(plan, key, y.shape[0]))
        return y

    def _run(self, name: str, module: torch.nn.Module, bucket: WeightBucket, params: dict[str, str],
             x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """y [N, out] with every token whose map names a row run through the module with that row's parameters."""
        how = self._how.get(name) or self._how.setdefault(name, run_as(module))
        stacks = {local: bucket.stacks[n] for local, n in params.items()}
        live = (rows >= 0)[:, None]  # [N, 1]
        if how == "linear":
            return linear_by_token(x.contiguous(), stacks["weight"], stacks.get("bias"), rows, y)
        at = rows.clamp(min=0).long()  # [N] a valid row for every token; `live` says whose is real
        if how == "embedding":
            return torch.where(live, stacks["weight"][at, x], y)  # x: [N] token ids
        if how == "scale":
            normed = functional_call(module, {"weight": torch.ones_like(stacks["weight"][0])}, (x,))  # [N, out]
            return torch.where(live, stacks["weight"][at] * normed, y)
        for r in range(len(bucket.owners)):  # any other module: once per stack row
            out = functional_call(module, {local: s[r] for local, s in stacks.items()}, (x,))
            y = torch.where((rows == r)[:, None], out, y)
        return y


def run_as(module: torch.nn.Module) -> str:
    """How fixed shapes run a module's tokens of a bucket (WeightPool._run)."""
    params = dict(module.named_parameters(recurse=False))
    if type(module) is torch.nn.Linear:
        return "linear"
    if type(module) is torch.nn.Embedding and module.max_norm is None:
        return "embedding"
    w = params.get("weight")
    if set(params) == {"weight"} and w.dim() == 1 and not w.is_meta:
        probe = torch.randn(3, w.shape[0], device=w.device).to(w.dtype)
        with torch.no_grad():
            normed = functional_call(module, {"weight": torch.ones_like(w)}, (probe,))
            if torch.equal(module(probe), w * normed):  # out = weight * f(x), as Llama's RMSNorm
                return "scale"
    return "each row"


register_family(WeightPool)
