"""The tenants scenario's parts that can fail without a long run: per-tenant adapter derivation, the tenant draws
and the request plan, and the PEFT baseline's mixed batch (tiny in-code models; no Ray, no training)."""

import json
import random
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from loadtests.tenant_adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, Workload, derive_tenants, tenant_rank
from loadtests.tenant_load import TenantLoad, draw_tenants, plan_requests
from tests.models import write_lora, write_tiny_causal

TINY = Workload("T", ("q_proj", "v_proj"), (4, 8), 10)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama and one random (as if trained) q,v adapter of it per rank of TINY."""
    root = tmp_path_factory.mktemp("tenants")
    base = write_tiny_causal(root / "base")
    sources = {r: write_lora(base, root / f"src-r{r}", seed=r, r=r, targets=list(TINY.targets), lora_alpha=64)
               for r in TINY.ranks}  # a large scale: the adapters change what the tiny model generates
    return base, sources, root


def test_derived_adapters_differ_per_tenant_and_keep_ranks_and_targets(tiny):
    base, sources, root = tiny
    names = derive_tenants(sources, TINY, 4, root / "derived")
    assert len(set(names)) == 4
    weights = [load_file(root / "derived" / n / ADAPTER_WEIGHTS) for n in names]
    for i, (name, w) in enumerate(zip(names, weights)):
        rank = tenant_rank(TINY, i)
        assert name.endswith(f"-r{rank}")
        config = json.loads((root / "derived" / name / ADAPTER_CONFIG).read_text())
        assert config["r"] == rank and sorted(config["target_modules"]) == sorted(TINY.targets)
        src = load_file(sources[rank] / ADAPTER_WEIGHTS)
        assert w.keys() == src.keys()
        for key, t in w.items():
            assert t.shape == src[key].shape and t.dtype == torch.float32
            assert not torch.equal(t, src[key])
            assert (t - src[key]).std() < 0.5 * src[key].std()  # a perturbation, not a new adapter
    same_rank = [w for i, w in enumerate(weights) if tenant_rank(TINY, i) == TINY.ranks[0]]
    assert all(not torch.equal(same_rank[0][k], same_rank[1][k]) for k in same_rank[0])


def test_derivation_is_deterministic_per_seed(tiny):
    base, sources, root = tiny
    first = derive_tenants(sources, TINY, 2, root / "a", seed=7)
    again = derive_tenants(sources, TINY, 2, root / "b", seed=7)
    other = derive_tenants(sources, TINY, 2, root / "c", seed=8)
    for n in first:
        a, b, c = (load_file(root / d / n / ADAPTER_WEIGHTS) for d in ("a", "b", "c"))
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert all(not torch.equal(a[k], c[k]) for k in a)
    assert first == again == other


def test_derived_adapters_are_peft_and_manyfold_adapters(tiny):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from serve.store.tensors import SafetensorsSource
    from serve.variants.lora import parse_adapter

    base, sources, root = tiny
    names = derive_tenants(sources, TINY, 2, root / "valid")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), root / "valid" / names[0],
                                      adapter_name=names[0])
    model.load_adapter(root / "valid" / names[1], adapter_name=names[1])
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert [q.lora_A[n].weight.shape[0] for n in names] == [4, 8]
    shapes = {k: list(t.shape) for k, t in SafetensorsSource(base).items()}
    modules, _ = parse_adapter(root / "valid" / names[1], shapes, "tiny", max_rank=64)
    assert {a.shape[0] for a, _, _ in modules.values()} == {8} and len(modules) == 2 * 2  # q, v on 2 layers


def test_power_law_draws_follow_zipf_and_uniform_draws_are_flat():
    n, k = 100, 20_000
    zipf = Counter(draw_tenants(n, k, "zipf", 1.0, random.Random(0)))
    harmonic = sum(1 / (i + 1) for i in range(n))
    top = [c / k for _, c in zipf.most_common(3)]
    assert top[0] == pytest.approx(1 / harmonic, rel=0.1) and top[1] == pytest.approx(0.5 / harmonic, rel=0.15)
    uniform = Counter(draw_tenants(n, k, "uniform", 1.0, random.Random(0)))
    assert len(uniform) == n and max(uniform.values()) < 2 * k / n
    assert draw_tenants(n, 50, "zipf", 1.0, random.Random(3)) == draw_tenants(n, 50, "zipf", 1.0, random.Random(3))
    with pytest.raises(ValueError, match="distribution"):
        draw_tenants(n, 1, "normal", 1.0, random.Random(0))


def test_plan_is_fixed_by_the_seed_and_within_the_window():
    names, prompts = [f"t{i}" for i in range(20)], ["a", "b", "c"]
    load = TenantLoad(rate_rps=10, duration_s=5, distribution="zipf", min_tokens=16, max_tokens=64, seed=1)
    plan = plan_requests(names, prompts, load)
    assert plan == plan_requests(names, prompts, load)
    assert 20 <= len(plan) <= 90
    assert all(0 < a.at_s < b.at_s < 5 for a, b in zip(plan, plan[1:]))
    assert all(16 <= p.max_tokens <= 64 and p.model in names and p.prompt in prompts for p in plan)


def test_peft_mixed_batch_equals_each_adapter_alone(tiny):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loadtests.peft_server import generate_rows

    base, sources, _ = tiny
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), sources[4], adapter_name="a")
    model.load_adapter(sources[8], adapter_name="b")
    model.eval()
    rows = [[1, 10, 11, 12], [1, 13], [1, 14, 15], [1, 16, 17, 18, 19, 20]]
    names, max_new = ["a", "b", "__base__", "b"], [6, 3, 5, 4]
    mixed = generate_rows(model, rows, max_new, pad_id=0, eos_ids=[2], adapter_names=names)
    alone = []
    for row, name, n in zip(rows, names, max_new):
        if name == "__base__":
            with model.disable_adapter():
                alone += generate_rows(model, [row], [n], pad_id=0, eos_ids=[2])
        else:
            model.set_adapter(name)
            alone += generate_rows(model, [row], [n], pad_id=0, eos_ids=[2])
    assert mixed == alone and all(mixed)
    with model.disable_adapter():
        plain = generate_rows(model, [rows[0], rows[3]], [max_new[0], max_new[3]], pad_id=0, eos_ids=[2])
    assert plain != [mixed[0], mixed[3]]  # the adapters change what is generated


def test_adapter_lru_evicts_by_bytes_but_never_a_batch_member(tiny):
    from transformers import AutoModelForCausalLM

    from loadtests.peft_server import AdapterLru

    base, sources, root = tiny
    names = derive_tenants(sources, TINY, 3, root / "lru")
    paths = {n: str(root / "lru" / n) for n in names}
    size = (root / "lru" / names[1] / ADAPTER_WEIGHTS).stat().st_size  # rank 8: the largest
    lru = AdapterLru(AutoModelForCausalLM.from_pretrained(base), paths, budget_bytes=size)
    lru.ensure({names[0]})
    lru.ensure({names[1]})
    assert list(lru.held) == [names[1]] and lru.evictions == 1
    lru.ensure({names[1], names[2]})  # over budget, but both are needed now
    assert set(lru.held) == {names[1], names[2]} and lru.loads == 3
    assert set(lru.model.peft_config) == {names[1], names[2]}


def test_window_counts_the_unanswered_and_the_refused_apart():
    """A server that accepts and never answers: every request is still unanswered when the window closes, and
    counted so, not dropped; against a closed port each one is an error."""
    import asyncio

    from loadtests.tenant_load import Planned, run_window

    plan = [Planned(0.0, "t0", "hello", 16), Planned(0.01, "t1", "hello", 16)]

    async def silent() -> dict:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return (await run_window(f"http://127.0.0.1:{port}", plan, 0.2)).summary()

    s = asyncio.run(silent())
    assert (s["sent"], s["ok"], s["unanswered"], s["errors"], s["throughput_rps"]) == (2, 0, 2, 0, 0.0)
    refused = asyncio.run(run_window("http://127.0.0.1:9", plan, 0.2)).summary()
    assert (refused["unanswered"], refused["errors"]) == (0, 2)
    with pytest.raises(ValueError, match="loopback only"):
        asyncio.run(run_window("http://10.0.0.1:8000", plan, 0.2))
