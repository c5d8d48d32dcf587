"""EMR-Merging's correction family, "emr:<group>": the tasks of one EMR group sit in slots of their own (see
serve/engine/families/slots.py for what a family is, serve/codecs/emr.py for the maths)."""

from collections import OrderedDict
from collections.abc import Callable

import torch
from torch.func import functional_call

from kernels import NO_SLOT, emr_delta, masked, unpack_bits
from serve.config import SlotsConfig
from serve.codecs.emr import reconstruct
from serve.engine.step.batch import BatchPlan
from serve.engine.families.slots import Slots, register_family, tensor_owners
from serve.engine.families.token_maps import TokenMaps
from serve.errors import VariantIncompatible
from serve.variants.base import MASKS_SUFFIX, BaseView, LoadedVariant


DENSE_MIN_TOKENS: dict[str, int | None] = {"cpu": 1}
"""Per device type, the tokens of one task in a forward from which its Linear weights are formed (W_t_hat, one
module at a time, held between forwards in FormedWeights) and its rows run through them instead of the base plus
the masked delta; None: never. Chosen by measurement (MiniLM's three Linear shapes, fp32, 2-core AMD EPYC shared with
other work, median of 7): base matmul + masked delta against forming + one matmul, in ms, for 1 / 16 / 256 tokens of a
task: 384x384 0.32/0.33/0.93 against 0.16/0.24/0.49; 1536x384 0.51/0.65/6.35 against 0.27/0.45/2.01; 384x1536
0.33/0.63/3.49 against 0.25/0.44/1.86. On CPU the masked delta unpacks the mask (the same pass over the
weights as forming) and then adds a matmul as large as the base's, so forming wins from one token: K = 1. CUDA
keeps the masked delta (its Triton kernel unpacks in registers and reads tau_uni once for every task of a tile;
not measured here), and so does any engine with fixed shapes: a task's formed weights would change a step's
launches with the tasks its rows run."""


FormedKey = tuple[int, str, str]
"""(task slot, module, parameter)."""


class FormedWeights:
    """Tasks' formed Linear weights kept between forwards within a byte budget (slots.emr_formed_mib): a decode
    batch, or one classify batch after another, runs the same hot tasks forward after forward, and forming is a
    pass over the module's weights. When the budget is full, the weights of tasks that have no row in this
    forward leave first (least recently used first); if every holder runs now, the new one is used and dropped,
    so tasks that take turns never push each other out on every forward."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.nbytes = 0
        self.formed = 0
        """Weights formed so far (held or not): what a held weight saves."""
        self._held: OrderedDict[FormedKey, torch.Tensor] = OrderedDict()

    def get(self, key: FormedKey, running: frozenset[int], form: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The held weight for key, or form() (held if the budget allows; `running`: slots with rows now)."""
        held = self._held.get(key)
        if held is not None:
            self._held.move_to_end(key)
            return held
        w = form()
        self.formed += 1
        size = w.numel() * w.element_size()
        for victim in [k for k in self._held if k[0] not in running]:
            if self.nbytes + size <= self.budget:
                break
            gone = self._held.pop(victim)
            self.nbytes -= gone.numel() * gone.element_size()
        if self.nbytes + size <= self.budget:
            self._held[key] = w
            self.nbytes += size
        return w

    def clear(self) -> None:
        self._held.clear()
        self.nbytes = 0


@register_family
class EmrSlots(Slots):
    """Family "emr:<group>": the tasks of one EMR group, slot = the task's index in its bundle. Rows of task t add
    lambda_t x (M_t * tau_uni)^T in every module the group merged (serve/codecs/emr.py), each token naming its
    task in a per-token map (serve/engine/families/token_maps.py):
    - Linear modules, for a task with at least DENSE_MIN_TOKENS tokens in the forward (see there; never with fixed
      shapes): the task's weights W_t_hat = W + lambda_t M_t * tau_uni formed for the module and its rows run
      through them whole (claims: the base skips them); every other token of a task, kernels.emr_delta in one
      launch for all the group's tasks (masks read packed), and a bias's delta gathered per token;
    - Embedding weights per token: tau_uni's rows for the token ids, under the token's task's mask rows;
    - every other merged tensor (norms, biases elsewhere) is small: each task's W_t_hat is formed for the forward
      and the module run with it, kept for the tokens of that task.
    With fixed shapes every launch depends only on the shapes and on the group's tensors, which stay where the
    cache holds them while rows use the group: `version` names those addresses, so a graph captured for the group
    replays for any mix of its tasks. The slots hold references to one loaded group (the cache's); a group
    replaced in the store waits until the rows of the old one have left."""

    family = "emr"
    per_entry = True
    graphable = True

    def __init__(self, base: BaseView, device: torch.device, config: SlotsConfig, family: str = "emr"):
        super().__init__(base, device)
        self.family = family
        self._owners = tensor_owners(base)
        self.group: LoadedVariant | None = None
        self.refs: dict[int, int] = {}
        self.merged: dict[str, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
        """module -> [(parameter, tau_uni [shape], masks uint8 [tasks, *shape[:-1], ceil(shape[-1] / 8)])]."""
        self.scale: torch.Tensor | None = None
        """[tasks] fp32 on the device: each task's lambda (kept while the group stays the same tensors)."""
        self.lambdas: list[float] = []
        """The same on the host (forming a norm's weights reads them; a device read would wait on the GPU)."""
        self._identity: tuple = ()
        """The addresses and shapes of the group's tensors last used: the same group at the same addresses."""
        self.maps = TokenMaps(device)
        """Each token's task ("tasks"), for the step."""
        self.formed = FormedWeights(int(config.emr_formed_mib * (1 << 20)))
        """They outlive the group's rows (the next batch uses them), and a load of the group after an eviction:
        the family is one revision of the group (its key), so the weights they are formed from are the same."""

    @property
    def nbytes(self) -> int:
        return self.formed.nbytes

    def check(self, variant: LoadedVariant) -> None:
        for name in variant.tensors:
            if name.endswith(MASKS_SUFFIX):
                continue
            if not self._owners.get(name):
                raise VariantIncompatible(f"EMR group '{variant.name}': tensor '{name}' is held by no module of "
                                          f"base '{self.base.name}'")

    @property
    def in_use(self) -> int:
        return sum(self.refs.values())

    def attach(self, variant: LoadedVariant) -> int | None:
        group = variant.parent
        if group is not self.group:
            if any(self.refs.values()):
                return None  # rows of the group's previous bundle still run
            self._use(group)
        self.refs[variant.index] = self.refs.get(variant.index, 0) + 1
        return variant.index

    def detach(self, slot: int) -> None:
        self.refs[slot] -= 1
        if not any(self.refs.values()):
            self._use(None)  # no reference outlives the rows: the cache may free the group

    def retire(self, key: str) -> None:
        """Nothing to free slot by slot: the family is one revision of one group, and goes whole (BaseModelRuntime
        .retire)."""

    @property
    def version(self) -> tuple:
        """Changes when the tensors a captured step reads move: another load of the group, or a map buffer."""
        return hash(self._identity), self.maps.version

    def _use(self, group: LoadedVariant | None) -> None:
        self.group, self.refs, self.merged = group, {}, {}
        if group is None:
            return  # the scale stays: the same group coming back keeps its address
        for name, tau in group.tensors.items():
            if name.endswith(MASKS_SUFFIX):
                continue
            masks = group.tensors[name + MASKS_SUFFIX]
            for module, local in self._owners[name]:
                self.merged.setdefault(module, []).append((local, tau, masks))
        identity = tuple((n, t.data_ptr(), tuple(t.shape)) for n, t in group.tensors.items())
        if identity != self._identity or self.scale is None:
            self.lambdas = [m.scales["rescaler"] for m in sorted(group.members.values(), key=lambda m: m.index)]
            self.scale = torch.tensor(self.lambdas, dtype=torch.float32, device=self.device)
            self._identity = identity

    def prepare(self, plan: BatchPlan) -> None:
        if self.fixed_shapes:
            self.maps.prepare(plan, {"tasks": lambda n: plan.token_slots(self.family, n)})

    def _tasks(self, plan: BatchPlan, n: int) -> torch.Tensor:
        """[n] int32 on the device: each of a module's n tokens' task (-1: none)."""
        return self.maps.get(plan, "tasks", n, lambda n: plan.token_slots(self.family, n))

    def touches(self, name: str, plan: BatchPlan) -> bool:
        return name in self.merged

    def claims(self, name: str, plan: BatchPlan, num_tokens: int) -> list[int]:
        return [t for _, tokens in self._dense_groups(name, plan, num_tokens) for t in tokens.tolist()]

    def _dense_groups(self, name: str, plan: BatchPlan, num_tokens: int) -> list[tuple[int, torch.Tensor]]:
        """(slot, tokens) of the tasks whose tokens run module `name` with their own formed weights
        (DENSE_MIN_TOKENS)."""
        k = None if self.fixed_shapes else DENSE_MIN_TOKENS.get(self.device.type)
        if k is None or name not in self.merged or not isinstance(self.base.modules.get(name), torch.nn.Linear):
            return []
        return [(slot, tokens) for slot, tokens in plan.groups(self.family, num_tokens) if tokens.numel() >= k]

    def apply(self, name: str, module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
              plan: BatchPlan) -> torch.Tensor:
        merged = self.merged[name]
        if isinstance(module, torch.nn.Linear):
            return self._linear(name, module, merged, x, y, plan)
        tasks = self._tasks(plan, y.shape[0])
        if isinstance(module, torch.nn.Embedding):
            return self._embedding(merged, x, y, tasks)
        # norms and the like: small, each task's formed for the forward (with fixed shapes every task of the group)
        for slot in range(len(self.lambdas)) if self.fixed_shapes else sorted(plan.slot_set(self.family)):
            params = {local: reconstruct(getattr(module, local), tau, _unpacked(masks[slot], tau), self.lambdas[slot])
                      for local, tau, masks in merged}
            y = torch.where((tasks == slot)[:, None], functional_call(module, params, (x,)), y)
        return y

    def _formed(self, w: torch.Tensor, tau: torch.Tensor, packed: torch.Tensor, slot: int) -> torch.Tensor:
        """W_t_hat = W + lambda_t (M_t * tau_uni), summed in fp32, in W's dtype: reconstruct's value (what `emr
        extract` writes), with the mask unpacked through kernels.masked's table (several times faster)."""
        delta = masked(packed, tau).float().mul_(self.lambdas[slot])  # [*tau.shape]
        return delta.add_(w.float()).to(w.dtype)

    def _linear(self, name: str, module: torch.nn.Linear, merged, x: torch.Tensor, y: torch.Tensor,
                plan: BatchPlan) -> torch.Tensor:
        """x [N, in], y [N, out]: the module's tokens."""
        dense = self._dense_groups(name, plan, y.shape[0])
        running = frozenset(plan.slot_set(self.family))
        for slot, tokens in dense:  # the tokens the base skipped (claims): y[tokens] is still to be written
            params = {local: self.formed.get((slot, name, local), running,
                                             lambda w=getattr(module, local), tau=tau, m=masks[slot], s=slot:
                                             self._formed(w, tau, m, s))
                      for local, tau, masks in merged}
            y[tokens] = torch.nn.functional.linear(x[tokens], params.get("weight", module.weight),
                                                   params.get("bias", module.bias))  # [n, out]
        if len(dense) == len(plan.slot_set(self.family)):
            return y
        if dense:  # the other tasks' tokens only
            formed = frozenset(slot for slot, _ in dense)
            tasks = self.maps.get(plan, ("masked", formed), y.shape[0], lambda n: [
                NO_SLOT if s in formed else s for s in plan.token_slots(self.family, n)])
        else:
            tasks = self._tasks(plan, y.shape[0])
        x2 = x.contiguous()  # a pooler reads a strided first token
        for local, tau, masks in merged:
            if local == "weight":
                emr_delta(x2, tau, masks, self.scale, tasks, y)
            else:  # the bias: one [out] delta per task, each token's gathered
                delta = (masked(masks, tau) * self.scale[:, None])[tasks.clamp(min=0).long()]  # [N, out]
                y.copy_(torch.where((tasks >= 0)[:, None], (y.float() + delta).to(y.dtype), y))
        return y

    def _embedding(self, merged, ids: torch.Tensor, y: torch.Tensor, tasks: torch.Tensor) -> torch.Tensor:
        """ids [N], y [N, dim], tasks [N]."""
        (_, tau, masks), = merged
        at = tasks.clamp(min=0).long()
        delta = masked(masks[at, ids], tau[ids]) * self.scale[at, None]  # [N, dim]
        return torch.where((tasks >= 0)[:, None], y + delta.to(y.dtype), y)


def _unpacked(masks: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """One task's packed mask -> bool of tau's shape."""
    return unpack_bits(masks, tau.shape[-1] if tau.dim() else 1).reshape(tau.shape)
