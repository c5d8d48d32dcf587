"""device: cuda — the engine's base, slots, plans and heads live on the GPU and the LoRA and EMR ops run through
Triton; a batch mixing every kind answers as the CPU engine does, and a NeuZip base decodes on the GPU to exactly
the bf16 base's answers. Tiny models only (run with the device tool; tests/engine/test_faults.py runs its fault
matrix on CUDA there too)."""

import asyncio
import threading

import pytest
import torch

from serve.codecs import emr
from serve.codecs.neuzip_file import add_base, cast_to_bf16
from serve.config import ServeConfig
from serve.engine.engine import Engine
from serve.engine.types import SamplingParams
from serve.store.store import Store
from serve.variants import variant_kind
from tests.models import write_lora, write_perturbed, write_tiny_bert, write_tiny_causal

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
LABELS = ["a", "b", "c"]


@pytest.fixture(scope="module")
def store_root(tmp_path_factory):
    from serve.adapters.data import TextExample
    from serve.adapters.train import train_adapter

    root = tmp_path_factory.mktemp("cuda")
    store = Store(root / "store", create=True)
    lm, bert = write_tiny_causal(root / "lm"), write_tiny_bert(root / "bert")
    store.add_base("lm", lm)
    store.add_base("bert", bert)
    add = {k: variant_kind(k) for k in ("full", "lora", "pissa")}
    add["full"].add(store, "lm-top", "lm", write_perturbed(lm, root / "lm-top", seed=1, scale=0.5, only="layers.1."))
    add["lora"].add(store, "lm-lora", "lm", write_lora(lm, root / "lm-lora", seed=2, r=4, targets=["q_proj", "v_proj"]))
    add["lora"].add(store, "lm-lora8", "lm", write_lora(lm, root / "lm-lora8", seed=3, r=8,
                                                         targets=["up_proj", "down_proj", "o_proj"]))
    train_adapter(lm, [TextExample(text="the cat sat on the mat")] * 4, root / "lm-pissa", init="pissa", rank=4,
                  steps=2, lr=5e-2, batch_size=2, max_length=16, target_modules=["q_proj", "up_proj"])
    add["pissa"].add(store, "lm-pissa", "lm", root / "lm-pissa")
    add["full"].add(store, "bert-clf", "bert", write_perturbed(bert, root / "bert-clf", seed=4, labels=LABELS))
    add["lora"].add(store, "bert-lora", "bert", write_lora(bert, root / "bert-lora", seed=5, r=4,
                                                             targets=["query", "value"], classes=LABELS))
    for group, src, tasks in (("lm-emr", lm, {"t1": {}, "t2": {"only": "layers.1."}}),
                              ("bert-emr", bert, {"a": {"labels": LABELS}, "b": {"labels": LABELS}})):
        fts = {t: write_perturbed(src, root / f"{group}-{t}", seed=10 + i, scale=0.5, **o)
               for i, (t, o) in enumerate(tasks.items())}
        variant_kind("emr").add(store, group, group.split("-")[0], emr.merge(src, fts, root / group).path)
    bf16 = write_tiny_causal(root / "lm-bf16")
    cast_to_bf16(bf16)
    store.add_base("lm-bf16", bf16)
    add_base(store, "lm-nz", bf16, 7)
    for base in ("lm-bf16", "lm-nz"):
        add["lora"].add(store, f"{base}-lora", base, write_lora(bf16, root / f"{base}-lora", seed=6, r=4,
                                                                 targets=["q_proj", "down_proj"]))
    return store.root


def test_cuda_engine_serves_mixed_batches_as_the_cpu_engine(store_root):
    cpu, gpu = Engine(ServeConfig(store=store_root)), Engine(ServeConfig(store=store_root, device="cuda"))
    rows = [("lm", "the cat sat"), ("lm-lora", "a big red dog"), ("lm-top", "one two three"),
            ("lm-lora8", "hello world good"), ("lm-pissa", "sun moon star"), ("lm-lora", "fish eat and")]
    params = SamplingParams(max_tokens=8, temperature=0)

    async def serve(eng):
        gens = await asyncio.gather(*(eng.complete(m, params, prompt=p) for m, p in rows))
        clf = await asyncio.gather(*(eng.classify(m, ["the cat sat on the mat"]) for m in ("bert-clf", "bert-lora")))
        emb = await asyncio.gather(*(eng.embed(m, ["the dog ran"]) for m in ("bert", "bert-lora", "bert-clf")))
        return [g.token_ids for g in gens], clf, emb

    tokens_gpu, clf_gpu, emb_gpu = asyncio.run(serve(gpu))
    tokens_cpu, clf_cpu, emb_cpu = asyncio.run(serve(cpu))
    assert tokens_gpu == tokens_cpu
    for a, b in zip(clf_gpu, clf_cpu):
        torch.testing.assert_close(torch.tensor(a.probs), torch.tensor(b.probs), atol=1e-4, rtol=1e-4)
    for a, b in zip(emb_gpu, emb_cpu):
        torch.testing.assert_close(torch.tensor(a.vectors), torch.tensor(b.vectors), atol=1e-4, rtol=1e-4)
    stacks = [t for b in gpu.bases["lm"].families["lora"].buckets.values() for t in (*b.a.values(), *b.bt.values())]
    assert stacks and all(t.is_cuda for t in stacks)  # the adapters sat in the pool's device buckets
    assert len({tuple(t) for t in tokens_cpu}) >= 5  # the variants really differ


def test_cuda_emr_groups_in_a_mixed_batch_answer_as_the_cpu_engine(store_root):
    cpu, gpu = Engine(ServeConfig(store=store_root)), Engine(ServeConfig(store=store_root, device="cuda"))
    rows = [("lm-emr/t1", "the cat sat"), ("lm", "a big red dog"), ("lm-emr/t2", "one two three"),
            ("lm-lora", "hello world good"), ("lm-emr/t1", "sun moon star")]
    params = SamplingParams(max_tokens=8, temperature=0)

    async def serve(eng):
        gens = await asyncio.gather(*(eng.complete(m, params, prompt=p) for m, p in rows))
        clf = await asyncio.gather(*(eng.classify(m, ["the cat sat on the mat"])
                                     for m in ("bert-emr/a", "bert-clf", "bert-emr/b")))
        return [g.token_ids for g in gens], clf

    tokens_gpu, clf_gpu = asyncio.run(serve(gpu))
    tokens_cpu, clf_cpu = asyncio.run(serve(cpu))
    assert tokens_gpu == tokens_cpu
    for a, b in zip(clf_gpu, clf_cpu):
        torch.testing.assert_close(torch.tensor(a.probs), torch.tensor(b.probs), atol=1e-4, rtol=1e-4)
    assert gpu.holds() == {}


def test_a_neuzip_base_on_cuda_answers_as_its_bf16_base(store_root):
    gpu = Engine(ServeConfig(store=store_root, device="cuda"))
    params = SamplingParams(max_tokens=8, temperature=0)
    prompts = ["the cat sat", "a big red dog", "one two three"]

    async def serve(base):
        models = [base, f"{base}-lora", base]
        return [g.token_ids for g in await asyncio.gather(*(gpu.complete(m, params, prompt=p)
                                                            for m, p in zip(models, prompts)))]

    assert asyncio.run(serve("lm-nz")) == asyncio.run(serve("lm-bf16"))
    assert gpu.bases["lm-nz"].coded is not None and gpu.holds() == {}
    assert set(gpu.bases["lm-nz"].step_counts) == {"graphed"}  # its decode launches captured with the step


def _generate(eng: Engine, rows: list[tuple[str, str]], max_tokens: int = 8) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)

    async def serve():
        return [g.token_ids for g in await asyncio.gather(*(eng.complete(m, params, prompt=p) for m, p in rows))]

    return asyncio.run(serve())


def test_steps_replay_cuda_graphs_and_answer_as_eager_steps(store_root):
    """Base and adapter rows, prompts included, run through captured graphs (one per row and token bucket and pool
    layout); every token equals the eager engine's, and the graphs were replayed, not only captured."""
    graphed = Engine(ServeConfig(store=store_root, device="cuda"))
    eager = Engine(ServeConfig(store=store_root, device="cuda", engine={"cuda_graphs": "off"}))
    rt = graphed.bases["lm"]
    assert rt.graphs is not None and rt.graphs.captures > 0  # base graphs captured at start-up
    rows = [("lm", "the cat sat"), ("lm-lora", "a big red dog"), ("lm-lora8", "one two three"),
            ("lm-pissa", "hello world good"), ("lm", "sun moon star"), ("lm-lora", "fish eat and")]
    assert _generate(graphed, rows) == _generate(eager, rows)
    assert set(rt.step_counts) == {"graphed"} and rt.token_counts["prompt:graphed"] > 0
    assert eager.bases["lm"].step_counts["graphed"] == 0
    assert graphed.holds() == {}


def test_steps_with_full_and_emr_rows_replay_graphs_and_answer_as_the_cpu_engine(store_root):
    eng = Engine(ServeConfig(store=store_root, device="cuda"))
    rows = [("lm-top", "the cat sat"), ("lm-emr/t1", "a big red dog"), ("lm-lora", "one two three"),
            ("lm-emr/t2", "sun moon star"), ("lm-top", "fish eat and")]
    cpu = Engine(ServeConfig(store=store_root))
    assert _generate(eng, rows) == _generate(cpu, rows)
    assert set(eng.bases["lm"].step_counts) == {"graphed"}


def test_a_pool_that_grows_recaptures_and_keeps_every_answer(store_root):
    """New adapters grow the pool's stacks (new addresses): the next step captures again instead of replaying a
    graph that reads the old ones."""
    eng = Engine(ServeConfig(store=store_root, device="cuda"))
    eager = Engine(ServeConfig(store=store_root, device="cuda", engine={"cuda_graphs": "off"}))
    pool = eng.bases["lm"].families["lora"]
    first = _generate(eng, [("lm-lora", "the cat sat")])
    version = pool.version
    rows = [("lm-lora", "the cat sat"), ("lm-lora8", "a big red dog"), ("lm-pissa", "one two three")]
    assert _generate(eng, rows) == _generate(eager, rows)
    assert pool.version != version and first == _generate(eager, [("lm-lora", "the cat sat")])


def test_a_capture_holds_while_another_thread_allocates_and_copies_onto_the_device(store_root):
    """The cache's copier moves variants onto the device on its own thread while the compute thread may be capturing
    a step: here, inside the first capture, another thread allocates a new segment and copies into it (events order
    it). The capture holds and the step answers as the eager engine; a step that failed so was seen on an H200."""
    eng = Engine(ServeConfig(store=store_root, device="cuda"))
    eager = Engine(ServeConfig(store=store_root, device="cuda", engine={"cuda_graphs": "off"}))
    model = eng.bases["lm"].model
    capturing, copied, errors = threading.Event(), threading.Event(), []
    original = model.forward

    def forward(*args, **kwargs):
        if torch.cuda.is_current_stream_capturing() and not capturing.is_set():
            capturing.set()
            assert copied.wait(60), "the other thread's copy did not finish"
        return original(*args, **kwargs)

    def copy():
        try:
            if capturing.wait(60):
                host = torch.ones(1 << 28, dtype=torch.uint8, pin_memory=True)
                torch.empty((1 << 30) + (1 << 28), dtype=torch.uint8, device="cuda")[: 1 << 28].copy_(host)
        except Exception as e:  # kept for the assertion below, which names it
            errors.append(e)
        finally:
            copied.set()

    model.forward = forward
    other = threading.Thread(target=copy)
    other.start()
    rows = [("lm-lora", "the cat sat"), ("lm-pissa", "a big red dog"), ("lm", "one two three")]
    try:
        assert _generate(eng, rows) == _generate(eager, rows)
    finally:
        capturing.set()
        other.join()
    assert not errors and set(eng.bases["lm"].step_counts) == {"graphed"}


def test_every_kinds_log_probabilities_on_cuda_pass_against_transformers_in_fp32(tmp_path):
    """`manyfold bench logprobs` on a tiny model: base, LoRA on all seven linears at mixed ranks, PiSSA, full, EMR
    tasks and NeuZip k=7 and k=3 through graphed steps, against transformers in fp32 (vLLM's rule)."""
    from serve.bench.logprobs_check import run_logprobs_check

    report = run_logprobs_check(tmp_path / "out.json", tmp_path / "work", "cuda", "tiny", rows=2, new_tokens=8)
    assert report["passed"], report["kinds"]
    assert all(set(by) == {"graphed"} for by in report["steps"].values())


def test_rows_under_controls_and_grammars_on_cuda_graphs_answer_as_the_cpu_engine(store_root):
    """Sampling metadata and a grammar's bitmask (xgrammar's kernel on CUDA) applied to a graphed step's logits:
    every kind's rows, greedy and seeded, each under its own controls, give the CPU engine's tokens, and every
    step still replays its graph."""
    from serve.engine.types import Constraint

    cpu, gpu = Engine(ServeConfig(store=store_root)), Engine(ServeConfig(store=store_root, device="cuda"))
    choice = Constraint("choice", '["cat", "dog", "sun"]')
    rows = [("lm", SamplingParams(max_tokens=6, repetition_penalty=1.5)),
            ("lm-lora", SamplingParams(max_tokens=6, temperature=0.8, top_k=5, seed=3)),
            ("lm-top", SamplingParams(max_tokens=6, logit_bias=((9, 5.0),), min_tokens=3)),
            ("lm-emr/t1", SamplingParams(max_tokens=6, constraint=choice)),
            ("lm-pissa", SamplingParams(max_tokens=6, temperature=1.0, seed=4, constraint=choice))]

    async def serve(eng):
        gens = await asyncio.gather(*(eng.complete(m, p, prompt="the cat sat") for m, p in rows))
        return [g.token_ids for g in gens]

    assert asyncio.run(serve(gpu)) == asyncio.run(serve(cpu))
    assert set(gpu.bases["lm"].step_counts) == {"graphed"}
