"""A row of a running generation: what it asks (NewRow), where it stands in the batch (BatchRow), and where its
prompt stands in the prefix cache: its chain's seed, the hashes of its full blocks, those found cached at
admission and those registered once written (serve/engine/kv/blocks.py)."""

from dataclasses import dataclass, field
from typing import Any

import torch

from serve.engine.generation.detokenize import Detokenizer, RowText
from serve.engine.generation.grammars import RowGrammar
from serve.engine.generation.sampling import RowSampling
from serve.engine.kv.blocks import chain, prefix_seed, tenant_key
from serve.engine.kv.store import KVStore
from serve.engine.step.batch import RowSlot
from serve.engine.types import SamplingParams
from serve.errors import BadRequest
from serve.variants.base import LoadedVariant


@dataclass(frozen=True)
class NewRow:
    tag: Any
    """The caller's handle for the row, returned with its Generation."""
    prompt: list[int]
    params: SamplingParams
    """max_tokens is set (0 or more): the engine resolves a default before a row gets here."""
    variant: LoadedVariant | None = None
    grammar: Any = None
    """Its constraint's compiled grammar (serve/engine/generation/grammars.py), compiled before the row was queued."""
    scope: str = ""
    """The authenticated tenant whose cached prefixes it may read and write ("": a server without tenants)."""


@dataclass(eq=False, kw_only=True)
class BatchRow(RowText):
    """A row of the batch: its text so far (RowText) and where it stands in the batch."""

    rng: torch.Generator | None
    tag: Any
    slot: RowSlot | None
    """None once detached: a slot is given back exactly once, whatever fails."""
    kv: int | None
    """Its KV lane; None once given back (with its blocks)."""
    order: int = 0
    """Its admission's number in the batch: the latest is parked first where the scheduler says nothing."""
    prompt: list[int]
    written: int = 0
    """Tokens of this row in the KV store: the prompt's so far, then every token fed back."""
    next_token: int | None = None
    """The token it feeds at the next decode step (None while its prompt is being written)."""
    echo_logits: list[torch.Tensor] = field(default_factory=list)
    """An echoing row's logits of its prompt's positions so far, a chunk a tensor."""
    grammar: RowGrammar | None = None
    """Where its output is constrained: its place in the grammar."""
    end_ids: frozenset[int] = frozenset()
    """The tokens that end it (min_tokens keeps them out)."""
    seed: bytes = b""
    """Where its blocks' hash chain starts (kv/blocks.py: prefix_seed)."""
    owner: bytes = b""
    """Its tenant's keyed hash: whose share of the cache its cached blocks count against."""
    hashes: list[bytes] = field(default_factory=list)
    """The chain's hashes of its full blocks, as far as known."""
    registered: int = 0
    """Its first blocks that are cached (found at admission, or registered once written)."""
    done: bool = False
    failed: BaseException | None = None
    """It failed alone (detokenising): it leaves the batch with this error, the other rows go on."""

    @classmethod
    def start(cls, row: NewRow, slot: RowSlot, kv: int, name: str, eos_ids: set[int], order: int) -> "BatchRow":
        p = row.params
        rng = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        grammar = RowGrammar(row.grammar) if row.grammar is not None else None
        ends = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else frozenset(eos_ids))
        return cls.after(row.prompt, p, name, rng=rng, tag=row.tag, slot=slot, kv=kv, prompt=list(row.prompt),
                         grammar=grammar, end_ids=ends, order=order)

    def take(self, tok: int, text: Detokenizer, positions: int) -> None:
        """Its sampled token: fed back at the next step, its text advanced (text.advance: an end token, a stop
        string, max_tokens), its grammar moved on, and done where either ends it or its context (positions) is
        full. An error here is this row's alone: it leaves with it (failed), the batch goes on."""
        self.next_token = tok
        try:
            if self.grammar is not None and not self.grammar.accept(tok):  # its mask left it no token
                raise BadRequest(f"structured output: after {len(self.gen.token_ids)} tokens the grammar allows no "
                                 f"token of this model's vocabulary")
            self.done = text.advance(self, tok)
            if not self.done and self.grammar is not None and self.grammar.complete:  # its end token, ignored
                self.gen.finish_reason, self.done = "stop", True
                text.flush(self)
        except Exception as e:
            self.failed, self.done = e, True
        if not self.done and self.written >= positions:  # its context is full (the engine's checks forbid it)
            self.gen.finish_reason, self.done = "length", True
            text.flush(self)

    def needs(self) -> int:
        """The positions its lane's blocks must hold for its next step: the whole prompt and its first token while
        the prompt is being written (a parked row resuming takes them again), else one more than written."""
        return len(self.prompt) + 1 if self.next_token is None else self.written + 1

    def sampling(self) -> RowSampling:
        return RowSampling(self.params, self.rng, self.prompt, self.gen.token_ids, self.end_ids, self.grammar)


def prefix_of(kv: KVStore, row: NewRow) -> tuple[bytes, bytes, list[bytes], list[int]]:
    """(the row's chain seed, its tenant's keyed hash, the hashes of its prompt's full blocks before the one holding
    its last token, the cached blocks of their longest cached prefix); nothing with prefix caching off."""
    if not kv.prefix_caching:
        return b"", b"", [], []
    owner = tenant_key(kv.secret, row.scope)
    seed = prefix_seed(kv.base_key, variant_identity(row.variant), owner)
    hashes = chain(seed, row.prompt, kv.block_tokens, 0, (len(row.prompt) - 1) // kv.block_tokens)
    return seed, owner, hashes, [] if row.params.echoes_logprobs else kv.pool.lookup(hashes)


def register(kv: KVStore, s: BatchRow) -> None:
    """The row's blocks written full since, cached under their hashes (its tokens known on the host)."""
    full = min(s.written, len(s.prompt) + len(s.gen.token_ids)) // kv.block_tokens
    if not kv.prefix_caching or s.kv is None or full <= s.registered:
        return
    if full > len(s.hashes):
        tokens = s.prompt + s.gen.token_ids  # what it has fed, in order
        s.hashes += chain(s.hashes[-1] if s.hashes else s.seed, tokens, kv.block_tokens, len(s.hashes), full)
    for i in range(s.registered, full):
        kv.pool.register(kv.block(s.kv, i), s.hashes[i], s.owner)
    s.registered = full


def variant_identity(variant: LoadedVariant | None) -> str:
    """What a row's keys and values are computed with, as its chain's seed reads it: its store entry's key
    ("<name>@<revision>", the revision a digest of its files: a name re-added with other contents is another),
    a group member's place in its group, its kind; "" for the base."""
    if variant is None:
        return ""
    if variant.parent is not None:
        return f"{variant.parent.key}#{variant.index}:{variant.kind}"
    return f"{variant.key}:{variant.kind}"
