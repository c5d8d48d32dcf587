"""The adapter pool: adapters bounded by bytes, not slots; each rank held and multiplied at its own bucket's rank;
idle adapters evicted least recently used first and their memory given back; rows beyond the budget wait."""

import pytest
import torch
from torch.func import functional_call

import serve.engine.families.adapter_pool as pool_module
from serve.config import SlotsConfig
from serve.engine.families.adapter_pool import AdapterPool, bucket_key, bucket_row_bytes, rank_bucket
from serve.engine.step.batch import BatchPlan
from serve.engine.model import BaseModelRuntime
from serve.variants.base import LoadedVariant
from tests.models import random_lora, write_tiny_causal

TARGETS = ("self_attn.q_proj", "self_attn.v_proj")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_causal(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def rt(model_dir) -> BaseModelRuntime:
    return BaseModelRuntime("tiny", model_dir)


@pytest.fixture(scope="module")
def plain(model_dir) -> torch.nn.Module:
    """The base as transformers loads it: what merged adapters are computed with."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def adapter(rt: BaseModelRuntime, name: str, rank: int, seed: int, targets=TARGETS) -> LoadedVariant:
    """A LoRA on every layer's `targets` with random A, B and scale alpha / r (alpha 16)."""
    return random_lora(rt, name, rank, seed, targets)


def merged_logits(plain: torch.nn.Module, v: LoadedVariant, ids: torch.Tensor) -> torch.Tensor:
    """The adapter merged into the base's weights (W + s B A), run alone: what its rows must give (up to fp32
    rounding: merged and unmerged sum in another order, over this model's wide activations; a wrong adapter is off
    by units)."""
    params = {f"{m}.weight": plain.get_submodule(m).weight + s * v.tensors[f"{m}.B"] @ v.tensors[f"{m}.A"]
              for m, s in v.scales.items()}
    with torch.no_grad():
        return functional_call(plain, params, (ids,), strict=False).logits


def pool_of(rt: BaseModelRuntime, mib: float) -> AdapterPool:
    pool = AdapterPool(rt.view, rt.device, SlotsConfig(adapter_mib=mib))
    rt.families["lora"] = pool  # the runtime's pool, as configured (its wrappers read the same dict)
    return pool


def test_64_distinct_adapters_run_in_one_forward_each_row_as_its_adapter_alone(rt, plain, monkeypatch):
    adapters = [adapter(rt, f"t{i}", rank=(8, 16, 4, 12)[i % 4], seed=i) for i in range(64)]
    pool = pool_of(rt, mib=64)
    slots = [rt.attach(v) for v in adapters]
    assert None not in slots
    ids = torch.randint(3, 40, (64, 5), generator=torch.Generator().manual_seed(0))
    forwards = []
    monkeypatch.setattr(rt.model, "forward", _counting(rt.model.forward, forwards))
    with torch.no_grad():
        out = rt.call(BatchPlan(slots, rt.device), input_ids=ids).logits
    assert len(forwards) == 1
    monkeypatch.undo()
    for i, v in enumerate(adapters):
        torch.testing.assert_close(out[i], merged_logits(plain, v, ids[i:i + 1])[0], rtol=1e-3, atol=1e-3)
    for s in slots:
        rt.detach(s)
    assert pool.in_use == 0


def test_packed_siblings_shrink_once_a_layer_and_each_row_is_its_adapter_alone(rt, plain, monkeypatch):
    """As on CUDA: q, k and v (and gate and up) of a layer share one A tensor and one shrink; each row still gets
    its own adapter, through the stacks' growth."""
    every = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj",
             "mlp.down_proj")
    adapters = [adapter(rt, f"p{i}", rank=(8, 4)[i % 2], seed=400 + i, targets=every) for i in range(6)]
    pool = pool_of(rt, mib=64)
    pool.packed = True
    slots = [rt.attach(v) for v in adapters]
    (bucket,) = pool.buckets.values()
    layers = rt.model.config.num_hidden_layers
    assert sorted(map(len, bucket.groups)) == [1] * layers + [2] * layers + [3] * layers
    shrinks, alone = [], []
    monkeypatch.setattr(pool_module, "bgmv_shrink",
                        lambda *a, real=pool_module.bgmv_shrink: shrinks.append(1) or real(*a))
    monkeypatch.setattr(pool_module, "lora_by_token",
                        lambda *a, real=pool_module.lora_by_token: alone.append(1) or real(*a))
    ids = torch.randint(3, 40, (len(adapters), 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = rt.call(BatchPlan(slots, rt.device), input_ids=ids).logits
    assert (len(shrinks), len(alone)) == (2 * layers, layers)  # a shrink per group; down_proj alone
    for i, v in enumerate(adapters):
        torch.testing.assert_close(out[i], merged_logits(plain, v, ids[i:i + 1])[0], rtol=1e-3, atol=1e-3)
    for s in slots:
        rt.detach(s)


def test_rank_8_rows_beside_a_rank_64_one_are_multiplied_at_rank_8(rt, monkeypatch):
    """The ops' shapes: each stack the ops read has its bucket's rank, and the rank-64 stack sees only the
    rank-64 row's tokens."""
    small = [adapter(rt, f"r8-{i}", rank=8, seed=100 + i) for i in range(6)]
    big = adapter(rt, "r64", rank=64, seed=200)
    pool_of(rt, mib=64)
    rows = small[:3] + [big] + small[3:]
    slots = [rt.attach(v) for v in rows]
    calls = []
    real = pool_module.lora_by_token

    def lora(x, a_stacked, b_stacked, scale, rows, y, host=None):
        live = rows[rows >= 0]
        calls.append((a_stacked.shape[1], live.numel(), len(set(live.tolist()))))
        return real(x, a_stacked, b_stacked, scale, rows, y, host)

    monkeypatch.setattr(pool_module, "lora_by_token", lora)
    seq = 4
    with torch.no_grad():
        rt.call(BatchPlan(slots, rt.device), input_ids=torch.randint(3, 40, (len(rows), seq)))
    by_rank = {}
    for rank, tokens, segments in calls:
        by_rank.setdefault(rank, set()).add((tokens, segments))
    assert by_rank == {8: {(6 * seq, 6)}, 64: {(1 * seq, 1)}}  # every targeted module, the same split
    for s in slots:
        rt.detach(s)


def test_the_budget_bounds_bytes_idle_adapters_leave_lru_first_and_busy_ones_make_rows_wait(rt, plain):
    adapters = [adapter(rt, f"b{i}", rank=8, seed=300 + i) for i in range(5)]
    row = bucket_row_bytes(bucket_key(adapters[0]), rt.view)
    pool = pool_of(rt, mib=3 * row / (1 << 20))  # room for three
    held = [rt.attach(v) for v in adapters[:3]]
    assert None not in held and pool.nbytes <= pool.budget
    assert rt.attach(adapters[3]) is None  # every adapter in the pool is running: the row waits
    rt.detach(held[1])
    rt.detach(held[0])  # b1 then b0 went idle; b1 was used less recently
    s3 = rt.attach(adapters[3])
    assert s3 is not None and pool.nbytes <= pool.budget
    assert pool.slot_of("b1") is None and pool.slot_of("b0") is not None  # least recently used left first
    ids = torch.randint(3, 40, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # rows moved by the compaction still read their own adapter
        out = rt.call(BatchPlan([held[2], s3], rt.device), input_ids=ids).logits
    torch.testing.assert_close(out[0], merged_logits(plain, adapters[2], ids[:1])[0], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(out[1], merged_logits(plain, adapters[3], ids[1:])[0], rtol=1e-3, atol=1e-3)
    for s in (held[2], s3):
        rt.detach(s)
    for name in ("b0", "b2", "b3"):
        pool.retire(name)
    assert pool.nbytes == 0 and pool.buckets == {}  # a bucket with no adapters gives its memory back


def test_an_adapter_larger_than_the_pool_is_refused_at_load(rt):
    from serve.errors import VariantIncompatible

    big = adapter(rt, "huge", rank=64, seed=1)
    pool = pool_of(rt, mib=bucket_row_bytes(bucket_key(big), rt.view) / 2 / (1 << 20))
    with pytest.raises(VariantIncompatible, match="needs .* MiB in the adapter pool; slots.adapter_mib is"):
        pool.check(big)


def test_rank_buckets():
    assert [rank_bucket(r) for r in (1, 4, 8, 9, 16, 17, 33, 64, 128)] == [8, 8, 8, 16, 16, 32, 64, 64, 128]


def _counting(forward, calls: list):
    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    return counted
