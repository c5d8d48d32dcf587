"""A generation step as the GPU runs it, checked on the CPU: the KV cache is read no further than its rows' blocks
and written in place, a step's operations and
shapes do not depend on which adapters, full fine-tunes or EMR tasks its rows run, steps replayed from static
inputs (prompt chunks and every kind of row included) give the tokens eager steps give, and any schedule of
admissions, finishes and cancellations gives every request the tokens it gives alone."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from serve.config import BatchConfig, StructuredOutputsConfig
from serve.engine.step.batch import BatchPlan
from serve.engine.generation.decode_batch import DecodeBatch
from serve.engine.generation.row import NewRow
from serve.engine.step.graphs import StepGraphs, _Graph
from serve.engine.model import BaseModelRuntime
from serve.engine.step.layout import row_bucket
from serve.engine.types import SamplingParams
from serve.variants.base import LoadedVariant
from tests.models import random_emr_group, random_lora, write_tiny_causal

TARGETS = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def rt(tmp_path_factory) -> BaseModelRuntime:
    rt = BaseModelRuntime("tiny", write_tiny_causal(tmp_path_factory.mktemp("steps") / "m"),
                          batch=BatchConfig(max_batch_size=8, max_step_tokens=7, max_model_len=64))
    rt.eos_ids = set()  # every row runs to its max_tokens
    return rt


def lora(rt: BaseModelRuntime, name: str, rank: int, seed: int) -> LoadedVariant:
    return random_lora(rt, name, rank, seed, TARGETS, scale=1.0)


def full(rt: BaseModelRuntime, name: str, seed: int) -> LoadedVariant:
    g = torch.Generator().manual_seed(seed)
    tensors = {k: t + torch.randn(t.shape, generator=g) * 0.3 for k, t in rt.view.tensors.items() if "layers.1." in k}
    return LoadedVariant(name, "full", "weights", tensors)


class Recorder(TorchDispatchMode):
    """Every operation of the block: its name, the shapes it took and gave, and the storages it read."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        self.ops.append((str(func), [tuple(t.shape) for t in ins], [tuple(t.shape) for t in outs], ins, outs))
        return out


def decode_step_ops(rt: BaseModelRuntime, variants: list) -> list[tuple]:
    """The operations of one decode step of rows of these variants (None: the base), after their prefill: every row
    admitted in one step (a budget that holds their prompts), so that they decode at the same positions."""
    batch, budget = DecodeBatch(rt), rt.max_step_tokens
    rt.max_step_tokens = 64
    try:
        assert not left_waiting(batch, [NewRow(i, [3 + i, 5, 7], SamplingParams(max_tokens=20), v)
                                        for i, v in enumerate(variants)])
        while batch.prefilling:
            batch.run([])
        with Recorder() as rec:
            batch.run([])
        return rec.ops
    finally:
        rt.max_step_tokens = budget
        batch.close()


def left_waiting(batch: DecodeBatch, rows: list[NewRow]) -> list[NewRow]:
    """One call with `rows` new: those it left waiting (no room in the step's token budget, a lane or blocks),
    which a caller passes again, as the scheduler does."""
    step = batch.run(rows)
    assert not step.failed
    return [r for r in rows if r.tag in step.waiting]


def shapes_of(ops: list[tuple]) -> list[tuple]:
    return [(name, ins, outs) for name, ins, outs, _, _ in ops]


def test_a_decode_step_reads_only_its_rows_blocks_and_its_operations_do_not_depend_on_the_adapters(rt):
    """The CPU's twin gathers what it attends over (the rows' blocks up to the longest row: one block each here);
    the cache itself is never copied, and every layer's keys and values are written in place once."""
    rt.use_fixed_shapes(True)  # as on CUDA: row buckets, the adapter pool's per-token maps
    try:
        a, b, c = lora(rt, "a", 4, 1), lora(rt, "b", 8, 2), lora(rt, "c", 4, 3)
        decode_step_ops(rt, [a, b, c])  # all three in the pool: its stacks stay where they are from here on
        version = rt.families["lora"].version
        first = decode_step_ops(rt, [a, None, b, a])
        second = decode_step_ops(rt, [c, c, None, b])
        third = decode_step_ops(rt, [b, a, c])  # three rows: the same bucket of four
        assert rt.families["lora"].version == version  # (a graph captured for the first replays the others)
    finally:
        rt.use_fixed_shapes(False)
    assert shapes_of(first) == shapes_of(second) == shapes_of(third)
    stores = {t.untyped_storage().data_ptr() for layer in rt.kv.layers for t in (layer.keys, layer.values)}
    _, block, kv_heads, dim = rt.kv.layers[0].keys.shape
    rows_blocks = 4 * block * kv_heads * dim  # the bucket's four rows, a block each
    assert rows_blocks * 8 < rt.kv.layers[0].keys.numel()
    writes = 0
    for name, _, _, ins, outs in first:
        reads_store = any(t.untyped_storage().data_ptr() in stores for t in ins)
        for o in outs if reads_store else ():
            if o.untyped_storage().data_ptr() in stores:
                continue  # a view of the store, or the store written in place
            assert o.numel() <= rows_blocks, f"{name} read the cache beyond the rows' blocks: {list(o.shape)}"
        if reads_store and "index_put" in name:
            writes += 1
        # the twins' one read of the cache is index_select of the rows' blocks, bounded above; nothing else copies it
        assert not (reads_store and any(k in name for k in ("cat", "clone", "copy", "gather"))), name
    assert writes == 2 * len(rt.kv.layers)  # each layer's keys and values, written in place once


def test_a_decode_steps_operations_are_the_same_for_any_mix_of_full_fine_tunes_emr_tasks_and_adapters(rt):
    """Rows of one bucket over the same kinds, but other variants, other counts of distinct fine-tunes and tasks,
    in other places: the same operations on the same shapes, so one graph replays them all and no step runs a
    loop over its rows or its variants."""
    a, b = lora(rt, "a", 4, 1), lora(rt, "b", 8, 2)
    f1, f2 = full(rt, "f1", 3), full(rt, "f2", 4)
    t0, t1, t2 = random_emr_group(rt, "g", 3, 5)
    rt.use_fixed_shapes(True)
    try:
        decode_step_ops(rt, [a, b, f1, f2, t0, t1, t2])  # every variant in its pool: no stack moves from here on
        versions = {f: rt.families[f].version for f in ("lora", "weights", "emr:g")}
        mixes = [[a, f1, t0, None, a, f1, t0, None],  # one fine-tune, one task, one adapter
                 [f2, t2, b, f1, t1, a, None, t0],  # two fine-tunes, three tasks, two adapters
                 [t1, t1, f2, b, None, f2, b, t1]]  # one task, twice the other fine-tune
        ops = [decode_step_ops(rt, mix) for mix in mixes]
        assert {f: rt.families[f].version for f in versions} == versions
    finally:
        rt.use_fixed_shapes(False)
    assert shapes_of(ops[0]) == shapes_of(ops[1]) == shapes_of(ops[2])
    assert rt.slot_refs() == {}


def test_fixed_shapes_give_every_kind_the_log_probabilities_of_the_cpu_forms(rt):
    """The pools' stacks, per-token maps and padded token buckets (CUDA's forms, their torch twins here) against
    what a CPU runs (the cache's tensors, formed EMR weights, steps as long as their rows): the same tokens and log
    probabilities for rows of every kind, in one batch, prompts in several chunks."""
    a = lora(rt, "a", 4, 1)
    f1, f2 = full(rt, "f1", 3), full(rt, "f2", 4)
    t0, t1 = random_emr_group(rt, "g", 2, 5)
    params = SamplingParams(max_tokens=5, logprobs=1)
    rows = [NewRow(i, [(5 * i + j) % 40 + 3 for j in range(3 + i)], params, v)
            for i, v in enumerate([None, a, f1, t0, f2, t1, f1])]

    def generate() -> dict:
        batch, got, waiting = DecodeBatch(rt), {}, list(rows)
        while waiting or len(batch):
            step = batch.run(waiting)
            waiting = [r for r in waiting if r.tag in step.waiting]
            got.update(step.finished)
        batch.close()
        return got

    cpu = generate()
    rt.use_fixed_shapes(True)
    try:
        fixed = generate()
    finally:
        rt.use_fixed_shapes(False)
    assert len({tuple(g.token_ids) for g in cpu.values()}) >= 5  # the kinds really differ from the base and each other
    for tag, want in cpu.items():
        got = fixed[tag]
        assert got.token_ids == want.token_ids, tag
        assert [lp.logprob for lp in got.logprobs] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)


def test_row_buckets():
    assert [row_bucket(n, 64) for n in (1, 2, 3, 5, 8, 9, 17, 33, 64)] == [1, 2, 4, 8, 8, 16, 24, 40, 64]
    assert row_bucket(70, 200) == 80 and row_bucket(30, 20) == 20


REQUESTS = st.lists(st.tuples(st.integers(1, 12), st.integers(1, 6), st.sampled_from(["base", "a", "b", "f", "e"])),
                    min_size=1, max_size=7)
"""Each request: prompt length, max_tokens, variant."""


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=REQUESTS, arrivals=st.lists(st.integers(0, 3), min_size=7, max_size=7),
       cancels=st.lists(st.booleans(), min_size=7, max_size=7), parks=st.lists(st.booleans(), min_size=7, max_size=7),
       fixed=st.booleans())
def test_any_schedule_gives_every_request_the_tokens_it_gives_alone(rt, requests, arrivals, cancels, parks, fixed):
    """Requests arrive at random steps (several in one, prefills cut by a 7-token budget), some are cancelled
    mid-flight, some parked (preempted) and resumed two steps later at whatever slot is free, slots are reused;
    every request that finishes gives the greedy tokens it gives alone."""
    variants = {"base": None, "a": lora(rt, "a", 4, 1), "b": lora(rt, "b", 8, 2), "f": full(rt, "f", 3),
                "e": random_emr_group(rt, "g", 2, 5)[1]}
    rows = [NewRow(i, [(7 * i + j) % 40 + 3 for j in range(n)], SamplingParams(max_tokens=m), variants[v])
            for i, (n, m, v) in enumerate(requests)]
    rt.use_fixed_shapes(fixed)
    try:
        alone = {}
        for r in rows:
            batch = DecodeBatch(rt)
            while r.tag not in alone:
                step = batch.run([r] if not batch and r.tag not in alone else [])
                alone.update(step.finished)
        batch, waiting, got, step_no = DecodeBatch(rt), list(rows), {}, 0
        cancelled, parked = set(), []
        while waiting or len(batch) or parked:
            due = [r for r in waiting if arrivals[r.tag % len(arrivals)] <= step_no]
            waiting = [r for r in waiting if r not in due]
            gone = [r.tag for r in rows if cancels[r.tag % len(cancels)] and r.tag not in got
                    and r.tag not in cancelled and step_no == 2 and r not in waiting + due]
            cancelled.update(gone)
            park = [r.tag for r in rows if parks[r.tag % len(parks)] and step_no == 3]
            if step_no == 5:
                due, parked = due + parked, []
            step = batch.run(due, gone, park)
            parked += [r for r in rows if r.tag in step.parked]
            waiting = [r for r in rows if r.tag in step.waiting] + waiting
            assert not step.failed
            got.update(step.finished)
            step_no += 1
            assert step_no < 200
        batch.close()
        assert rt.kv.free_lanes == rt.kv.lanes and rt.kv.pool.used == 0 and rt.slot_refs() == {} and not batch.parked
    finally:
        rt.use_fixed_shapes(False)
    for tag, gen in got.items():
        if tag not in cancelled:
            assert gen.token_ids == alone[tag].token_ids, tag


class EagerGraphs(StepGraphs):
    """StepGraphs whose 'capture' is a closure running the step eagerly from the same static inputs: the graph
    bookkeeping, the steps launched from the last one's tokens (continue_) and the batch's step in flight, on a
    CPU. A captured kernel reads the adapter pool's maps from their buffers; eagerly, the plan prepared last. A
    real graph replayed after its families' tensors moved reads freed memory: here it fails."""

    def __init__(self, rt):
        super().__init__(rt)
        self.prepared: BatchPlan | None = None
        self.continued = 0

    def run(self, inputs, plan):
        self.prepared = plan
        return super().run(inputs, plan)

    def continue_(self, g, tokens):
        self.continued += 1
        super().continue_(g, tokens)

    def _capture(self, key, plan, inputs, packed):
        rt = self.rt
        static = packed.clone()
        ids, positions, kept, layout = inputs.layout(static, rt.kv.positions)
        logits = torch.empty(len(inputs.kept or inputs.ids), rt.model.config.vocab_size)

        def replay():
            assert self._versions(key[2]) == key[3:], "a graph replayed after its families' tensors moved"
            with rt.corrections.planned(self.prepared):
                out = rt.model(input_ids=ids, position_ids=positions, past_key_values=rt.kv.stepping(layout),
                               use_cache=True, kv_layout=layout, logits_to_keep=0 if kept is None else kept)
            logits.copy_(out.logits[0].float())

        self.captures += 1
        self.graphs[key] = g = _Graph(replay, static, logits, key)
        g.replay()
        return g


def test_steps_replayed_from_static_inputs_give_every_row_the_tokens_of_eager_steps(rt):
    """With graphs, prompt chunks included, each call reads one step while the next runs; rows of the base, of
    adapters, of full fine-tunes and of EMR tasks, finishing at different steps and joining mid-flight (their
    prompts beside running rows), give the tokens they give with every step run eagerly and read at once; so does
    a row parked while a step is in flight and resumed later."""
    a, b = lora(rt, "a", 4, 1), lora(rt, "b", 8, 2)
    f = full(rt, "f", 3)
    t0, t1 = random_emr_group(rt, "g", 2, 5)
    first = [NewRow(i, [3 + i, 5, 7, 9][: 1 + i % 4], SamplingParams(max_tokens=3 + 2 * i), v)
             for i, v in enumerate([None, a, f, t0, b])]
    later = [NewRow(10 + i, [4, 6 + i, 8, 2, 5][: 2 + i], SamplingParams(max_tokens=4 + i, temperature=0.8, seed=i), v)
             for i, v in enumerate([t1, None, f])]

    def generate(park: bool = False) -> tuple[dict, list]:
        """park: the last of `first` parked at the eighth call (a step in flight then) and resumed at the ninth."""
        batch, got, calls, parked = DecodeBatch(rt), {}, 0, []
        waiting = left_waiting(batch, first)
        while len(batch) or parked or waiting:
            calls += 1
            new = waiting + (later if calls == 3 else parked if calls == 9 else [])
            in_flight = batch.inflight is not None
            step = batch.run(new, park=[first[-1].tag] if park and calls == 8 else [])
            assert not park or calls != 8 or (step.parked == [first[-1].tag] and in_flight)
            parked = [first[-1]] if step.parked else [] if calls == 9 else parked
            waiting = [r for r in new if r.tag in step.waiting]  # asked again each call, as the scheduler does
            assert not step.failed
            got.update(step.finished)
        batch.close()
        return {t: g.token_ids for t, g in got.items()}, dict(rt.step_counts), dict(rt.token_counts)

    rt.use_fixed_shapes(True)
    try:
        eager, _, _ = generate()
        rt.graphs = graphs = EagerGraphs(rt)
        rt.step_counts.clear()
        rt.token_counts.clear()
        graphed, steps, tokens = generate()
        continued = graphs.continued
        parked_once, _, _ = generate(park=True)
    finally:
        rt.graphs = None
        rt.use_fixed_shapes(False)
    assert graphed == eager and len(graphed) == 8
    assert set(steps) == {"graphed"}  # prompt chunks and every kind of row: no step ran eagerly
    assert tokens["prompt:graphed"] == sum(len(r.prompt) for r in first + later)
    assert continued > 3  # steps launched from the last one's tokens, read a call later
    assert parked_once == eager  # a row parked while a step was in flight resumes as if it had never left
    assert rt.kv.free_lanes == rt.kv.lanes and rt.kv.pool.used == 0 and rt.slot_refs() == {}


def test_a_row_waiting_for_a_kv_lane_stages_nothing_and_the_graphs_continuation_goes_on(tmp_path):
    """Two KV lanes, both running LoRA rows launched step after step from the last one's tokens; a third row of
    another adapter arrives with no lane free: it waits without attaching (its adapter is not written into the
    pool, whose stacks would move under the graph in flight), the steps go on being continued, and once a lane is
    free it runs; every row gets the tokens of eager steps."""
    rt = BaseModelRuntime("tiny", write_tiny_causal(tmp_path / "m"),
                          batch=BatchConfig(max_batch_size=2, max_step_tokens=20, max_model_len=64))
    rt.eos_ids = set()
    a, b, c = (lora(rt, name, 4, seed) for name, seed in (("a", 1), ("b", 2), ("c", 3)))
    pool = rt.families["lora"]

    def generate() -> tuple[dict, list[int], list[int]]:
        batch, got, calls, moved, waited = DecodeBatch(rt), {}, 0, [], []
        batch.run([NewRow(0, [3, 5, 7], SamplingParams(max_tokens=12), a),
                   NewRow(1, [4, 6], SamplingParams(max_tokens=12), b)])
        waiting = []
        while len(batch) or waiting:
            calls += 1
            new = [NewRow(2, [8, 9], SamplingParams(max_tokens=3), c)] if calls == 4 else waiting
            before = pool.version
            step = batch.run(new)
            moved += [calls] if step.waiting == [2] and pool.version != before else []
            waited += [calls] if step.waiting == [2] else []
            waiting = [r for r in new if r.tag in step.waiting]  # asked again each step, as the scheduler does
            got.update({t: g.token_ids for t, g in step.finished})
            assert calls < 100
        batch.close()
        return got, moved, waited

    rt.use_fixed_shapes(True)
    rt.graphs = graphs = EagerGraphs(rt)
    graphed, moved, waited = generate()
    rt.graphs = None
    eager, _, _ = generate()
    assert waited[0] == 4 and moved == [] and graphs.continued > 3  # c waited, and attached nothing meanwhile
    assert graphed == eager and len(graphed) == 3


def choice_grammar(rt: BaseModelRuntime, words: list[str]):
    """A grammar of one or more of the words (compiled as a request's would be), and the ids they take."""
    from serve.engine.generation.grammars import Grammars
    from serve.engine.types import Constraint

    grammar = " ".join(f'"{w}"' for w in words[:1]) + "".join(f' | "{w}"' for w in words[1:])
    grammars = Grammars(lambda: rt.tokenizer, rt.model.config.vocab_size, rt.eos_ids, StructuredOutputsConfig(),
                        ThreadPoolExecutor(1))
    compiled = asyncio.run(grammars.compile(Constraint("grammar", f"root ::= ({grammar})+"), "t"))
    return compiled, {rt.tokenizer.convert_tokens_to_ids(w) for w in words}


CONTROLLED = [SamplingParams(max_tokens=7, repetition_penalty=1.8),
              SamplingParams(max_tokens=6, temperature=0.9, top_k=5, seed=11),
              SamplingParams(max_tokens=5, logit_bias=((9, 6.0), (12, -50.0))),
              SamplingParams(max_tokens=8, temperature=0.7, top_p=0.5, min_p=0.1, frequency_penalty=1.2,
                             presence_penalty=0.3, seed=12),
              SamplingParams(max_tokens=6, min_tokens=4, stop_token_ids=(10, 11, 13)),
              SamplingParams(max_tokens=6),
              SamplingParams(max_tokens=6, temperature=1.2, seed=13)]
"""Rows' controls; the last two are constrained by a grammar too."""


@pytest.mark.parametrize("graphed", [False, True])
def test_rows_of_every_kind_each_under_its_own_controls_give_the_tokens_each_gives_alone(rt, graphed):
    """One step holds the base, adapters, a full fine-tune and EMR tasks, each row under other sampling controls
    (penalties, bias, top-k/top-p/min-p with seeds, min_tokens with stop tokens, a grammar): every row gets the
    tokens it gets alone, eagerly and from replayed graphs (every step still replayed), and a constrained row takes
    only its grammar's tokens."""
    variants = [None, lora(rt, "a", 4, 1), full(rt, "f", 3), *random_emr_group(rt, "g", 2, 5), lora(rt, "b", 8, 2),
                None]
    compiled, allowed = choice_grammar(rt, ["cat", "dog", "sat"])
    rows = [NewRow(i, [3 + i, 5, 7, 9 - i], p, v, compiled if i >= 5 else None)
            for i, (p, v) in enumerate(zip(CONTROLLED, variants))]

    def run(batch_rows: list[NewRow]) -> dict:
        batch, got, waiting = DecodeBatch(rt), {}, list(batch_rows)
        while waiting or len(batch):
            step = batch.run(waiting)
            waiting = [r for r in waiting if r.tag in step.waiting]
            assert not step.failed, step.failed
            got.update({t: g.token_ids for t, g in step.finished})
        batch.close()
        return got

    rt.use_fixed_shapes(graphed)
    rt.graphs = EagerGraphs(rt) if graphed else None
    rt.step_counts.clear()
    try:
        alone = {t: v for r in rows for t, v in run([r]).items()}
        together = run(rows)
    finally:
        rt.graphs = None
        rt.use_fixed_shapes(False)
    assert together == alone and len(together) == len(rows)
    assert set(rt.step_counts) == ({"graphed"} if graphed else {"eager:cpu"})  # controls and masks keep the graph
    for t in (5, 6):  # the grammar's words, then perhaps its end (an end token that ends nothing here: eos_ids)
        assert set(together[t][:-1]) <= allowed and together[t][-1] in allowed | {rt.tokenizer.eos_token_id}
    assert not set(together[4][:4]) & {10, 11, 13}  # min_tokens holds the stop tokens back
