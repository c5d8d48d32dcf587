"""The KV store: one base's running rows' keys and values, allocated once, a slot per row, written in place.

Every layer holds K and V as [slots + 1, kv heads, positions, head dim]. A row takes a free slot when it is
admitted (the lowest first, so a decode step's rows stay near the front), its prefill and every decode step write
its keys and values at its own positions, and the slot goes back when it finishes. No step copies another row's
keys or values: nothing is concatenated, selected or padded. The last slot is scratch: a padding token of a
fixed-shape step writes there.

It is built on transformers' extension points, so the model code stays transformers': `KVStore` is a `Cache`
whose layers write each token of a forward at its (slot, position) and hand the attention the layer's whole
store, and the attention function registered as "manyfold" reads the forward's `StepLayout`:
- decode tokens first, one per slot 0..B-1 (row b is slot b), through kernels.decode_attention over the store
  as it lies (SDPA on CPU, a Triton kernel on CUDA);
- then the prefill chunks (each a prompt's next tokens, cut to the step's token budget), every one causal over
  its own slot's first positions, in one kernels.chunk_attention (a Triton kernel over a table of the chunks on
  CUDA; SDPA a chunk on CPU). Tokens of neither (a fixed-shape step's padding) attend to nothing.
Both kernels read the step's layout from the device, so one launch serves every step of a token bucket.
Other forwards of the same model (encoders, benchmarks with transformers' own caches) run transformers' SDPA.
"""

from dataclasses import dataclass

import torch
from transformers import AttentionInterface, Cache
from transformers.cache_utils import CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kernels import chunk_attention, decode_attention

ATTENTION = "manyfold"
"""The attention implementation name a causal base runs under (registered below)."""


@dataclass
class StepLayout:
    """Where one forward's tokens write and what they read. The first `decode_rows` tokens are decode tokens of
    slots 0..decode_rows - 1 (a padding one writes to the scratch slot and reads nothing); `chunks` follow."""

    write_slots: torch.Tensor
    """[T] int64: the slot each token's key and value are written to."""
    write_positions: torch.Tensor
    """[T] int64: and at which position."""
    lengths: torch.Tensor
    """[decode_rows] int64: keys each decode row attends to, its new one included (0: a padding row)."""
    max_length: int
    """The longest of lengths (a host int: the CPU's attention reads no further)."""
    decode_rows: int
    chunks: torch.Tensor | None = None
    """[C, 4] int64 on the device: each prompt chunk's (first token, length, slot, first position); rows of length 0
    are padding. None: no chunk."""
    chunk_tokens: int = 0
    """At least the longest chunk (a host int: sizes chunk attention's grid, the step's token bucket)."""


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, key/value heads, head dim) of a causal LM's config."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, kv_heads, head_dim


def slot_bytes(config, positions: int, dtype: torch.dtype) -> int:
    """What one slot of `positions` positions costs over every layer (K and V)."""
    layers, kv_heads, head_dim = kv_shape(config)
    return 2 * layers * kv_heads * positions * head_dim * dtype.itemsize


class SlotLayer(CacheLayerMixin):
    """One layer's store; `update` writes this forward's keys and values in place and returns the whole store."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, owner: "KVStore"):
        super().__init__()
        self.keys, self.values, self.owner = keys, values, owner
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("a KV store layer is allocated up front")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        layout = self.owner.layout
        if layout is None:
            raise RuntimeError("the KV store was used outside a step (no StepLayout)")
        # key_states [1, KVH, T, D] -> each token's [KVH, D] at (its slot, its position)
        self.keys[layout.write_slots, :, layout.write_positions] = key_states[0].transpose(0, 1)
        self.values[layout.write_slots, :, layout.write_positions] = value_states[0].transpose(0, 1)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0  # no mask is built: the attention reads the layout

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class KVStore(Cache):
    """Every layer's store for `slots` rows of at most `positions` tokens each."""

    def __init__(self, config, slots: int, positions: int, dtype: torch.dtype, device: torch.device):
        layers, kv_heads, head_dim = kv_shape(config)
        shape = (slots + 1, kv_heads, positions, head_dim)
        # zeros, not empty: a padding row's lanes read no garbage that could be NaN
        super().__init__(layers=[SlotLayer(torch.zeros(shape, dtype=dtype, device=device),
                                           torch.zeros(shape, dtype=dtype, device=device), self)
                                 for _ in range(layers)])
        self.slots = slots
        self.positions = positions
        self.scratch = slots
        """The slot padding tokens write to; no row reads it."""
        self.layout: StepLayout | None = None
        """The forward running now (set by `stepping`)."""
        self._free = list(range(slots))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.keys, layer.values))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def take(self) -> int | None:
        """The lowest free slot (None: every slot is in use; the row waits)."""
        if not self._free:
            return None
        slot = min(self._free)
        self._free.remove(slot)
        return slot

    def give(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.slots:
            raise RuntimeError(f"KV slot {slot} given back twice or never taken")
        self._free.append(slot)

    def save(self, slot: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of the first `length` positions of a slot's keys and values, every layer, in host memory: what a
        parked row keeps while its slot serves another (vLLM's swap-out). A GPU's copies are pinned, so a restore
        is one transfer each."""

        def copy(t: torch.Tensor) -> torch.Tensor:
            part = t[slot, :, :length]
            if not part.is_cuda:
                return part.clone()
            return torch.empty(part.shape, dtype=part.dtype, pin_memory=True).copy_(part)

        return [(copy(layer.keys), copy(layer.values)) for layer in self.layers]

    def restore(self, slot: int, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """What save kept, written into `slot` (any free one) at the same positions."""
        for layer, (k, v) in zip(self.layers, saved):
            layer.keys[slot, :, :k.shape[1]].copy_(k, non_blocking=True)
            layer.values[slot, :, :v.shape[1]].copy_(v, non_blocking=True)

    def stepping(self, layout: StepLayout) -> "KVStore":
        """The cache for a forward laid out as `layout`."""
        self.layout = layout
        return self


def slot_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                   kv_layout: StepLayout | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [1, H, T, D]; key, value: the layer's whole store (SlotLayer.update). -> ([1, T, H, D], None).
    Without a layout (a forward that is not a generation step), transformers' SDPA."""
    if kv_layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = scaling if scaling is not None else query.shape[3] ** -0.5
    return attend(query[0].transpose(0, 1), key, value, kv_layout, scale)[None], None


def attend(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: StepLayout, scale: float
           ) -> torch.Tensor:
    """q [T, H, D], the step's queries as `layout` lays them out; key, value: one layer's whole store. -> [T, H, D]:
    decode rows through kernels.decode_attention, then every prefill chunk through kernels.chunk_attention."""
    rows = layout.decode_rows
    decoded = decode_attention(q[:rows], key, value, layout.lengths, scale, layout.max_length)  # [B, H, D]
    if layout.chunks is None:
        return decoded
    out = torch.zeros_like(q)  # a padding token's attention is zero
    out[:rows] = decoded
    return chunk_attention(q, key, value, layout.chunks, scale, layout.chunk_tokens, out)


AttentionInterface.register(ATTENTION, slot_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # for forwards without a layout; a step builds no mask
