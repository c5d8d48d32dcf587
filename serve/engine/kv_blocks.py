"""The KV cache's blocks: which are free, handed out and given back. Plain Python, no torch: the KV store
(serve/engine/kv_store.py) holds the tensors and the block tables."""


class BlockPool:
    """`blocks` blocks, numbered 0..blocks - 1; the lowest free ones are handed out first, so a lightly used cache
    keeps its rows' blocks near the front."""

    def __init__(self, blocks: int):
        if blocks < 1:
            raise ValueError(f"a KV cache needs at least one block; got {blocks}")
        self.blocks = blocks
        self._free = list(range(blocks - 1, -1, -1))  # a stack, the lowest on top
        self._taken = [False] * blocks

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.blocks - len(self._free)

    def take(self, n: int) -> list[int] | None:
        """n free blocks, or None (none taken) when fewer are free."""
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._taken[b] = True
        return out

    def give(self, blocks: list[int]) -> None:
        """Blocks back, all or (a block given back twice or never taken) none."""
        seen = set()
        for b in blocks:
            if not self._taken[b] or b in seen:
                raise RuntimeError(f"KV block {b} given back twice or never taken")
            seen.add(b)
        for b in blocks:
            self._taken[b] = False
        self._free.extend(blocks)
        self._free.sort(reverse=True)
