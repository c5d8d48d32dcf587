"""A base served in NeuZip form plugs into the same per-row forward: rows of the base, adapters and full
variants on a lossless NeuZip base give exactly what they give on the uncompressed bf16 base, and a full
variant of a lossy base still decodes exactly."""

import asyncio

import pytest
import torch

from serve.codecs import neuzip
from serve.codecs.neuzip_file import NEUZIP_FILE, add_base, cast_to_bf16
from serve.config import ServeConfig
from serve.engine.step.batch import BASE_ROW, BatchPlan
from serve.engine.engine import Engine
from serve.engine.types import SamplingParams
from serve.errors import ArtifactError
from serve.store.store import Store
from serve.variants import variant_kind
from tests.forwards import forward_rows
from tests.models import write_lora, write_perturbed, write_tiny_bert, write_tiny_causal

CLASSES = ["neg", "pos", "other"]
LM_BASES = {"lm": None, "lm-nz": 7, "lm-k3": 3, "lm-nz64": 7}  # name: NeuZip bits (None: uncompressed)
LANES = {"lm-nz64": 64}
"""Bases written with lanes of other than neuzip.LANE symbols (as `--neuzip-lane` writes them for a GPU)."""
ENC_BASES = {"enc": None, "enc-nz": 7}
LM_MODELS = ["", "-lora", "-top", "-all", "-lora", ""]  # suffixes of each base's models, one row each
PROMPTS = ["the cat sat on", "a big red dog", "one two three four", "the dog ran to", "hello world good day",
           "sun moon star sky"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One store: a tiny Llama and a tiny BERT (bf16), each stored plain and in NeuZip form, each form with the
    same LoRA adapter and full variants. -> (store root, the fine-tunes' directories)."""
    from serve.variants.full import add_full_variant

    tmp = tmp_path_factory.mktemp("neuzip")
    lm, enc = write_tiny_causal(tmp / "lm"), write_tiny_bert(tmp / "enc")
    dirs = {"lm": lm, "enc": enc,
            "lm-top": write_perturbed(lm, tmp / "lm-top", seed=1, scale=0.5, only="layers.1."),
            "lm-all": write_perturbed(lm, tmp / "lm-all", seed=2, scale=0.5),
            "enc-clf": write_perturbed(enc, tmp / "enc-clf", seed=3, labels=CLASSES)}
    for d in dirs.values():
        cast_to_bf16(d)
    dirs["lm-lora"] = write_lora(lm, tmp / "lm-lora", seed=4, r=4, targets=["q_proj", "v_proj", "down_proj"])
    dirs["enc-lora-clf"] = write_lora(enc, tmp / "enc-lora-clf", seed=5, r=4, targets=["query", "value"],
                                      classes=CLASSES)
    store = Store(tmp / "store", create=True)
    for bases, src in ((LM_BASES, lm), (ENC_BASES, enc)):
        for name, bits in bases.items():
            if bits is None:
                store.add_base(name, src)
            else:
                add_base(store, name, src, bits, lane=LANES.get(name, neuzip.LANE))
    for base in LM_BASES:
        add_full_variant(store, f"{base}-top", base, dirs["lm-top"])
        add_full_variant(store, f"{base}-all", base, dirs["lm-all"])
        variant_kind("lora").add(store, f"{base}-lora", base, dirs["lm-lora"])
    for base in ENC_BASES:
        add_full_variant(store, f"{base}-clf", base, dirs["enc-clf"])
        variant_kind("lora").add(store, f"{base}-lora-clf", base, dirs["enc-lora-clf"])
    return store.root, dirs


@pytest.fixture(scope="module")
def engine(served):
    return Engine(ServeConfig(store=served[0]))


def mixed_logits(engine: Engine, base: str) -> torch.Tensor:
    """Rows of the base, an adapter and two full variants of `base` in one forward: [rows, seq, vocab]."""
    rt = engine.bases[base]
    models = [base + s for s in LM_MODELS]
    ids = torch.tensor([rt.prompts.encode(p) for p in PROMPTS])  # equal lengths: no padding
    return forward_rows(engine, base, models, ids)


def test_a_lossless_neuzip_base_gives_the_uncompressed_bases_logits_exactly(engine):
    assert engine.bases["lm-nz"].coded is not None and engine.bases["lm"].coded is None
    plain, coded = mixed_logits(engine, "lm"), mixed_logits(engine, "lm-nz")
    assert torch.equal(plain, coded)
    assert not torch.equal(plain[0], plain[1])  # the rows' variants really differ


def test_a_base_written_with_short_lanes_gives_the_same_logits(engine):
    streams = engine.bases["lm-nz64"].coded.streams.values()
    assert streams and all(s.offsets.numel() - 1 == -(-s.numel // 64) > 1 for s in streams)
    assert torch.equal(mixed_logits(engine, "lm"), mixed_logits(engine, "lm-nz64"))


def test_a_lossy_base_serves_its_full_variants_exactly(engine):
    """Every tensor of "-all" is its own (decoded against the stored lossless base): its rows equal the plain
    base's exactly, while the base's own rows run on the 3-bit weights."""
    plain, lossy = mixed_logits(engine, "lm"), mixed_logits(engine, "lm-k3")
    assert torch.equal(plain[3], lossy[3])
    assert not torch.equal(plain[0], lossy[0])


def test_generation_on_a_neuzip_base_equals_the_uncompressed_base(engine):
    params = SamplingParams(max_tokens=8, temperature=0)

    async def together(base):
        return await asyncio.gather(*(engine.complete(base + s, params, prompt=p) for s, p in zip(LM_MODELS, PROMPTS)))

    assert [g.token_ids for g in asyncio.run(together("lm-nz"))] == [g.token_ids for g in asyncio.run(together("lm"))]


def test_classify_and_embeddings_on_a_neuzip_encoder_equal_the_uncompressed_encoder(engine):
    texts = ["the cat sat on the mat", "good day", "red moon and blue sky", "what a bad night"]

    async def run(base):
        probs = await asyncio.gather(*(engine.classify(f"{base}{s}", [t]) for s, t in
                                       zip(["-clf", "-lora-clf", "-clf", "-lora-clf"], texts)))
        vecs = await asyncio.gather(*(engine.embed(m, [t]) for m, t in zip([base, f"{base}-clf", base], texts)))
        return [p.probs for p in probs], [v.vectors for v in vecs]

    assert asyncio.run(run("enc")) == asyncio.run(run("enc-nz"))


def test_a_decoded_layer_budget_keeps_weights_decoded_and_changes_no_output(served):
    eng = Engine(ServeConfig(store=served[0], neuzip_decoded_mib=1), bases=["lm", "lm-nz"])
    coded = eng.bases["lm-nz"].coded
    assert coded.kept and not coded.streams  # a tiny model fits in 1 MiB
    assert coded.nbytes == 0  # kept weights hold no stream beside them, and nothing needs the buffer
    assert torch.equal(mixed_logits(eng, "lm-nz"), mixed_logits(eng, "lm"))


def test_auto_keeps_decoded_what_the_memory_target_leaves_and_says_so(served):
    """A target far above what the replica holds keeps every weight decoded; one below it keeps none; both give
    the plain base's logits, and the plan reaches the Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    from serve.metrics import Metrics

    config = {"store": served[0], "neuzip_decoded_mib": "auto", "batch": {"max_batch_size": 2}}
    roomy = Engine(ServeConfig(**config, deployment={"memory_target_mib": 1 << 20}), bases=["lm", "lm-nz"])
    coded, plan = roomy.bases["lm-nz"].coded, roomy.memory_plan
    assert not coded.streams and plan.decoded == coded.decoded_size > 0
    assert plan.working > 0 and plan.resident > 0
    assert plan.free == plan.target - plan.resident - plan.working - plan.reserved
    tight = Engine(ServeConfig(**config), bases=["lm", "lm-nz"], memory_target=1 << 20)  # the replica's Ray memory
    assert tight.memory_plan.free == 0 and not tight.bases["lm-nz"].coded.kept
    assert torch.equal(mixed_logits(roomy, "lm-nz"), mixed_logits(tight, "lm-nz"))
    assert torch.equal(mixed_logits(tight, "lm-nz"), mixed_logits(tight, "lm"))
    text = Metrics().render([asyncio.run(roomy.snapshot())], []).decode()
    parts = {s.labels["part"]: s.value for f in text_string_to_metric_families(text)
             if f.name == "manyfold_memory_plan_bytes" for s in f.samples}
    assert parts["decoded"] == plan.decoded and parts["target"] == plan.target == 2 << 40  # each base's target
    weights = {s.labels["base"]: s.value for f in text_string_to_metric_families(text)
               if f.name == "manyfold_base_weight_bytes" for s in f.samples}
    assert weights == {"lm": roomy.bases["lm"].nbytes, "lm-nz": roomy.bases["lm-nz"].nbytes}


def test_auto_without_a_memory_target_is_one_line(served):
    from serve.errors import ConfigError

    with pytest.raises(ConfigError, match="memory_target_mib") as e:
        Engine(ServeConfig(store=served[0], neuzip_decoded_mib="auto"), bases=["lm-nz"])
    assert "\n" not in str(e.value)


def test_keep_decodes_weights_in_model_order_while_they_fit(served):
    eng = Engine(ServeConfig(store=served[0]), bases=["lm", "lm-nz"])
    coded = eng.bases["lm-nz"].coded
    sizes = {n: 2 * s.numel for n, s in coded.streams.items()}
    first, second = list(sizes)[:2]
    budget = sizes[first] + sizes[second] - 1  # the first fits, the second no longer does
    kept = coded.keep(budget)
    fits = [n for n in sizes if n != first and sizes[n] <= budget - sizes[first]]
    assert first in coded.kept and second not in coded.kept
    assert set(coded.kept) <= {first, *fits} and kept == sum(sizes[n] for n in coded.kept) <= budget
    assert torch.equal(mixed_logits(eng, "lm-nz"), mixed_logits(eng, "lm"))


def test_a_corrupt_neuzip_base_fails_with_one_line_and_other_bases_still_load(served, tmp_path):
    import shutil

    root = tmp_path / "store"
    shutil.copytree(served[0], root)
    nzp = root / "bases" / "lm-nz" / NEUZIP_FILE
    data = bytearray(nzp.read_bytes())
    data[-200] ^= 0xFF
    nzp.write_bytes(bytes(data))
    with pytest.raises(ArtifactError) as e:
        Engine(ServeConfig(store=root), bases=["lm-nz"])
    assert "\n" not in str(e.value) and "lm-nz" in str(e.value)
    Engine(ServeConfig(store=root), bases=["lm", "enc-nz"])


def _neuzip_copy(src, dst):
    """A copy of the model directory src with its weights cast to bf16 and, beside them, NEUZIP_FILE (lossless),
    as a store holds a NeuZip base."""
    import shutil

    from serve.codecs.neuzip_file import encode_dir

    shutil.copytree(src, dst)
    encode_dir(dst, 7, keep_weights=True)
    return dst


def test_a_gpt2_whose_embedding_names_say_nothing_loads_and_gives_the_bf16_logits(tmp_path):
    """GPT-2 calls its tables wte and wpe, so the file codes them like matrices; the loader holds them decoded
    (a forward reads a few rows) and decodes only Conv1D / Linear weights on use."""
    from transformers import AutoModelForCausalLM

    from serve.codecs.neuzip_file import NzpFile
    from serve.engine.model import BaseModelRuntime
    from tests.models import write_tiny_gpt2

    nz = _neuzip_copy(write_tiny_gpt2(tmp_path / "gpt2"), tmp_path / "gpt2-nz")
    nzp = NzpFile(nz / NEUZIP_FILE)
    assert nzp.records["transformer.wte.weight"].codec == "neuzip"
    rt = BaseModelRuntime("gpt2-nz", nz)
    assert rt.coded.streams and not any("wte" in n or "wpe" in n for n in rt.coded.streams)
    ref = AutoModelForCausalLM.from_pretrained(nz).eval()  # the bf16 weights beside the coded ones
    ids = torch.tensor([[3, 5, 7, 9], [4, 6, 8, 10]])
    with torch.no_grad():
        assert torch.equal(rt.call(BatchPlan([BASE_ROW] * 2), input_ids=ids).logits, ref(input_ids=ids).logits)


def test_a_forward_that_raises_puts_every_placeholder_back(tmp_path):
    from serve.engine.model import BaseModelRuntime

    nz = _neuzip_copy(write_tiny_causal(tmp_path / "lm"), tmp_path / "lm-nz")
    rt = BaseModelRuntime("lm-nz", nz)
    ids = torch.tensor([[3, 5, 7, 9]])
    plan = BatchPlan([BASE_ROW], rt.device)
    with torch.no_grad():
        before = rt.call(plan, input_ids=ids).logits
        mlp = rt.model.model.layers[1].mlp.down_proj
        handle = mlp.register_forward_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):
            rt.call(plan, input_ids=ids)
        handle.remove()
        assert all(rt.view.modules[m].weight.is_meta for m in rt.coded.placeholders)
        assert torch.equal(rt.call(plan, input_ids=ids).logits, before)


def test_a_file_whose_shapes_disagree_with_the_config_is_one_line_naming_the_tensor(tmp_path):
    import json

    from serve.engine.model import BaseModelRuntime

    nz = _neuzip_copy(write_tiny_causal(tmp_path / "lm"), tmp_path / "lm-nz")
    config = json.loads((nz / "config.json").read_text())
    config["intermediate_size"] += 8
    (nz / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArtifactError, match=r"tensor '.*mlp.*' has shape \[") as e:
        BaseModelRuntime("lm-nz", nz)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_real_smollm2_as_a_lossless_neuzip_base_equals_the_bf16_model(tmp_path):
    """SmolLM2-135M (cast to bf16) served in NeuZip form: logits of a batch and greedy chat tokens equal
    transformers running the bf16 model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from serve.data.models import smollm2_dir

    store = Store(tmp_path / "store", create=True)
    _, stats, cast = add_base(store, "smollm2-nz", smollm2_dir(), 7)
    assert cast and stats.coded_ratio < 0.68
    engine = Engine(ServeConfig(store=store.root))
    rt = engine.bases["smollm2-nz"]
    bf16_dir = store.base_dir("smollm2-nz")  # the lossless bf16 weights, kept beside the coded ones
    ref = AutoModelForCausalLM.from_pretrained(bf16_dir).eval()
    tok = AutoTokenizer.from_pretrained(bf16_dir)
    assert ref.dtype == torch.bfloat16
    ids = tok(["The weather today is", "The sky at night"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(rt.call(BatchPlan([BASE_ROW, BASE_ROW], rt.device), input_ids=ids).logits, ref(input_ids=ids).logits)
    messages = [{"role": "user", "content": "Tell me something wise."}]
    gen = asyncio.run(engine.complete("smollm2-nz", SamplingParams(max_tokens=12, temperature=0), messages=messages))
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = ref.generate(**enc, max_new_tokens=12, do_sample=False)[0, enc["input_ids"].shape[1]:].tolist()
    eos = ref.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    assert gen.token_ids == out[: next((i for i, t in enumerate(out) if t in eos), len(out))]


def test_decoding_ahead_gives_inline_decodings_logits_even_when_the_next_module_was_guessed_wrong(tmp_path):
    """Short forwards decode the next weight on a decode thread (when torch has two threads to share); a module
    run out of the learned order is decoded on the spot, and every output stays bit for bit the inline one."""
    from safetensors.torch import load_file

    from serve.engine.model import BaseModelRuntime

    nz = _neuzip_copy(write_tiny_causal(tmp_path / "lm"), tmp_path / "lm-nz")
    rt = BaseModelRuntime("lm-nz", nz)
    decoder = rt.coded.decoder
    ids = torch.tensor([[3, 5, 7, 9], [4, 6, 8, 10]])
    plan = BatchPlan([BASE_ROW, BASE_ROW], rt.device)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.no_grad():
            decoder.way = "inline"
            inline = rt.call(plan, input_ids=ids).logits
            decoder.way = "ahead"
            assert torch.equal(rt.call(plan, input_ids=ids).logits, inline)  # learns the order
            x = torch.randn(3, rt.model.config.intermediate_size, dtype=torch.bfloat16)
            down = rt.model.model.layers[1].mlp.down_proj
            with decoder.forward(tokens=1):
                assert decoder.ahead and torch.get_num_threads() == 1
                out_of_order = down(x)  # the decode thread is decoding layer 0's first weight meanwhile
            assert torch.get_num_threads() == 2 and rt.view.modules["model.layers.1.mlp.down_proj"].weight.is_meta
            bf16 = load_file(nz / "model.safetensors")["model.layers.1.mlp.down_proj.weight"]
            assert torch.equal(out_of_order, torch.nn.functional.linear(x, bf16))
            assert torch.equal(rt.call(plan, input_ids=ids).logits, inline)
    finally:
        torch.set_num_threads(threads)


def test_coded_weights_come_in_the_models_order_not_the_files(tmp_path):
    """A GPU decodes neighbours in one launch, so the streams follow the model (layers 0, 1, 2, ... 11 and q, k, v,
    o, gate, up, down in each), not the file's order by name (layers.1, layers.10, ...; mlp before self_attn)."""
    from transformers import AutoModelForCausalLM

    from serve.codecs.neuzip_file import NzpFile, compress_dir
    from serve.engine.neuzip.coded import load_model

    lm = write_tiny_causal(tmp_path / "lm", layers=12)
    compress_dir(lm, 7, tmp_path / "nz")
    model, streams = load_model(AutoModelForCausalLM, tmp_path / "nz", NzpFile(tmp_path / "nz" / NEUZIP_FILE),
                                torch.device("cpu"))
    order = [n for n, _ in model.named_parameters(remove_duplicate=False) if n in streams]
    assert list(streams) == order and len(order) == 12 * 7
    assert order[:2] == ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"]
