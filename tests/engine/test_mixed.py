"""One forward for rows of many variants: a mixed batch equals, row by row, each row run alone by transformers +
PEFT (fp32: greedy tokens equal, logits within 1e-4), for generation, classify and embeddings."""

import asyncio

import pytest
import torch

from serve.config import ServeConfig
from serve.engine.families.adapter_pool import bucket_key, bucket_row_bytes
from serve.engine.engine import Engine
from serve.engine.types import SamplingParams
from serve.variants import variant_kind
from serve.codecs import emr
from tests.forwards import forward_rows
from tests.models import write_lora, write_perturbed

LM_ADAPTERS = {  # name: (kind, r, targets, options)
    "lm-lora4": ("lora", 4, ["q_proj", "v_proj"], {}),
    "lm-lora8": ("lora", 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                 {"use_rslora": True, "rank_pattern": {"layers.1.mlp.down_proj": 2},
                  "alpha_pattern": {"layers.0.self_attn.q_proj": 3}}),
    "lm-pissa": ("pissa", 6, ["q_proj", "k_proj", "v_proj", "up_proj"], {}),
}
ENC_ADAPTERS = {
    "enc-lora4": ("lora", 4, ["query", "value"], {}),
    "enc-lora8": ("lora", 8, ["query", "key", "value", "dense"], {}),
    "enc-pissa": ("pissa", 6, ["query", "value"], {}),
}
CLASSES = ["neg", "pos", "other"]
EMR_GROUPS = [  # (group, base, {task: write_perturbed options})
    ("lm-emr", "tiny-lm", {"t1": {"seed": 40, "scale": 0.5}, "t2": {"seed": 41, "scale": 0.5, "only": "layers.1."}}),
    ("enc-emr", "minilm", {"a": {"seed": 42, "labels": CLASSES}, "b": {"seed": 43, "labels": CLASSES}}),
]


@pytest.fixture(scope="module")
def mixed(serving_store, tmp_path_factory):
    """The serving store plus adapters of the tiny Llama (generation) and of MiniLM (classifiers and plain
    encoders), every one registered through its kind; -> (engine, reference directories)."""
    from serve.data.models import minilm_dir
    from serve.store.store import Store

    root, refs = serving_store
    tmp = tmp_path_factory.mktemp("adapters")
    store = Store(root)
    dirs = dict(refs)
    for i, (name, (kind, r, targets, opts)) in enumerate(LM_ADAPTERS.items()):
        dirs[name] = write_lora(refs["tiny-lm"], tmp / name, seed=10 + i, r=r, targets=targets, **opts)
    for i, (name, (kind, r, targets, opts)) in enumerate(ENC_ADAPTERS.items()):
        dirs[name] = write_lora(minilm_dir(), tmp / name, seed=20 + i, r=r, targets=targets, **opts)
        dirs[name + "-clf"] = write_lora(minilm_dir(), tmp / f"{name}-clf", seed=30 + i, r=r, targets=targets,
                                         classes=CLASSES, **opts)
    for name, (kind, *_ ) in LM_ADAPTERS.items():
        if name not in store.manifest.variants:
            variant_kind(kind).add(store, name, "tiny-lm", dirs[name])
    for name, (kind, *_ ) in ENC_ADAPTERS.items():
        for n in (name, name + "-clf"):
            if n not in store.manifest.variants:
                variant_kind(kind).add(store, n, "minilm", dirs[n])
    for group, base, tasks in EMR_GROUPS:
        finetunes = {t: write_perturbed(refs[base], tmp / f"{group}-{t}", **opts) for t, opts in tasks.items()}
        bundle = emr.merge(refs[base], finetunes, tmp / group).path
        for t in tasks:
            dirs[f"{group}/{t}"] = emr.extract(bundle, t, tmp / f"{group}-{t}-merged")  # the reference
        if group not in store.manifest.variants:
            variant_kind("emr").add(store, group, base, bundle)
    return Engine(ServeConfig(store=root)), dirs


def peft_model(base_dir, adapter_dir=None, classifier=False):
    from peft import PeftModel
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    causal = any(a.endswith("ForCausalLM") for a in AutoConfig.from_pretrained(base_dir).architectures or [])
    if classifier:  # a full fine-tune's own head, or a fresh one that the adapter's saved head replaces
        model = AutoModelForSequenceClassification.from_pretrained(base_dir, num_labels=len(CLASSES))
    else:
        model = (AutoModelForCausalLM if causal else AutoModel).from_pretrained(base_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


def reference_dir(dirs, name):
    """(base directory, adapter directory or None) of a model as transformers + PEFT load it."""
    if name in LM_ADAPTERS:
        return dirs["tiny-lm"], dirs[name]
    if name.removesuffix("-clf") in ENC_ADAPTERS:
        return dirs["minilm"], dirs[name]
    return dirs[name], None


LM_ROWS = ["tiny-lm", "lm-lora4", "tiny-lm-top", "lm-emr/t1", "lm-lora8", "lm-pissa", "lm-emr/t2", "lm-lora4"]
PROMPTS = ["the cat sat on", "a big red dog", "one two three four", "the dog ran to", "hello world good day",
           "sun moon star sky", "good night red moon", "fish eat and drink"]


def test_mixed_forward_logits_equal_peft_row_by_row(mixed):
    engine, dirs = mixed
    rt = engine.bases["tiny-lm"]
    ids = torch.tensor([rt.prompts.encode(p) for p in PROMPTS])  # equal lengths: no padding
    logits = forward_rows(engine, "tiny-lm", LM_ROWS, ids)  # [rows, seq, vocab]
    for i, model in enumerate(LM_ROWS):
        base_dir, adapter = reference_dir(dirs, model)
        with torch.no_grad():
            ref = peft_model(base_dir, adapter)(input_ids=ids[i:i + 1]).logits[0]
        torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=1e-4, msg=f"row {i} ({model})")


def reference_greedy(dirs, model: str, prompt: str, n: int) -> list[int]:
    from transformers import AutoTokenizer

    base_dir, adapter = reference_dir(dirs, model)
    tok = AutoTokenizer.from_pretrained(dirs["tiny-lm"])
    enc = tok(prompt, return_tensors="pt")
    out = peft_model(base_dir, adapter).generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=0)
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    return new[: new.index(2)] if 2 in new else new  # up to eos, which the engine does not emit


def test_mixed_generation_with_rows_joining_mid_flight_equals_peft(mixed):
    """A long row of one adapter runs; rows of the base, two other adapters and a full variant join it after
    its first step. Every row's greedy tokens equal transformers + PEFT generating it alone."""
    engine, dirs = mixed
    params = SamplingParams(max_tokens=10, temperature=0)
    late = list(zip(LM_ROWS[1:], PROMPTS[1:]))

    async def together():
        first = engine.complete_stream("lm-pissa", SamplingParams(max_tokens=16, temperature=0), prompt=PROMPTS[0])
        await anext(first)  # the pissa row is running: the others join its batch
        others = asyncio.gather(*(engine.complete(m, params, prompt=p) for m, p in late))
        deltas = [d async for d in first]
        return deltas[-1].final, await others

    long, gens = asyncio.run(together())
    assert long.token_ids == reference_greedy(dirs, "lm-pissa", PROMPTS[0], 16)
    for (model, prompt), gen in zip(late, gens):
        assert gen.token_ids == reference_greedy(dirs, model, prompt, 10), model
    outs = {tuple(g.token_ids) for g in gens}
    assert len(outs) >= 4  # the variants really differ


ENC_TEXTS = ["The central bank raised interest rates", "What a lovely day at the beach",
             "Win a free phone now, text YES", "The match ended in a draw", "I did not like the film",
             "Rain is expected over the weekend", "Our team shipped the release today"]


def test_mixed_classify_rows_equal_peft(mixed):
    engine, dirs = mixed
    models = ["minilm-clf", "enc-lora4-clf", "enc-emr/a", "enc-lora8-clf", "enc-pissa-clf", "enc-emr/b",
              "enc-lora4-clf"]

    async def together():
        return await asyncio.gather(*(engine.classify(m, [t]) for m, t in zip(models, ENC_TEXTS)))

    results = asyncio.run(together())
    assert engine.batch_sizes.count >= 1
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dirs["minilm"])
    for model, text, res in zip(models, ENC_TEXTS, results):
        labels, probs = res.labels, res.probs
        base_dir, adapter = reference_dir(dirs, model)
        ref_model = peft_model(base_dir, adapter, classifier=True)
        with torch.no_grad():
            ref = ref_model(**tok([text], return_tensors="pt")).logits.softmax(-1)[0]
        assert labels == CLASSES
        torch.testing.assert_close(torch.tensor(probs[0]), ref, atol=1e-4, rtol=1e-4, msg=model)


def test_mixed_embeddings_rows_equal_peft(mixed):
    engine, dirs = mixed
    models = ["minilm", "enc-lora4", "minilm-clf", "enc-emr/b", "enc-lora8", "enc-pissa"]

    async def together():
        return await asyncio.gather(*(engine.embed(m, [t]) for m, t in zip(models, ENC_TEXTS)))

    results = asyncio.run(together())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dirs["minilm"])
    for model, text, emb in zip(models, ENC_TEXTS, results):
        base_dir, adapter = reference_dir(dirs, model)
        enc = tok([text], return_tensors="pt")
        with torch.no_grad():
            hidden = peft_model(base_dir, adapter)(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).float()
        ref = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)[0]
        torch.testing.assert_close(torch.tensor(emb.vectors[0]), ref, atol=1e-4, rtol=1e-4, msg=model)


@pytest.mark.parametrize("cpu_tier", [False, True], ids=["device-tier-only", "cpu-tier-copies-off-the-loop"])
def test_churn_with_tiny_budgets_keeps_every_output_exact(mixed, cpu_tier):
    """Room for one variant on the device tier and two adapters in the pool, rows of eight models at once: variants
    load, get evicted (or demoted to a cpu tier and promoted back, with the copies on the compute thread as on a
    GPU) and load again while others run, adapters queue for slots; every answer equals the answer the model
    gives alone, and no hold is left."""
    engine, _ = mixed
    models = ["lm-lora4", "tiny-lm-top", "lm-emr/t1", "lm-lora8", "tiny-lm", "lm-pissa", "tiny-lm-all", "lm-emr/t2",
              "lm-lora4", "lm-pissa"]
    params = SamplingParams(max_tokens=5, temperature=0)
    alone = {m: asyncio.run(engine.complete(m, params, prompt="one two three")).token_ids for m in set(models)}
    room = 2 * max(asyncio.run(_pool_bytes(engine, m)) for m in ("lm-lora4", "lm-lora8", "lm-pissa"))
    config = engine.config.model_copy(update={"slots": engine.config.slots.model_copy(
        update={"adapter_mib": room / (1 << 20)})})
    eng = Engine(config)
    eng.cache.device_bytes = max(asyncio.run(_nbytes(eng, m.split("/")[0])) for m in set(models) - {"tiny-lm"})
    eng.cache.cpu_bytes = 3 * eng.cache.device_bytes if cpu_tier else 0
    eng.cache.copies_off_loop = cpu_tier  # a CPU engine's copies are free; this takes the GPU's path

    async def churn():
        gens = await asyncio.gather(*(eng.complete(m, params, prompt="one two three") for m in models * 2))
        await eng.cache.settle()  # demotions still copying finish on this loop
        return gens

    for _ in range(2):
        assert [g.token_ids for g in asyncio.run(churn())] == [alone[m] for m in models * 2]
    if cpu_tier:
        assert "warm" in eng.cache.resident().values()  # demoted, not dropped
    else:
        assert eng.cache.stats.evictions > 0
    assert eng.holds() == {}


async def _pool_bytes(eng, name: str) -> int:
    """What the adapter costs in its base's adapter pool."""
    async with eng.cache.use(eng.catalog.snapshot.key(name)) as entry:
        return bucket_row_bytes(bucket_key(entry.variant), eng.bases[eng.catalog.snapshot.variant(name).base].view)


async def _nbytes(eng, name: str) -> int:
    async with eng.cache.use(eng.catalog.snapshot.key(name)) as entry:
        return entry.nbytes



def test_logprobs_and_echo_in_a_mixed_batch_equal_peft(mixed):
    """Rows of the base, adapters and a full variant, prompts of different lengths, in one batch: each prompt
    token's and each generated token's log probability, and the top alternatives, equal a log-softmax of
    transformers + PEFT's logits for that row alone; the prompt's first token has none."""
    from transformers import AutoTokenizer

    engine, dirs = mixed
    tok = AutoTokenizer.from_pretrained(dirs["tiny-lm"])
    prompts = [p + " and" * i for i, p in enumerate(PROMPTS)]
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=3, echo=True)

    async def together():
        return await asyncio.gather(*(engine.complete(m, params, prompt=p) for m, p in zip(LM_ROWS, prompts)))

    for model, prompt, gen in zip(LM_ROWS, prompts, asyncio.run(together())):
        ids = tok(prompt)["input_ids"]
        base_dir, adapter = reference_dir(dirs, model)
        with torch.no_grad():
            logits = peft_model(base_dir, adapter)(input_ids=torch.tensor([ids + gen.token_ids])).logits[0]
        lp = torch.log_softmax(logits.float(), -1)
        seen = ids + gen.token_ids
        entries = gen.prompt_logprobs + gen.logprobs
        if gen.finish_reason == "stop":  # the end-of-text token has its entry too, though not its text
            seen.append(2)
        assert len(entries) == len(seen) and entries[0].logprob is None
        assert gen.prompt_text == tok.decode(ids)
        assert "".join(e.token for e in entries[:len(ids) + len(gen.token_ids)]) == gen.prompt_text + gen.text

        def piece(j: int, token: int) -> str:  # a token's text after the 5 before it
            ctx = seen[max(0, j - 5):j]
            return tok.decode(ctx + [token])[len(tok.decode(ctx)):]

        for j in range(1, len(seen)):
            e = entries[j]
            assert e.token == piece(j, seen[j])
            assert abs(e.logprob - float(lp[j - 1, seen[j]])) < 1e-4, (model, j)
            top = lp[j - 1].topk(3)
            assert [t for t, _ in e.top] == [piece(j, i) for i in top.indices.tolist()], (model, j)
            torch.testing.assert_close(torch.tensor([v for _, v in e.top]), top.values, atol=1e-4, rtol=0)


def test_echo_with_no_new_tokens_scores_the_prompt_alone(mixed):
    engine, _ = mixed
    gen = asyncio.run(engine.complete("lm-lora8", SamplingParams(max_tokens=0, logprobs=0, echo=True),
                                      prompt=[5, 9, 12, 7]))
    assert gen.token_ids == [] and gen.logprobs == [] and gen.finish_reason == "length"
    assert [e.top for e in gen.prompt_logprobs[1:]] == [[]] * 3 and gen.prompt_tokens == 4


@pytest.mark.parametrize("resident,cold", [("tiny-lm-top", "tiny-lm-all"), ("lm-lora4", "lm-lora8")],
                         ids=["full-variant-decode", "adapter-read"])
def test_a_cold_load_never_holds_up_rows_of_resident_variants(mixed, resident, cold):
    """The cold variant's load (an FM-Delta decode, an adapter's read) is held until a resident variant's request
    has been answered: that answer can only come while the load waits on its loader thread (if it could not,
    the load gives up and its request fails)."""
    import threading

    engine, _ = mixed
    eng = Engine(engine.config)
    load = eng.cache._loader
    answered = threading.Event()

    def held_load(name, alloc):
        if name == cold and not answered.wait(timeout=60):
            raise RuntimeError("the resident variant's request was held up by this load")
        return load(name, alloc)

    eng.cache._loader = held_load
    params = SamplingParams(max_tokens=3, temperature=0)

    async def race():
        await eng.complete(resident, params, prompt="a")  # resident from here on
        loading = asyncio.ensure_future(eng.complete(cold, params, prompt="a b"))
        await eng.complete(resident, params, prompt="a b")
        still_loading = not loading.done()
        answered.set()
        return still_loading, await loading

    still_loading, gen = asyncio.run(race())
    assert still_loading and len(gen.token_ids) == 3
    assert eng.holds() == {}


def test_an_adapter_evicted_from_the_pool_comes_back_from_memory_not_the_store(mixed):
    """A pool with room for one adapter, rows of two taking turns: each is read from the store once; every
    later return is a copy from the variant cache's tiers, and every answer is the adapter's own."""
    engine, _ = mixed
    params = SamplingParams(max_tokens=4, temperature=0)
    alone = {m: asyncio.run(engine.complete(m, params, prompt="one two")).token_ids for m in ("lm-lora4", "lm-pissa")}
    room = max(asyncio.run(_pool_bytes(engine, m)) for m in alone)
    eng = Engine(engine.config.model_copy(update={"slots": engine.config.slots.model_copy(
        update={"adapter_mib": room / (1 << 20)})}))
    reads = []
    read = eng.cache._loader
    eng.cache._loader = lambda name, alloc: reads.append(name) or read(name, alloc)
    for m in ["lm-lora4", "lm-pissa"] * 3:
        assert asyncio.run(eng.complete(m, params, prompt="one two")).token_ids == alone[m]
    assert sorted(key.partition("@")[0] for key in reads) == ["lm-lora4", "lm-pissa"]
    pool = eng.bases["tiny-lm"].families["lora"]
    assert pool.nbytes <= pool.budget and len(pool.place) == 1
