"""The engine against transformers run directly on the same weights: identical tokens, same probabilities."""

import asyncio

import pytest
import torch

from serve.config import ServeConfig
from serve.engine.engine import Engine
from serve.engine.types import SamplingParams
from serve.errors import BadRequest, Overloaded, RowFailed, VariantNotFound
from tests.conftest import same_bits


@pytest.fixture(scope="module")
def engine(serving_store):
    root, _ = serving_store
    return Engine(ServeConfig(store=root))


def run(coro):
    return asyncio.run(coro)


def reference_greedy(model_dir, prompt: str, n: int) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tok(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=n, do_sample=False, pad_token_id=0)
    new = out[0, ids["input_ids"].shape[1]:].tolist()
    return new[: new.index(2)] if 2 in new else new  # up to eos, which the engine does not emit


@pytest.mark.parametrize("model", ["tiny-lm", "tiny-lm-top", "tiny-lm-all"])
def test_greedy_tokens_equal_transformers_generate(engine, serving_store, model):
    _, refs = serving_store
    prompt = "the cat sat on the mat and"
    gen = run(engine.complete(model, SamplingParams(max_tokens=12, temperature=0), prompt=prompt))
    assert gen.token_ids == reference_greedy(refs[model], prompt, 12)
    assert gen.prompt_tokens == len(prompt.split())


def test_variants_really_differ_from_the_base(engine):
    outs = {m: run(engine.complete(m, SamplingParams(max_tokens=12, temperature=0), prompt="the dog ran to"))
            for m in ("tiny-lm", "tiny-lm-top", "tiny-lm-all")}
    assert len({tuple(g.token_ids) for g in outs.values()}) == 3


def test_mixed_concurrent_rows_equal_single_requests(engine):
    prompts = [("tiny-lm", "hello world"), ("tiny-lm-all", "the big red"), ("tiny-lm", "one two three four"),
               ("tiny-lm-top", "a cat"), ("tiny-lm-all", "sun moon star sky sea")]
    params = SamplingParams(max_tokens=8, temperature=0)
    single = [run(engine.complete(m, params, prompt=p)).token_ids for m, p in prompts]

    async def together():
        return await asyncio.gather(*(engine.complete(m, params, prompt=p) for m, p in prompts))

    assert [g.token_ids for g in run(together())] == single


def test_seeded_sampling_repeats_and_stop_strings_cut(engine):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=7)
    a = run(engine.complete("tiny-lm", params, prompt="the cat"))
    b = run(engine.complete("tiny-lm", params, prompt="the cat"))
    assert a.token_ids == b.token_ids
    greedy = run(engine.complete("tiny-lm", SamplingParams(max_tokens=10, temperature=0), prompt="the cat"))
    words = greedy.text.split()
    cut = run(engine.complete("tiny-lm", SamplingParams(max_tokens=10, temperature=0, stop=(words[2],)),
                              prompt="the cat"))
    assert cut.finish_reason == "stop" and words[2] not in cut.text.split()


def test_chat_uses_the_template(engine):
    gen = run(engine.complete("tiny-lm", SamplingParams(max_tokens=4, temperature=0),
                              messages=[{"role": "user", "content": "hello"}]))
    assert gen.prompt_tokens == 3  # "user:" "hello" "assistant:"


def test_classifier_variant_equals_transformers(engine, serving_store):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    _, refs = serving_store
    texts = ["a fine day at the sea", "the worst film I have seen", "ok"]
    res = run(engine.classify("minilm-clf", texts))
    labels, probs = res.labels, res.probs
    model = AutoModelForSequenceClassification.from_pretrained(refs["minilm-clf"]).eval()
    tok = AutoTokenizer.from_pretrained(refs["minilm-clf"])
    with torch.no_grad():
        ref = torch.cat([model(**tok([t], return_tensors="pt")).logits.softmax(-1) for t in texts])
    assert labels == ["neg", "pos", "other"]
    torch.testing.assert_close(torch.tensor(probs), ref, atol=1e-5, rtol=0)
    assert torch.tensor(probs).argmax(-1).tolist() == ref.argmax(-1).tolist()


def test_embeddings_are_sentence_transformers_mean_pooling(engine, serving_store):
    from transformers import AutoModel, AutoTokenizer

    _, refs = serving_store
    out = run(engine.embed("minilm", ["the cat sat", "a dog"]))
    model = AutoModel.from_pretrained(refs["minilm"]).eval()
    tok = AutoTokenizer.from_pretrained(refs["minilm"])
    assert out.prompt_tokens == sum(len(x) for x in tok(["the cat sat", "a dog"])["input_ids"])
    with torch.no_grad():
        h = model(**tok(["the cat sat"], return_tensors="pt")).last_hidden_state.mean(1)
    expected = torch.nn.functional.normalize(h, dim=-1)[0]
    torch.testing.assert_close(torch.tensor(out.vectors[0]), expected, atol=1e-5, rtol=0)


def test_wrong_kind_and_unknown_models(engine):
    with pytest.raises(VariantNotFound, match="did you mean 'tiny-lm-top'"):
        run(engine.complete("tiny-lm-tpo", SamplingParams(), prompt="x"))
    with pytest.raises(BadRequest, match="not a classifier"):
        run(engine.classify("minilm", ["x"]))
    with pytest.raises(BadRequest, match="not a causal"):
        run(engine.complete("minilm-clf", SamplingParams(), prompt="x"))


def test_full_queue_refuses_with_overloaded(serving_store):
    root, _ = serving_store
    eng = Engine(ServeConfig(store=root, batch={"max_queue": 2, "max_batch_size": 1}))

    async def flood():
        return await asyncio.gather(*(eng.complete("tiny-lm", SamplingParams(max_tokens=2), prompt="a")
                                      for _ in range(8)), return_exceptions=True)

    results = run(flood())
    assert any(isinstance(r, Overloaded) for r in results)
    assert any(not isinstance(r, Exception) for r in results)


def test_top_layer_finetune_holds_only_what_it_changed(engine):
    def key(name):
        return engine.catalog.snapshot.key(name)

    async def load():
        async with engine.cache.use(key("tiny-lm-top")) as top, engine.cache.use(key("tiny-lm-all")) as full:
            return set(top.weights), top.nbytes, full.nbytes

    names, top_bytes, all_bytes = run(load())
    assert names and all(".layers.1." in n for n in names)
    assert top_bytes < all_bytes / 2


def test_eviction_churn_under_concurrency_keeps_outputs_exact(serving_store):
    """A cache that holds one variant, rows of three models at once: variants decode again and again, while
    other groups' batches run with their weights swapped in; every answer equals the single-request one."""
    root, _ = serving_store
    eng = Engine(ServeConfig(store=root))
    params = SamplingParams(max_tokens=6, temperature=0)
    models = ["tiny-lm-top", "tiny-lm-all", "tiny-lm"] * 4
    single = {m: run(eng.complete(m, params, prompt="one two three")).token_ids for m in set(models)}
    eng.cache.device_bytes = max(e.nbytes for e in eng.cache._tiers["device"].values())
    eng.cache.cpu_bytes = 0

    async def churn():
        return await asyncio.gather(*(eng.complete(m, params, prompt="one two three") for m in models))

    for _ in range(3):
        assert [g.token_ids for g in run(churn())] == [single[m] for m in models]
    assert eng.cache.stats.evictions > 0


def test_decodes_write_into_reserved_or_evicted_buffers_but_never_in_use_ones(serving_store):
    root, _ = serving_store
    eng = Engine(ServeConfig(store=root))
    reserved = {t.data_ptr() for ts in eng.cache.buffers._free.values() for t in ts}
    params = SamplingParams(max_tokens=6, temperature=0)
    expected = run(eng.complete("tiny-lm-all", params, prompt="one two")).token_ids
    base_ptrs = {t.data_ptr() for t in eng.bases["tiny-lm"].view.tensors.values()}

    def ptrs(name):
        return {t.data_ptr() for t in eng.cache._tiers["device"][key(name)].weights.values()}

    def key(name):
        return eng.catalog.snapshot.key(name)

    first = ptrs("tiny-lm-all")
    assert first <= reserved  # its first decode wrote into buffers faulted in when the engine started
    eng.cache.drop(key("tiny-lm-all"))
    assert eng.cache.buffers.free_bytes > 0
    assert run(eng.complete("tiny-lm-all", params, prompt="one two")).token_ids == expected
    assert ptrs("tiny-lm-all") == first and not first & base_ptrs

    async def drop_while_running():
        async with eng.cache.use(key("tiny-lm-all")) as entry:
            held = {k: v.clone() for k, v in entry.weights.items()}
            eng.cache.drop(key("tiny-lm-all"))
            await eng.complete("tiny-lm-top", params, prompt="one two")  # a decode that wants buffers
            return all(same_bits(entry.weights[k], v) for k, v in held.items())

    assert run(drop_while_running())


async def _wait_for_forwards(eng: Engine, n: int) -> None:
    """Until the engine has run n more forward passes (bounded: 10 s)."""
    target = eng.batch_sizes.count + n
    for _ in range(10_000):
        if eng.batch_sizes.count >= target:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"the engine ran fewer than {n} forwards in 10 s")


def test_rows_join_a_running_generation_and_give_the_tokens_they_give_alone(serving_store):
    root, _ = serving_store
    eng = Engine(ServeConfig(store=root))
    eng.bases["tiny-lm"].eos_ids = set()  # every row runs to max_tokens: long enough to join
    long = ("a", SamplingParams(max_tokens=120, temperature=0))
    joiners = [("the cat sat on the mat and", SamplingParams(max_tokens=5, temperature=0)),
               ("hello world", SamplingParams(max_tokens=7, temperature=1.0, seed=3))]
    alone = [run(eng.complete("tiny-lm-all", p, prompt=t)).token_ids for t, p in [long, *joiners]]

    async def together():
        first = asyncio.ensure_future(eng.complete("tiny-lm-all", long[1], prompt=long[0]))
        await _wait_for_forwards(eng, 3)
        before = eng.batch_sizes.counts[2]  # forwards of 3-4 rows
        later = await asyncio.gather(*(eng.complete("tiny-lm-all", p, prompt=t) for t, p in joiners))
        assert not first.done() and eng.batch_sizes.counts[2] > before  # they ran inside its batch
        return [(await first).token_ids] + [g.token_ids for g in later]

    assert run(together()) == alone


def test_a_long_generation_does_not_hold_up_a_classification(serving_store):
    root, _ = serving_store
    eng = Engine(ServeConfig(store=root))
    eng.bases["tiny-lm"].eos_ids = set()
    run(eng.classify("minilm-clf", ["resident from here on"]))  # the race is compute, not its decode

    async def race():
        gen = asyncio.ensure_future(eng.complete("tiny-lm", SamplingParams(max_tokens=200), prompt="a"))
        await _wait_for_forwards(eng, 2)
        await eng.classify("minilm-clf", ["a quick one"])
        return gen.done(), await gen

    done_first, gen = run(race())
    assert not done_first and len(gen.token_ids) == 200


def test_a_caller_that_leaves_stops_its_row(serving_store):
    root, _ = serving_store
    eng = Engine(ServeConfig(store=root))
    eng.bases["tiny-lm"].eos_ids = set()

    async def leave():
        deltas = eng.complete_stream("tiny-lm", SamplingParams(max_tokens=200), prompt="a")
        pieces = [await anext(deltas), await anext(deltas)]
        await deltas.aclose()
        await asyncio.wait_for(eng.scheduler._queue.join(), 10)  # the row is resolved: it left the batch
        return pieces

    async def cancel():
        task = asyncio.ensure_future(eng.complete("tiny-lm", SamplingParams(max_tokens=200), prompt="a"))
        await _wait_for_forwards(eng, 2)
        task.cancel()
        await asyncio.wait_for(eng.scheduler._queue.join(), 10)

    pieces = run(leave())
    assert all(p.text and p.final is None for p in pieces)
    assert not eng.scheduler._generations and eng.batch_sizes.count < 100
    run(cancel())
    assert not eng.scheduler._generations and eng.batch_sizes.count < 200


@pytest.mark.parametrize("lengths", [[5], [3, 50, 4, 48, 5, 120, 49], [10] * 7, list(range(1, 40))])
def test_length_buckets_cover_every_text_once_with_bounded_padding(lengths):
    from serve.engine.model import MAX_PADDING, length_buckets

    groups = length_buckets(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) * max(lengths[i] for i in g) <= (1 + MAX_PADDING) * sum(lengths[i] for i in g)
    if len(set(lengths)) == 1:
        assert len(groups) == 1  # equal lengths: one forward


def test_a_classifier_saved_with_default_labels_is_served_as_transformers_reads_it(serving_store, tmp_path):
    """transformers 5 saves a binary classifier with default labels without id2label: its labels are LABEL_0 and
    LABEL_1, as AutoConfig gives them, and it classifies."""
    import json
    import shutil

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from serve.data.models import minilm_dir
    from serve.store.store import Store
    from serve.variants.full import add_full_variant

    src, _ = serving_store
    root = tmp_path / "store"
    shutil.copytree(src, root)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(minilm_dir()).eval()  # num_labels: 2 by default
    model.save_pretrained(tmp_path / "binary")
    AutoTokenizer.from_pretrained(minilm_dir()).save_pretrained(tmp_path / "binary")
    assert "id2label" not in json.loads((tmp_path / "binary" / "config.json").read_text())
    entry, _ = add_full_variant(Store(root), "minilm-binary", "minilm", tmp_path / "binary")
    assert entry.labels == ["LABEL_0", "LABEL_1"]
    res = run(Engine(ServeConfig(store=root)).classify("minilm-binary", ["a fine day"]))
    tok = AutoTokenizer.from_pretrained(minilm_dir())
    with torch.no_grad():
        ref = model(**tok(["a fine day"], return_tensors="pt")).logits.softmax(-1)
    torch.testing.assert_close(torch.tensor(res.probs), ref, atol=1e-5, rtol=0)


def test_encoders_read_what_sentence_transformers_reads(engine):
    """all-MiniLM-L6-v2's sentence-transformers config says 256 tokens: longer inputs are cut there and counted,
    or refused when the request says truncate: false."""
    long = " ".join(["word"] * 400)
    out = run(engine.embed("minilm", [long, "short"]))
    assert out.prompt_tokens == 256 + 3 and out.truncated == 1
    res = run(engine.classify("minilm-clf", [long]))
    assert res.prompt_tokens == 256 and res.truncated == 1
    with pytest.raises(BadRequest, match="input 0: 402 tokens; model 'minilm' reads at most 256"):
        run(engine.embed("minilm", [long], truncate=False))


def test_embeddings_of_a_long_input_equal_sentence_transformers(engine):
    """The reference implementation of all-MiniLM-L6-v2 (its own modules.json, pooling and 256-token limit)."""
    from sentence_transformers import SentenceTransformer

    from serve.data.models import minilm_dir

    text = " ".join(f"word{i % 50} and more" for i in range(150))  # about 400 tokens
    reference = SentenceTransformer(str(minilm_dir()), device="cpu").encode([text, "a short one"],
                                                                           convert_to_tensor=True)
    out = torch.tensor(run(engine.embed("minilm", [text, "a short one"])).vectors)
    assert len(engine.bases["minilm"].tokenizer(text)["input_ids"]) >= 400
    cosine = torch.nn.functional.cosine_similarity(out, reference.float(), dim=-1)
    assert cosine.min() >= 0.9999, cosine


def test_a_decode_step_that_fails_while_admitting_rows_fails_them_too(serving_store, monkeypatch):
    """Rows a step was admitting are neither running nor pending while it runs: a failure must still answer them
    (they used to be lost, and their requests never returned)."""
    from serve.engine.generation.decode_batch import DecodeBatch

    engine = Engine(ServeConfig(store=serving_store[0]))
    calls = []

    def failing_run(self, new_rows, gone, park, victims, rank, share):
        calls.append(len(new_rows))
        raise RuntimeError("decode step failed")

    monkeypatch.setattr(DecodeBatch, "run", failing_run)

    async def both():
        params = SamplingParams(max_tokens=3, temperature=0)
        jobs = [engine.complete(m, params, prompt="one two three") for m in ("tiny-lm", "tiny-lm-top")]
        return await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), 120)  # a guard against a hang

    results = asyncio.run(both())
    assert calls and all(isinstance(r, RowFailed) and "decode step failed" in str(r) for r in results)
    assert [str(r).split(":")[0] for r in results] == ["model 'tiny-lm'", "model 'tiny-lm-top'"]
