"""The fault matrix: for each stage of serving and each kind, a fault injected there fails only the rows that
step touched, every request still gets an answer within a bound, every cache hold and slot ref comes back, and
the next requests are served exactly as before.

Every cell sends the same concurrent mixed load: a generation for each kind's model on a tiny Llama (and a tiny
Llama held in NeuZip form) and a classify or embed request for each kind's model on a tiny BERT, with the cache
emptied first so that loads and promotions happen inside the cell.
"""

import asyncio
from contextlib import ExitStack

import pytest
import torch

from serve.codecs import emr
from serve.codecs.neuzip_file import add_base, cast_to_bf16
from serve.config import ServeConfig
from serve.engine import faults
from serve.engine.engine import Engine
from serve.engine.types import Embeddings, SamplingParams
from serve.errors import ManyfoldError, RowFailed
from serve.store.store import Store
from serve.variants import variant_kind
from serve.variants.full import add_full_variant
from tests.models import write_lora, write_perturbed, write_tiny_bert, write_tiny_causal

CLASSES = ["neg", "pos", "other"]
KINDS = {  # kind: (its generation model, its encoder model)
    "base": ("lm", "enc"),
    "full": ("lm-full", "enc-full"),
    "lora": ("lm-lora", "enc-lora"),
    "pissa": ("lm-pissa", "enc-pissa"),
    "emr": ("lm-emr/t1", "enc-emr/a"),
    "neuzip": ("nz", "enc-nz"),
}
ENGINE_STAGES = [s for s in faults.STAGES if s != "report"]  # the replica's report: tests/deployments
NOT_CACHED = {("load", "base"), ("load", "neuzip"), ("promote", "base"), ("promote", "neuzip")}
"""A base is no cache entry: it is never loaded or promoted."""
ANSWER_BOUND_S = 120
"""A guard against a hang, far above what a cell takes: never a timing assertion."""
PARAMS = SamplingParams(max_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def store_root(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    lm, enc = write_tiny_causal(tmp / "lm"), write_tiny_bert(tmp / "enc")
    store = Store(tmp / "store", create=True)
    store.add_base("lm", lm)
    store.add_base("enc", enc)
    for src, name in ((lm, "nz"), (enc, "enc-nz")):
        copy = (write_tiny_causal if src == lm else write_tiny_bert)(tmp / f"{name}-src")
        cast_to_bf16(copy)
        add_base(store, name, copy, 7)
    add_full_variant(store, "lm-full", "lm", write_perturbed(lm, tmp / "lm-full", seed=1, scale=0.5))
    add_full_variant(store, "enc-full", "enc", write_perturbed(enc, tmp / "enc-full", seed=2, labels=CLASSES))
    for kind, seed in (("lora", 3), ("pissa", 4)):
        variant_kind(kind).add(store, f"lm-{kind}", "lm", write_lora(lm, tmp / f"lm-{kind}", seed=seed, r=4,
                                                                     targets=["q_proj", "v_proj"]))
        variant_kind(kind).add(store, f"enc-{kind}", "enc", write_lora(enc, tmp / f"enc-{kind}", seed=seed, r=4,
                                                                       targets=["query", "value"], classes=CLASSES))
    for group, src, tasks in (("lm-emr", lm, {"t1": {}, "t2": {"only": "layers.1."}}),
                              ("enc-emr", enc, {"a": {"labels": CLASSES}, "b": {"labels": CLASSES}})):
        fts = {t: write_perturbed(src, tmp / f"{group}-{t}", seed=10 + i, scale=0.5, **o)
               for i, (t, o) in enumerate(tasks.items())}
        variant_kind("emr").add(store, group, group.split("-")[0], emr.merge(src, fts, tmp / group).path)
    return store.root


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def engine(store_root, request):
    """The matrix on this machine's CPU, and on CUDA where there is one (Triton kernels, tier copies)."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    eng = Engine(ServeConfig(store=store_root, device=request.param))
    for rt in eng.bases.values():
        rt.eos_ids = set()  # every generation runs all its steps, so each stage meets every row
    return eng


async def _request(eng: Engine, model: str):
    if eng.bases[eng.catalog.snapshot.resolve(model)[0]].causal:
        return await eng.complete(model, PARAMS, prompt="the cat sat on the mat")
    if eng.catalog.snapshot.resolve(model)[1] is None:
        return await eng.embed(model, ["a quick brown fox", "jumps"])
    return await eng.classify(model, ["a quick brown fox", "jumps over the lazy dog"])


def mixed_load(eng: Engine) -> dict[str, object]:
    """Every kind's models at once -> model: its result, or the exception it got."""
    models = [m for pair in KINDS.values() for m in pair]

    async def together():
        got = asyncio.gather(*(_request(eng, m) for m in models), return_exceptions=True)
        return await asyncio.wait_for(got, ANSWER_BOUND_S)

    return dict(zip(models, asyncio.run(together())))


def _comparable(result) -> object:
    if isinstance(result, Embeddings):
        return [[round(x, 4) for x in v] for v in result.vectors]
    if hasattr(result, "token_ids"):
        return result.token_ids
    return result.labels, [[round(p, 4) for p in row] for row in result.probs]


@pytest.fixture(scope="module")
def reference(engine):
    results = mixed_load(engine)
    assert not [m for m, r in results.items() if isinstance(r, BaseException)], results
    return {m: _comparable(r) for m, r in results.items()}


def _cold(eng: Engine) -> None:
    for entry in list(eng.catalog.snapshot.manifest.variants.values()):
        eng.cache.drop(entry.key)


def _targets(kind: str) -> list[str]:
    return [m.split("/")[0] for m in KINDS[kind]]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("stage", ENGINE_STAGES)
def test_a_fault_fails_only_the_rows_it_touched_and_leaks_nothing(engine, reference, stage, kind):
    if (stage, kind) in NOT_CACHED:
        pytest.skip(f"a {kind} model is no cache entry: nothing to {stage}")
    _cold(engine)
    faults.hits.clear()
    # A failing close happens after a failed step (a sticky device error): both raise.
    with ExitStack() as armed:
        for s in ["decode", "close"] if stage == "close" else [stage]:
            armed.enter_context(faults.injected(s, *_targets(kind)))
        results = mixed_load(engine)  # every request answered, within the bound
    assert faults.hits.get(stage, 0) > 0, f"the {stage} fault never fired"
    for model, r in results.items():
        if isinstance(r, BaseException):
            assert isinstance(r, ManyfoldError), (model, repr(r))  # an answer, never a stray exception
            assert str(r).startswith(f"model '{model}': "), (model, str(r))  # names the model it failed
        else:
            assert _comparable(r) == reference[model], model
    failed = [m for m, r in results.items() if isinstance(r, RowFailed)]
    assert set(failed) & set(KINDS[kind]), f"no {kind} request failed at {stage}: {results}"
    assert engine.holds() == {}, "a cache hold or slot ref outlived its rows"
    after = mixed_load(engine)
    assert {m: _comparable(r) for m, r in after.items()} == reference
    assert engine.holds() == {}


def test_faults_cost_nothing_unarmed_and_name_their_stage():
    faults.hit("decode", ["anything"])  # unarmed: no effect
    with pytest.raises(ValueError, match="unknown stage 'decoding'"):
        with faults.injected("decoding"):
            pass
    with faults.injected("decode", "a"):
        faults.hit("decode", ["b"])
        with pytest.raises(faults.InjectedFault, match="injected fault at decode"):
            faults.hit("decode", ["b", "a"])
    faults.hit("decode", ["a"])
