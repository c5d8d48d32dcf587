"""The KV cache: one base's running rows' keys and values in fixed-size blocks, allocated once, written in place.

Every layer holds K and V as [blocks + 1, block tokens, kv heads, head dim] (vLLM's paged KV cache). A running row
holds a lane (its row of the block tables, at most `lanes` at once) and the blocks its positions fill, taken as
its length grows (`grow`) and given back when it ends: a row asking for 300 tokens holds 19 blocks of 16, not a
slot of max_model_len. Position p of a row lies in block tables[lane, p // block_tokens] at offset
p % block_tokens. The last block is scratch: a padding token of a fixed-shape step writes there, through the
scratch lane whose table points only at it. A cache of one block of max_model_len positions a row is the slot
store this engine had before (`batch.kv_block_tokens` = max_model_len).

It is built on transformers' extension points, so the model code stays transformers': `KVStore` is a `Cache`
whose layers write each token of a forward at its (block, offset) and hand the attention the layer's whole cache,
and the attention function registered as "manyfold" reads the forward's `StepLayout`:
- decode tokens first, one per lane 0..B-1 (row b is lane b), through kernels.decode_attention over the blocks
  as they lie (a Triton kernel reading the tables on CUDA; on a CPU a numba loop for fp32, SDPA over the gathered
  blocks for bf16);
- then the prefill chunks (each a prompt's next tokens, cut to the step's token budget), every one causal over
  its own lane's first positions, in one kernels.chunk_attention (a Triton kernel over a table of the chunks on
  CUDA; SDPA a chunk on CPU). Tokens of neither (a fixed-shape step's padding) attend to nothing.
Both kernels read the step's layout and the block tables from the device, so one launch serves every step of a
token bucket, and the tables are one device tensor of a fixed width (max_model_len / block_tokens) whose rows the
host rewrites between steps (`sync`). Other forwards of the same model (encoders, benchmarks with transformers' own
caches) run transformers' SDPA.
"""

import os
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, Cache
from transformers.cache_utils import CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kernels import chunk_attention, decode_attention
from kernels.decode_attention import gather_blocks
from serve.engine.kv.blocks import BlockPool
from serve.engine.step.invariant import BatchInvariant

ATTENTION = "manyfold"
"""The attention implementation name a causal base runs under (registered below)."""


@dataclass
class StepLayout:
    """Where one forward's tokens write and what they read. The first `decode_rows` tokens are decode tokens of
    lanes 0..decode_rows - 1 (a padding one writes through the scratch lane and reads nothing); `chunks` follow."""

    write_lanes: torch.Tensor
    """[T] int64: the lane (block table row) each token's key and value are written through."""
    write_positions: torch.Tensor
    """[T] int64: and at which position of it."""
    lengths: torch.Tensor
    """[decode_rows] int64: keys each decode row attends to, its new one included (0: a padding row)."""
    max_length: int
    """The longest of lengths (a host int: the CPU's attention reads no further)."""
    decode_rows: int
    chunks: torch.Tensor | None = None
    """[C, 4] int64 on the device: each prompt chunk's (first token, length, lane, first position); rows of length 0
    are padding. None: no chunk."""
    chunk_tokens: int = 0
    """At least the longest chunk (a host int: sizes chunk attention's grid, the step's token bucket)."""
    block_tables: torch.Tensor | None = None
    """[lanes + 1, W] int64 on the device, the cache's (set by KVStore.stepping)."""
    write_blocks: torch.Tensor | None = None
    """[T]: each token's block, looked up in the tables inside the forward (so a replayed graph looks it up again
    for positions a step moved on the device); set by KVStore.stepping."""
    write_offsets: torch.Tensor | None = None
    """[T]: its place in the block."""
    invariant: "BatchInvariant | None" = None
    """engine.batch_invariant's mode, entered around this forward: attention then runs query by query
    (serve/engine/step/invariant.py)."""


@dataclass
class KVUsage:
    """What a base's generation steps held, summed over its steps (a benchmark reads one run's from a fresh one)."""

    steps: int = 0
    rows: int = 0
    """Rows in the batch (running and writing their prompts), summed over steps."""
    most_rows: int = 0
    live: int = 0
    """Positions holding a row's keys and values, summed over steps."""
    held: int = 0
    """Positions of the blocks the rows held, summed over steps: live / held is the share of the cache in use that
    holds tokens (the rest: each row's last block's unwritten tail, or a slot's)."""

    def observe(self, rows: int, live: int, held: int) -> None:
        self.steps += 1
        self.rows += rows
        self.most_rows = max(self.most_rows, rows)
        self.live += live
        self.held += held


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, key/value heads, head dim) of a causal LM's config."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, kv_heads, head_dim


def token_bytes(config, dtype: torch.dtype) -> int:
    """What one position costs over every layer (K and V)."""
    layers, kv_heads, head_dim = kv_shape(config)
    return 2 * layers * kv_heads * head_dim * dtype.itemsize


class BlockLayer(CacheLayerMixin):
    """One layer's cache; `update` writes this forward's keys and values in place and returns the whole cache."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, owner: "KVStore"):
        super().__init__()
        self.keys, self.values, self.owner = keys, values, owner
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("a KV cache layer is allocated up front")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        layout = self.owner.layout
        if layout is None:
            raise RuntimeError("the KV cache was used outside a step (no StepLayout)")
        # key_states [1, KVH, T, D] -> each token's [KVH, D] at (its block, its offset)
        self.keys[layout.write_blocks, layout.write_offsets] = key_states[0].transpose(0, 1)
        self.values[layout.write_blocks, layout.write_offsets] = value_states[0].transpose(0, 1)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0  # no mask is built: the attention reads the layout

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return self.owner.positions


class KVStore(Cache):
    """Every layer's cache: `blocks` blocks of `block_tokens` positions, shared by at most `lanes` rows of at most
    `positions` positions each."""

    def __init__(self, config, lanes: int, blocks: int, block_tokens: int, positions: int, dtype: torch.dtype,
                 device: torch.device, base_key: bytes = b"", prefix_caching: bool = True):
        layers, kv_heads, head_dim = kv_shape(config)
        shape = (blocks + 1, block_tokens, kv_heads, head_dim)
        # zeros, not empty: a padding row's lanes read no garbage that could be NaN
        super().__init__(layers=[BlockLayer(torch.zeros(shape, dtype=dtype, device=device),
                                            torch.zeros(shape, dtype=dtype, device=device), self)
                                 for _ in range(layers)])
        self.lanes = lanes
        self.block_tokens = block_tokens
        self.positions = positions
        self.scratch = lanes
        """The lane padding tokens write through; its table row holds only the scratch block, which no row reads."""
        self.pool = BlockPool(blocks)
        width = -(-positions // block_tokens)
        self._host_tables = torch.full((lanes + 1, width), blocks, dtype=torch.long)
        self.tables = self._host_tables if device.type == "cpu" else self._host_tables.to(device)
        """[lanes + 1, W] on the device: what the attention and the writes read (sync copies the host's)."""
        self._held: list[list[int]] = [[] for _ in range(lanes)]
        self._free_lanes = list(range(lanes))
        self._dirty = False
        self.layout: StepLayout | None = None
        """The forward running now (set by `stepping`)."""
        self.usage = KVUsage()
        self.prefix_caching = prefix_caching
        """Full blocks are kept after their rows end and found again by the hash of what they hold (kv/blocks.py)."""
        self.base_key = base_key
        """A digest of the base's weights as held (plain, or NeuZip and its mantissa bits): every chain's seed
        covers it."""
        self.secret = os.urandom(32)
        """This process's key for tenants' names in the chains' seeds (blocks.py: tenant_key)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.keys, layer.values))

    @property
    def position_bytes(self) -> int:
        """What one position of a row costs over every layer (K and V)."""
        return self.nbytes // ((self.blocks + 1) * self.block_tokens)

    @property
    def blocks(self) -> int:
        return self.pool.blocks

    @property
    def free_lanes(self) -> int:
        return len(self._free_lanes)

    def blocks_for(self, length: int) -> int:
        """Blocks a row of `length` positions holds."""
        return -(-length // self.block_tokens)

    def fits(self, length: int, cached: list[int] = ()) -> bool:
        """Whether a new row of `length` positions, the first blocks of which are the cached `cached`, could take
        its blocks now."""
        return self.pool.available(self.blocks_for(length) - len(cached), list(cached))

    def share(self, lane: int, cached: list[int]) -> None:
        """A lane that holds no block yet starts with the cached blocks `cached` (a prefix its row does not
        write again)."""
        if self._held[lane]:
            raise RuntimeError(f"KV lane {lane} already holds blocks; a cached prefix comes first")
        self.pool.share(cached)
        self._held[lane] = list(cached)
        self._host_tables[lane, :len(cached)] = torch.tensor(cached, dtype=torch.long)
        self._dirty = True

    def block(self, lane: int, index: int) -> int:
        """The lane's index-th block."""
        return self._held[lane][index]

    def take(self) -> int | None:
        """The lowest free lane, holding no block yet (None: every lane is in use; the row waits)."""
        if not self._free_lanes:
            return None
        lane = min(self._free_lanes)
        self._free_lanes.remove(lane)
        return lane

    def give(self, lane: int) -> None:
        """The lane and every block it holds, back."""
        if lane in self._free_lanes or not 0 <= lane < self.lanes:
            raise RuntimeError(f"KV lane {lane} given back twice or never taken")
        self.pool.give(self._held[lane])
        self._held[lane] = []
        self._host_tables[lane] = self.pool.blocks
        self._dirty = True
        self._free_lanes.append(lane)

    def held(self, lane: int) -> int:
        """Positions the lane's blocks hold."""
        return len(self._held[lane]) * self.block_tokens

    def grow(self, lane: int, length: int) -> bool:
        """Blocks for the lane's first `length` positions, taken where it has fewer; False (nothing taken) when the
        pool has too few free."""
        need = self.blocks_for(length) - len(self._held[lane])
        if need <= 0:
            return True
        new = self.pool.take(need)
        if new is None:
            return False
        at = len(self._held[lane])
        self._held[lane] += new
        self._host_tables[lane, at:at + need] = torch.tensor(new)
        self._dirty = True
        return True

    def sync(self) -> None:
        """The host's block tables to the device, if they changed since (before a step reads them)."""
        if self._dirty and self.tables is not self._host_tables:
            self.tables.copy_(self._host_tables, non_blocking=True)
        self._dirty = False

    def save(self, lane: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of the first `length` positions of a lane's keys and values, every layer, in host memory, as
        [KVH, length, D]: what a parked row keeps while its blocks serve others (vLLM's swap-out). A GPU's copies
        are pinned, so a restore is one transfer each."""
        self.sync()
        table = self.tables[lane:lane + 1]

        def copy(t: torch.Tensor) -> torch.Tensor:
            part = gather_blocks(t, table, length)[0]
            if not part.is_cuda:
                return part
            return torch.empty(part.shape, dtype=part.dtype, pin_memory=True).copy_(part)

        return [(copy(layer.keys), copy(layer.values)) for layer in self.layers]

    def restore(self, lane: int, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """What save kept, written into the lane's blocks (grown to hold it first: `grow`) at the same positions."""
        length = saved[0][0].shape[1]
        if self.held(lane) < length:
            raise RuntimeError(f"KV lane {lane} holds {self.held(lane)} positions, not the {length} being restored")
        held = torch.tensor(self._held[lane], device=self.tables.device)
        at = torch.arange(length, device=held.device)
        blocks, offsets = held[at // self.block_tokens], at % self.block_tokens
        for layer, (k, v) in zip(self.layers, saved):
            layer.keys[blocks, offsets] = k.to(layer.keys.device, non_blocking=True).transpose(0, 1)
            layer.values[blocks, offsets] = v.to(layer.values.device, non_blocking=True).transpose(0, 1)

    def stepping(self, layout: StepLayout) -> "KVStore":
        """The cache for a forward laid out as `layout`: each token's block and offset looked up in the tables
        (inside the forward, so a captured step looks them up again when it is replayed)."""
        layout.block_tables = self.tables
        layout.write_blocks = self.tables[layout.write_lanes, layout.write_positions // self.block_tokens]
        layout.write_offsets = layout.write_positions % self.block_tokens
        self.layout = layout
        return self


def slot_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                   kv_layout: StepLayout | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [1, H, T, D]; key, value: the layer's whole cache (BlockLayer.update). -> ([1, T, H, D], None).
    Without a layout (a forward that is not a generation step), transformers' SDPA."""
    if kv_layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = scaling if scaling is not None else query.shape[3] ** -0.5
    return attend(query[0].transpose(0, 1), key, value, kv_layout, scale)[None], None


def attend(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: StepLayout, scale: float
           ) -> torch.Tensor:
    """q [T, H, D], the step's queries as `layout` lays them out; key, value: one layer's whole cache. -> [T, H, D]:
    decode rows through kernels.decode_attention, then every prefill chunk through kernels.chunk_attention."""
    if layout.invariant is not None:
        chunks = [] if layout.chunks is None else layout.chunks.tolist()
        return layout.invariant.attend(q, key, value, layout.block_tables, layout.lengths.tolist(), chunks, scale)
    rows = layout.decode_rows
    decoded = decode_attention(q[:rows], key, value, layout.block_tables, layout.lengths, scale,
                               layout.max_length)  # [B, H, D]
    if layout.chunks is None:
        return decoded
    out = torch.zeros_like(q)  # a padding token's attention is zero
    out[:rows] = decoded
    return chunk_attention(q, key, value, layout.block_tables, layout.chunks, scale, layout.chunk_tokens, out)


AttentionInterface.register(ATTENTION, slot_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # for forwards without a layout; a step builds no mask
