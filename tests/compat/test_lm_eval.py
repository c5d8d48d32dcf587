"""lm-evaluation-harness's `local-completions` model against a live Manyfold (Ray Serve on loopback), with the
harness's defaults (token-id prompts, batches of 4): a multiple-choice task's per-choice loglikelihoods equal
transformers' within 1e-3 and a generate_until task's answers are identical, for the base and a variant.

`make compat` installs the harness (the `compat` extra) and runs this; without it these tests are skipped."""

import json

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
pytestmark = [pytest.mark.slow, pytest.mark.compat]

MC = [  # the tiny Llama's vocabulary is these words
    {"question": "the cat sat on the", "choices": ["mat", "sea", "book pen"], "answer": 0},
    {"question": "one two three", "choices": ["four", "ten", "what where"], "answer": 0},
    {"question": "the sun and the", "choices": ["moon", "dog ran", "fish"], "answer": 0},
    {"question": "hello", "choices": ["world", "good day", "night"], "answer": 0},
    {"question": "a big red", "choices": ["dog", "house", "tree"], "answer": 0},
]
GEN = [{"prompt": p, "answer": "x"} for p in ("the cat sat", "one two", "hello world", "a big red dog and",
                                              "what is the", "sea fish bird")]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    d = tmp_path_factory.mktemp("tasks")
    (d / "mc.jsonl").write_text("".join(json.dumps(x) + "\n" for x in MC))
    (d / "gen.jsonl").write_text("".join(json.dumps(x) + "\n" for x in GEN))
    (d / "manyfold_mc.yaml").write_text(f"""task: manyfold_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    (d / "manyfold_gen.yaml").write_text(f"""task: manyfold_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["sleep"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return d


@pytest.mark.parametrize("model", ["tiny-lm", "tiny-lm-all"])
def test_harness_scores_equal_transformers(server, tasks, model, monkeypatch):
    from lm_eval.tasks import TaskManager

    from tests.test_server import KEY

    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # the harness sends it as a bearer token
    from transformers import AutoModelForCausalLM, AutoTokenizer

    url, refs, _ = server
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model={model},base_url={url}/v1/completions,tokenizer={refs['tiny-lm']},"
                   f"tokenizer_backend=huggingface,max_retries=1,max_length=256",
        tasks=["manyfold_mc", "manyfold_gen"], batch_size=4, task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True)
    ref = AutoModelForCausalLM.from_pretrained(refs[model]).eval()
    tok = AutoTokenizer.from_pretrained(refs["tiny-lm"])

    def loglikelihood(context: str, continuation: str) -> float:
        ctx, cont = tok(context)["input_ids"], tok(continuation)["input_ids"]
        with torch.no_grad():
            lp = torch.log_softmax(ref(input_ids=torch.tensor([ctx + cont])).logits[0].float(), -1)
        return sum(float(lp[len(ctx) + i - 1, t]) for i, t in enumerate(cont))

    samples = out["samples"]["manyfold_mc"]
    assert len(samples) == len(MC)
    for s in samples:
        for (context, continuation), resp in zip((a for a in s["arguments"]), s["resps"]):
            assert abs(resp[0][0] - loglikelihood(context, continuation)) < 1e-3, (context, continuation)
    for s in out["samples"]["manyfold_gen"]:
        ids = tok(s["doc"]["prompt"])["input_ids"]
        with torch.no_grad():
            gen = ref.generate(input_ids=torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)
        new = gen[0, len(ids):].tolist()
        new = new[:new.index(2)] if 2 in new else new  # up to the end-of-text token
        whole, before = (tok.decode(x, skip_special_tokens=True) for x in (ids + new, ids))
        text = whole[len(before):].split("sleep")[0]  # the continuation of the prompt, cut at `until`
        assert s["resps"][0][0] == text, s["doc"]["prompt"]
