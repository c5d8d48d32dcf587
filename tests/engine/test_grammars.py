"""The compiled-grammar cache: one compile per constraint (requests for a grammar still compiling wait for that one),
bounded in bytes with the least recently used evicted first, and bounded per tenant, so that one tenant's flood of
schemas evicts its own grammars and no one else's."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
from transformers import AutoTokenizer

from serve.config import StructuredOutputsConfig
from serve.engine.generation.grammars import Grammars
from serve.engine.types import Constraint
from tests.models import WORDS, write_tiny_causal


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(write_tiny_causal(tmp_path_factory.mktemp("grammars") / "m"))


def grammars(tokenizer, **config) -> Grammars:
    return Grammars(lambda: tokenizer, len(WORDS), {2}, StructuredOutputsConfig(**config), ThreadPoolExecutor(1))


def words(i: int) -> Constraint:
    """Another grammar for each i, each of about the same size."""
    return Constraint("grammar", f'root ::= "{WORDS[10 + i]}" ("cat" | "dog")*')


def test_requests_at_once_for_one_constraint_compile_it_once(tokenizer):
    g = grammars(tokenizer)

    async def together():
        return await asyncio.gather(*(g.compile(words(0), f"t{i}") for i in range(5)))

    compiled = asyncio.run(together())
    assert all(c is compiled[0] for c in compiled)
    assert (g.stats.compiles, g.stats.hits) == (1, 4)


def test_the_least_recently_used_goes_first_and_a_tenant_past_its_share_evicts_only_its_own(tokenizer):
    probe = grammars(tokenizer)
    size = asyncio.run(probe.compile(words(0), "x")).memory_size_bytes
    g = grammars(tokenizer, cache_mib=4.5 * size / (1 << 20), tenant_share=0.5)  # 4 grammars; 2 a tenant

    async def ask(i: int, tenant: str) -> None:
        await g.compile(words(i), tenant)

    async def flood():
        await ask(0, "light")
        await ask(1, "light")
        for i in range(2, 8):  # the heavy tenant's schemas: past its share, its own oldest go
            await ask(i, "heavy")
        await ask(0, "light")  # still cached: a hit

    asyncio.run(flood())
    kept = {key for key in g._kept}
    assert g.stats.hits == 1 and g.stats.compiles == 8
    assert {g._kept[k].tenant for k in kept} == {"light", "heavy"}
    assert sum(g._kept[k].tenant == "heavy" for k in kept) == 2 and sum(g._kept[k].tenant == "light" for k in kept) == 2

    async def more():
        for i in range(8, 10):
            await ask(i, "other")  # a third tenant: the cache is full, the least recently used of all go first

    asyncio.run(more())
    tenants = [k.tenant for k in g._kept.values()]
    assert tenants.count("other") == 2 and tenants.count("light") == 1 and len(tenants) == 4
