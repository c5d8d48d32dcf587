"""The KV cache's blocks and its prefix cache: which blocks are free, which rows hold each, and which full blocks
are kept after their rows end, found again by a chained hash of what they hold. Plain Python, no torch: the KV
store (serve/engine/kv/store.py) holds the tensors and the block tables.

A full block's hash covers its parent's hash and its tokens (vLLM V1's chain), so equal hashes mean equal tokens at
equal positions after an equal prefix. The chain starts from a row's seed, which covers what makes its keys and
values and who may read them, never a name a client picks (`prefix_seed`): the base's weights as held, the
variant's content (its store revision: a digest of its files), and a keyed hash of the authenticated tenant. A
block whose rows have all ended stays cached (idle) until its room is needed, then goes least recently used
first among the idle blocks of the tenant holding the most of them: a tenant's idle blocks beyond an even share
go before any other tenant's, so one tenant's flood cannot push out another's prefixes.
"""

import hashlib
import hmac
from array import array
from collections import Counter, OrderedDict
from itertools import count


def prefix_seed(base_key: bytes, variant: str, owner: bytes) -> bytes:
    """The hash a row's chain starts from: the base as held (base_key), its variant's identity (its entry's
    "<name>@<revision>" key and, for a group's member, its index; "" for the base) and its tenant's keyed hash."""
    return hashlib.blake2b(base_key + b"\0" + variant.encode() + b"\0" + owner, digest_size=16).digest()


def tenant_key(secret: bytes, tenant: str) -> bytes:
    """HMAC of the authenticated tenant's name under the server's secret: no client can name another's."""
    return hmac.new(secret, tenant.encode(), hashlib.sha256).digest()[:16]


def chain(parent: bytes, tokens: list[int], block_tokens: int, first: int, last: int) -> list[bytes]:
    """The hashes of blocks first..last - 1 of `tokens`, each over its parent's (`parent`: block first - 1's, or
    the seed)."""
    out = []
    for i in range(first, last):
        data = array("q", tokens[i * block_tokens:(i + 1) * block_tokens]).tobytes()
        parent = hashlib.blake2b(parent + data, digest_size=16).digest()
        out.append(parent)
    return out


class BlockPool:
    """`blocks` blocks, numbered 0..blocks - 1. A block is free, held by rows (counted), or idle: held by none, its
    contents cached under its hash. The lowest free blocks are handed out first, then idle ones are evicted."""

    def __init__(self, blocks: int):
        if blocks < 1:
            raise ValueError(f"a KV cache needs at least one block; got {blocks}")
        self.blocks = blocks
        self._free = list(range(blocks - 1, -1, -1))  # a stack, the lowest on top
        self._refs = [0] * blocks
        self._hash: list[bytes | None] = [None] * blocks
        self._owner: list[bytes] = [b""] * blocks
        self._cached: dict[bytes, int] = {}
        """Hash -> the block holding those contents."""
        self._idle: dict[bytes, OrderedDict[int, int]] = {}
        """Owner -> its idle blocks, least recently used first (block -> when it was last given back)."""
        self._clock = count()
        self.evictions = 0

    @property
    def free(self) -> int:
        """Blocks a take can have: the free ones and the idle ones."""
        return len(self._free) + self.idle

    @property
    def idle(self) -> int:
        return sum(len(d) for d in self._idle.values())

    @property
    def used(self) -> int:
        """Blocks held by rows."""
        return self.blocks - self.free

    def take(self, n: int) -> list[int] | None:
        """n blocks of no contents, free ones first, then idle ones evicted; None (none taken) when fewer are free."""
        if n > self.free:
            return None
        out = [self._free.pop() if self._free else self._evict() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def give(self, blocks: list[int]) -> None:
        """Each block held once less, all or (a block given back more than it was held) none: one held by none is
        idle if its contents are cached, else free."""
        held = Counter(blocks)
        bad = next((b for b, n in held.items() if self._refs[b] < n), None)
        if bad is not None:
            raise RuntimeError(f"KV block {bad} given back twice or never taken")
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            if self._hash[b] is None:
                self._free.append(b)
            else:
                self._idle.setdefault(self._owner[b], OrderedDict())[b] = next(self._clock)
        self._free.sort(reverse=True)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (not held: `share` holds them)."""
        out = []
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def available(self, n: int, cached: list[int]) -> bool:
        """Whether n blocks could be taken once the cached blocks of `cached` are held (those idle then count no
        more as free)."""
        return n <= self.free - sum(self._refs[b] == 0 for b in cached)

    def share(self, blocks: list[int]) -> None:
        """Hold cached blocks once more (an idle one is idle no more)."""
        for b in blocks:
            if self._refs[b] == 0:
                del self._idle[self._owner[b]][b]
            self._refs[b] += 1

    def register(self, block: int, h: bytes, owner: bytes) -> None:
        """A full block's contents, now written, cached under their hash for `owner` (kept when another block
        already holds them: that one serves lookups, this one is freed when its rows end)."""
        if h in self._cached or self._hash[block] is not None:
            return
        self._cached[h] = block
        self._hash[block], self._owner[block] = h, owner

    def drop_cached(self) -> int:
        """Every idle block freed, its contents forgotten (a benchmark's cold start); -> how many."""
        n = 0
        while self.idle:
            self._free.append(self._evict())
            n += 1
        self.evictions -= n
        self._free.sort(reverse=True)
        return n

    def _evict(self) -> int:
        """An idle block made free: the least recently used of the tenant holding the most idle blocks (the one
        furthest over an even share of them), so that another tenant's prefixes go only once its flood's have."""
        owner = max((o for o, d in self._idle.items() if d),
                    key=lambda o: (len(self._idle[o]), -next(iter(self._idle[o].values()))))
        b, _ = self._idle[owner].popitem(last=False)
        del self._cached[self._hash[b]]
        self._hash[b] = None
        self.evictions += 1
        return b
