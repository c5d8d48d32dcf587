"""serve/adapters/data.py and tasks.py: strict JSONL reading, prompt masking, truncation, padding, task sets."""

import json

import pytest

from serve.adapters import data
from serve.adapters.data import IGNORE, PromptExample, TextExample, collate, read_jsonl, tokenize_examples
from serve.adapters.tasks import LABEL_TASKS, heldout_examples, task_examples, write_task_jsonl
from serve.errors import ConfigError
from tests.models import write_tiny_causal


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(write_tiny_causal(tmp_path_factory.mktemp("tiny")))


def write_lines(path, lines: list[str]):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_reads_both_shapes_and_skips_blank_lines(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"prompt": "a", "completion": "b"}), "  ",
                                               json.dumps({"text": "the cat"})])
    assert read_jsonl(path) == [PromptExample(prompt="a", completion="b"), TextExample(text="the cat")]


def test_prompt_tokens_are_masked_and_eos_appended(tok):
    [f] = tokenize_examples(tok, [PromptExample(prompt="what is the sky", completion="blue")], 32)
    ids = tok("what is the sky")["input_ids"]
    assert f["input_ids"] == ids + [tok.convert_tokens_to_ids("blue"), tok.eos_token_id]
    assert f["labels"] == [IGNORE] * len(ids) + f["input_ids"][len(ids):]


def test_text_is_scored_on_every_token(tok):
    [f] = tokenize_examples(tok, [TextExample(text="the cat sat")], 32)
    assert f["labels"] == f["input_ids"] and f["input_ids"][-1] == tok.eos_token_id


def test_long_prompt_is_cut_from_the_left_and_the_completion_kept(tok):
    [f] = tokenize_examples(tok, [PromptExample(prompt="one two three four five six", completion="yes")], 4)
    assert tok.convert_ids_to_tokens(f["input_ids"]) == ["five", "six", "yes", "</s>"]
    assert f["labels"][:2] == [IGNORE, IGNORE]


def test_collate_pads_right_with_ignored_labels(tok):
    feats = tokenize_examples(tok, [TextExample(text="the cat sat"), TextExample(text="dog")], 32)
    batch = collate(feats, pad_token_id=tok.pad_token_id)
    assert batch["input_ids"].shape == (2, 4)
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["labels"][1].tolist()[2:] == [IGNORE, IGNORE]
    assert batch["input_ids"][1].tolist()[2:] == [tok.pad_token_id] * 2


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "a"', r"d\.jsonl:2: not valid JSON \(Expecting ',' delimiter at column 15\)$"),
    ('{"prompt": "a"}', r"d\.jsonl:2: completion: Field required$"),
    ('{"text": "a", "label": 1}', r"d\.jsonl:2: label: Extra inputs are not permitted$"),
    ('{"prompt": "a", "completion": 3}', r"d\.jsonl:2: completion: Input should be a valid string$"),
    ('{"text": ""}', r"d\.jsonl:2: text: String should have at least 1 character$"),
    ('["the cat"]', r"d\.jsonl:2: expected a JSON object, got list$"),
])
def test_bad_line_is_one_line_error_with_its_number(tmp_path, line, message):
    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"text": "ok"}), line])
    with pytest.raises(ConfigError, match=message) as e:
        read_jsonl(path)
    assert "\n" not in str(e.value)


def test_non_utf8_line_names_its_number(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ConfigError, match=r"d\.jsonl:2: not UTF-8 \(byte 14\)$"):
        read_jsonl(path)


def test_reader_is_bounded(tmp_path, monkeypatch):
    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"text": "ok"})] * 3)
    with pytest.raises(ConfigError, match=r"d\.jsonl:3: more than 2 examples$"):
        read_jsonl(path, max_lines=2)
    monkeypatch.setattr(data, "MAX_LINE_BYTES", 10)
    with pytest.raises(ConfigError, match=r"d\.jsonl:1: line longer than 10 bytes$"):
        read_jsonl(path)


def test_empty_or_missing_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"e\.jsonl: no training examples$"):
        read_jsonl(write_lines(tmp_path / "e.jsonl", []))
    with pytest.raises(ConfigError, match=r"nope\.jsonl: cannot read training data"):
        read_jsonl(tmp_path / "nope.jsonl")


@pytest.mark.parametrize("name", ["fortunes", "headlines", "spam", "tweets", "topics", "sentiment"])
def test_task_sets_are_fixed_and_hold_out_the_test_split(name, tmp_path):
    n = write_task_jsonl(name, tmp_path / "t.jsonl", 6)
    train = read_jsonl(tmp_path / "t.jsonl")
    assert n == len(train) == 6 and train == task_examples(name, "train", 6) == task_examples(name, "train")[:6]
    source = [(e.text if isinstance(e, TextExample) else e.prompt) for e in heldout_examples(name)]
    assert source and not set(source) & {(e.text if isinstance(e, TextExample) else e.prompt)
                                          for e in task_examples(name, "train")}


def test_task_prompts_have_their_shape():
    headline = task_examples("headlines", n=1)[0]
    assert headline.prompt.startswith("Article: ") and headline.prompt.endswith("\nHeadline:")
    assert headline.completion.startswith(" ") and len(headline.completion.split()) < 20
    spam = task_examples("spam", n=4)
    assert [e.completion for e in spam] == [" yes", " no", " yes", " no"]
    assert all(e.prompt.startswith("Is this message spam? ") and e.prompt.endswith("\nAnswer:") for e in spam)
    tweets = task_examples("tweets", n=4)
    assert all(len(e.prompt.split()) == 8 and e.completion.startswith(" ") and len(e.completion.split()) >= 4
               for e in tweets)
    with pytest.raises(ConfigError, match=r"unknown adapter task 'poems'; known: fortunes, headlines, spam, tweets, "
                                          r"topics, sentiment$"):
        task_examples("poems")


@pytest.mark.parametrize("name, prompt, labels", [
    ("topics", ("Article: ", "\nTopic:"), [" business", " entertainment", " politics", " sports", " tech"]),
    ("sentiment", ("Tweet: ", "\nSentiment:"), [" negative", " neutral", " positive"])])
def test_label_tasks_take_their_labels_in_turn_in_both_splits(name, prompt, labels):
    """Balanced: a model that answers one label to everything scores 1 / labels on the bench's held-out set."""
    for examples in (task_examples(name, "train", 128), heldout_examples(name, 100)):
        k = len(labels)
        assert [e.completion for e in examples[:2 * k]] == labels * 2
        counts = [sum(e.completion == label for e in examples) for label in labels]
        assert max(counts) - min(counts) <= 1 and len(examples) in (128, 100)
        assert all(e.prompt.startswith(prompt[0]) and e.prompt.endswith(prompt[1]) for e in examples)
    assert name in LABEL_TASKS
