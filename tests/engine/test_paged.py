"""The paged KV cache: rows of every kind give the same tokens and log probabilities in blocks of 16 positions as in
one block of the whole context a row (the slot store), on a plain base and on NeuZip bases lossless and lossy;
when blocks run out, rows are parked and resumed and every request still gives the tokens it gives alone; a
request longer than the whole cache is refused naming it."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve.config import BatchConfig
from serve.engine.generation.decode_batch import DecodeBatch
from serve.engine.generation.row import NewRow
from serve.engine.kv.blocks import BlockPool
from serve.engine.kv.store import token_bytes
from serve.engine.model import BaseModelRuntime
from serve.engine.types import SamplingParams
from serve.errors import BadRequest
from tests.models import random_emr_group, random_lora

TARGETS = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
CONTEXT = 64


def full(rt: BaseModelRuntime, name: str, seed: int):
    from serve.variants.base import LoadedVariant

    g = torch.Generator().manual_seed(seed)
    stored = {k: rt.view.host[k] for k in rt.view.tensors if "layers.1." in k}  # a NeuZip base's are coded
    tensors = {k: t + torch.randn(t.shape, generator=g).to(t.dtype) * 0.3 for k, t in stored.items()}
    return LoadedVariant(name, "full", "weights", tensors)


def pissa(rt: BaseModelRuntime, name: str, rank: int, seed: int):
    """A PiSSA adapter as the engine holds one (converted to a LoRA of rank 2r against the stored base)."""
    from dataclasses import replace

    return replace(random_lora(rt, name, 2 * rank, seed, TARGETS), kind="pissa")


def mib(rt_dir, blocks: int, block_tokens: int) -> float:
    """batch.kv_cache_mib that buys `blocks` blocks of the tiny model's fp32 cache."""
    from transformers import AutoConfig

    return (blocks * block_tokens * token_bytes(AutoConfig.from_pretrained(rt_dir), torch.float32) + 1) / (1 << 20)


def generate(rt: BaseModelRuntime, rows: list[NewRow]) -> dict:
    batch, got = DecodeBatch(rt), {}
    waiting = list(rows)
    for _ in range(500):
        step = batch.run(waiting)
        assert not step.failed
        waiting = [r for r in waiting if r.tag in step.waiting]
        got.update(step.finished)
        if not waiting and not len(batch):
            break
    batch.close()
    assert rt.kv.pool.used == 0 and rt.kv.free_lanes == rt.kv.lanes
    return got


@pytest.mark.parametrize("base", ["plain", "nz", "nz3"])
def test_blocks_give_every_kind_the_tokens_and_log_probabilities_of_the_slot_layout(bases, base):
    """The same rows, prompts over several chunks and across block boundaries, in one batch: blocks of 16 against
    one block of the whole context a row, bit for bit."""
    got = {}
    for block in (16, CONTEXT):
        rt = BaseModelRuntime(base, bases[base], batch=BatchConfig(max_batch_size=8, max_step_tokens=24,
                                                                   max_model_len=CONTEXT, kv_block_tokens=block))
        rt.eos_ids = set()
        assert rt.kv.block_tokens == block and rt.kv.blocks == 16 * CONTEXT // block
        kinds = [None, random_lora(rt, "a", 4, 1, TARGETS), pissa(rt, "p", 4, 2), full(rt, "f", 3)]
        if base == "plain":
            kinds += random_emr_group(rt, "g", 2, 5)
        params = SamplingParams(max_tokens=14, logprobs=2)
        rows = [NewRow(i, [(5 * i + j) % 40 + 3 for j in range(9 + 5 * i)], params, v) for i, v in enumerate(kinds)]
        got[block] = generate(rt, rows)
    paged, slots = got[16], got[CONTEXT]
    assert len({tuple(g.token_ids) for g in slots.values()}) >= 4  # the kinds really differ
    for tag, want in slots.items():
        assert paged[tag].token_ids == want.token_ids, tag
        assert [lp.logprob for lp in paged[tag].logprobs] == [lp.logprob for lp in want.logprobs], tag


@pytest.fixture(scope="module")
def small(bases) -> BaseModelRuntime:
    """Eight blocks of four positions for rows of up to 24: a load of several rows runs the cache out."""
    rt = BaseModelRuntime("small", bases["plain"], batch=BatchConfig(
        max_batch_size=6, max_step_tokens=9, max_model_len=CONTEXT, kv_block_tokens=4,
        kv_cache_mib=mib(bases["plain"], 8, 4)))
    rt.eos_ids = set()
    return rt


def alone(rt: BaseModelRuntime, rows: list[NewRow]) -> dict:
    return {tag: gen for r in rows for tag, gen in generate(rt, [r]).items()}


def test_a_request_longer_than_the_whole_cache_is_refused_naming_it(small):
    assert small.kv.blocks == 8 and small.max_length == 32
    small.prompts.check_fits([5] * 20, 12)
    with pytest.raises(BadRequest, match=r"^prompt \(20 tokens\) plus max_tokens \(13\) exceeds the KV cache of 32 "
                                         r"tokens$"):
        small.prompts.check_fits([5] * 20, 13)
    with pytest.raises(BadRequest, match="exceeds the KV cache of 32 tokens"):
        small.prompts.check_fits([5] * 33, None)


def test_when_blocks_run_out_the_latest_row_is_parked_and_every_row_gives_its_tokens_alone(small):
    """Four rows of 6-9 prompt tokens and 10 new ones: together they need 16 blocks of the 8. Rows are parked (the
    latest admitted first, or the one the scheduler names) and resumed, and each gives its tokens alone."""
    a = random_lora(small, "a", 4, 1, TARGETS)
    rows = [NewRow(i, [(3 * i + j) % 40 + 3 for j in range(6 + i)], SamplingParams(max_tokens=10), v)
            for i, v in enumerate([None, a, None, a])]
    want = alone(small, rows)
    batch, got, parked, first_parked = DecodeBatch(small), {}, [], None
    waiting = list(rows)
    for _ in range(300):
        step = batch.run(waiting, victims=[0])  # the scheduler names row 0 first
        if first_parked is None and step.parked:
            first_parked = step.parked[0]
        parked += step.parked
        waiting = [r for r in rows if r.tag in step.waiting or r.tag in step.parked]  # asked again each step
        assert not step.failed
        got.update(step.finished)
        if len(got) == len(rows):
            break
    batch.close()
    assert parked and first_parked == 0  # the cache ran out, and the named row went first
    assert {t: g.token_ids for t, g in got.items()} == {t: g.token_ids for t, g in want.items()}
    assert small.kv.pool.used == 0


def test_a_row_parked_mid_prompt_resumes_writing_it_and_gives_its_tokens_alone(small):
    """A LoRA row's 20-token prompt is written 9 tokens a step; parked after the first step, it gives back every
    block while another row runs to its end over them, then resumes writing its prompt where it stopped: the same
    tokens and log probabilities as alone."""
    a = random_lora(small, "a", 4, 1, TARGETS)
    params = SamplingParams(max_tokens=6, logprobs=2)
    long, other = NewRow("long", [(3 * j) % 40 + 3 for j in range(20)], params, a), \
        NewRow("other", [(5 * j) % 40 + 3 for j in range(12)], SamplingParams(max_tokens=12))
    want = alone(small, [long, other])
    batch, got = DecodeBatch(small), {}
    batch.run([long])
    assert [s.written for s in batch.prefilling] == [9] and small.kv.pool.used == 6  # 21 positions: 6 blocks
    step = batch.run([], park=["long"])
    assert step.parked == ["long"] and not len(batch) and small.kv.pool.used == 0
    for _ in range(50):
        got.update(batch.run([] if len(batch) else [other]).finished)
        if "other" in got:
            break
    for _ in range(50):
        got.update(batch.run([] if len(batch) else [long]).finished)
        if "long" in got:
            break
    batch.close()
    assert got["other"].token_ids == want["other"].token_ids and got["long"].token_ids == want["long"].token_ids
    assert [lp.logprob for lp in got["long"].logprobs] == [lp.logprob for lp in want["long"].logprobs]
    assert small.kv.pool.used == 0 and not batch.parked


REQUESTS = st.lists(st.tuples(st.integers(1, 12), st.integers(1, 12), st.sampled_from(["base", "a", "f"])),
                    min_size=2, max_size=6)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=REQUESTS, arrivals=st.lists(st.integers(0, 4), min_size=6, max_size=6))
def test_any_load_on_a_cache_far_smaller_than_it_gives_every_request_its_tokens_alone(small, requests, arrivals):
    """Requests of up to 24 positions arriving at random steps on a cache of 32 positions: rows wait for blocks,
    are parked when the cache runs out and resume; every one finishes with the greedy tokens it gives alone."""
    variants = {"base": None, "a": random_lora(small, "a", 4, 1, TARGETS), "f": full(small, "f", 3)}
    rows = [NewRow(i, [(7 * i + j) % 40 + 3 for j in range(n)], SamplingParams(max_tokens=m), variants[v])
            for i, (n, m, v) in enumerate(requests)]
    want = alone(small, rows)
    batch, got, step_no, waiting = DecodeBatch(small), {}, 0, []
    pending = list(rows)
    while pending or waiting or len(batch):
        due = [r for r in pending if arrivals[r.tag] <= step_no]
        pending = [r for r in pending if r not in due]
        new = waiting + due
        step = batch.run(new)
        assert not step.failed
        waiting = [r for r in rows if r.tag in step.waiting or r.tag in step.parked]
        got.update(step.finished)
        step_no += 1
        assert step_no < 400
    batch.close()
    assert small.kv.pool.used == 0 and small.kv.free_lanes == small.kv.lanes
    assert {t: g.token_ids for t, g in got.items()} == {t: g.token_ids for t, g in want.items()}


def test_the_block_pool_hands_out_the_lowest_free_blocks_and_refuses_a_double_give():
    pool = BlockPool(6)
    assert pool.take(3) == [0, 1, 2] and pool.take(4) is None and pool.free == 3
    pool.give([1])
    assert pool.take(2) == [1, 3] and pool.used == 4
    with pytest.raises(RuntimeError, match="KV block 1 given back twice"):
        pool.give([1, 1])
    assert pool.used == 4  # nothing was given back
    with pytest.raises(RuntimeError, match="KV block 5 given back twice or never taken"):
        pool.give([5])
