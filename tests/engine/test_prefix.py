"""Prefix caching: later rows start from the cached blocks of an earlier row's prompt and give the tokens and log
probabilities they give with caching off, for every kind; nothing is shared across tenants, variants, revisions
of a variant or forms of the base (checked by counters, not by timing); a request's choices and rows arriving
together with the same prompt write it once; one tenant's flood does not evict another's prefix."""

from dataclasses import replace

import pytest
import torch

from serve.config import BatchConfig
from serve.engine.generation.row import NewRow
from serve.engine.kv.blocks import BlockPool, chain
from serve.engine.model import BaseModelRuntime
from serve.engine.types import SamplingParams
from tests.engine.test_paged import TARGETS, full, generate, mib, pissa
from tests.models import random_emr_group, random_lora

SYSTEM = [(11 * j) % 50 + 3 for j in range(40)]
"""A 40-token system prompt: two full blocks of 16 and a part of the third."""


def runtime(path, caching: bool = True, **batch) -> BaseModelRuntime:
    rt = BaseModelRuntime("lm", path, batch=BatchConfig(**{"max_batch_size": 8, "max_step_tokens": 24,
                                                           "max_model_len": 96, "prefix_caching": caching, **batch}))
    rt.eos_ids = set()
    return rt


def turns(variants: list, scope: str = "") -> list[NewRow]:
    """For each variant, two requests in turn: the system prompt and a user turn of its own."""
    params = SamplingParams(max_tokens=6, logprobs=2)
    return [NewRow((i, k), SYSTEM + [(5 * i + 3 * k + j) % 40 + 3 for j in range(4 + k)], params, v, scope=scope)
            for i, v in enumerate(variants) for k in range(2)]


def kinds(rt: BaseModelRuntime, with_emr: bool) -> list:
    out = [None, random_lora(rt, "a", 4, 1, TARGETS), pissa(rt, "p", 4, 2), full(rt, "f", 3)]
    return out + (random_emr_group(rt, "g", 2, 5) if with_emr else [])


@pytest.mark.parametrize("base", ["plain", "nz", "nz3"])
def test_a_later_request_reads_the_cached_system_prompt_and_gives_the_tokens_of_caching_off(bases, base):
    """Each request alone, one after another: with caching on, a variant's second request starts from the first's
    two full blocks of the system prompt; its tokens and log probabilities are those of caching off, bit for bit."""
    got = {}
    for caching in (True, False):
        rt = runtime(bases[base], caching)
        rows = turns(kinds(rt, base == "plain"))
        got[caching] = {t: g for r in rows for t, g in generate(rt, [r]).items()}
        if caching:
            assert {t: g.cached_tokens for t, g in got[True].items()} == {r.tag: 32 * r.tag[1] for r in rows}
            assert rt.prefix_tokens == {"queries": sum(len(r.prompt) for r in rows), "hits": 32 * len(rows) // 2}
    for tag, want in got[False].items():
        assert got[True][tag].token_ids == want.token_ids, tag
        assert [lp.logprob for lp in got[True][tag].logprobs] == [lp.logprob for lp in want.logprobs], tag


def cached_after(rt: BaseModelRuntime, first: NewRow, second: NewRow) -> int:
    generate(rt, [first])
    return generate(rt, [second])[second.tag].cached_tokens


def test_nothing_is_shared_across_tenants_variants_revisions_or_forms_of_the_base(bases):
    rt = runtime(bases["plain"])
    a, b = random_lora(rt, "a", 4, 1, TARGETS), random_lora(rt, "b", 4, 2, TARGETS)
    params = SamplingParams(max_tokens=2)
    ask = lambda tag, v, scope="": NewRow(tag, SYSTEM + [7, 8, 9], params, v, scope=scope)  # noqa: E731
    assert cached_after(rt, ask(0, a, "acme"), ask(1, a, "acme")) == 32  # the same tenant and variant: a hit
    assert cached_after(rt, ask(2, a, "acme"), ask(3, a, "globex")) == 0  # another tenant, the same prompt
    assert cached_after(rt, ask(4, a, "acme"), ask(5, b, "acme")) == 0  # the same tenant on another variant
    assert cached_after(rt, ask(6, a), ask(7, None)) == 0  # the base itself
    readded = replace(random_lora(rt, "a", 4, 9, TARGETS), key="a@new")  # the name again, other contents
    assert cached_after(rt, ask(8, replace(a, key="a@old")), ask(9, readded)) == 0
    group = random_emr_group(rt, "g", 2, 5)
    assert cached_after(rt, ask(10, group[0]), ask(11, group[1])) == 0  # two tasks of one group
    assert rt.prefix_tokens["hits"] == 3 * 32  # the first hit, and acme's later firsts on a: nothing else
    plain, nz, nz3 = (runtime(bases[k]) for k in ("plain", "nz", "nz3"))
    assert len({plain.kv.base_key, nz.kv.base_key, nz3.kv.base_key}) == 3  # each form of the base seeds its own
    assert runtime(bases["plain"]).kv.base_key == plain.kv.base_key  # and the same weights the same
    assert plain.kv.secret != runtime(bases["plain"]).kv.secret  # tenants' keys: this process's secret


def test_a_requests_choices_and_rows_arriving_together_write_a_shared_prompt_once(bases):
    """Four rows with one prompt of three full blocks (a request's n = 4) join at once: the first writes the prompt,
    the others wait for its blocks and start from them; all four give the tokens of the first."""
    rt = runtime(bases["plain"])
    prompt = SYSTEM + list(range(3, 12))  # 49 tokens: three full blocks before the last token's
    rows = [NewRow(k, prompt, SamplingParams(max_tokens=4), None) for k in range(4)]
    before = rt.token_counts["prompt:eager"]
    got = generate(rt, rows)
    assert {g.cached_tokens for t, g in got.items() if t} == {48} and got[0].cached_tokens == 0
    assert rt.token_counts["prompt:eager"] - before == 49 + 3 * 1  # the prompt once, then each one's last token
    assert len({tuple(g.token_ids) for g in got.values()}) == 1


def test_one_tenants_flood_of_distinct_prompts_does_not_evict_anothers_prefix(bases):
    """A cache of 24 blocks of 16. Tenant b caches its system prompt; tenant a then sends 200 distinct prompts of
    three blocks, one after another, each cached as it ends: a's blocks go first, and b's next request still finds
    its prefix."""
    rt = runtime(bases["plain"], kv_cache_mib=mib(bases["plain"], 24, 16))
    assert rt.kv.blocks == 24
    params = SamplingParams(max_tokens=1)
    assert generate(rt, [NewRow("b0", SYSTEM + [3, 4], params, None, scope="b")])["b0"].cached_tokens == 0
    for k in range(200):
        flood = [3 + k % 40, 3 + k // 40] + [(13 * j) % 40 + 3 for j in range(48)]  # 200 distinct first blocks
        generate(rt, [NewRow(("a", k), flood, params, None, scope="a")])
    assert rt.kv.pool.evictions > 0  # the flood did fill the cache
    assert generate(rt, [NewRow("b1", SYSTEM + [5, 6], params, None, scope="b")])["b1"].cached_tokens == 32


def test_the_chain_covers_the_parent_and_the_pool_keeps_idle_blocks_until_their_room_is_needed():
    one, two = chain(b"seed", list(range(32)), 16, 0, 2), chain(b"other", list(range(32)), 16, 0, 2)
    assert one[1] != two[1] and chain(one[0], list(range(32)), 16, 1, 2) == one[1:]  # each covers its parent
    pool = BlockPool(3)
    blocks = pool.take(2)
    pool.register(blocks[0], one[0], b"t")
    pool.give(blocks)
    assert pool.free == 3 and pool.idle == 1 and pool.lookup(one) == [blocks[0]]
    pool.share([blocks[0]])
    assert pool.idle == 0 and pool.used == 1
    pool.give([blocks[0]])
    assert pool.take(3) is not None and pool.lookup(one) == [] and pool.evictions == 1  # its room was needed


def test_with_caching_off_nothing_is_cached(bases):
    rt = runtime(bases["plain"], caching=False)
    rows = turns([None])
    assert [g.cached_tokens for r in rows for g in generate(rt, [r]).values()] == [0, 0]
    assert rt.prefix_tokens == {} and rt.kv.pool.idle == 0
    assert torch.equal(rt.kv.tables[:-1], torch.full_like(rt.kv.tables[:-1], rt.kv.blocks))
