"""Training data for adapters: a strict, bounded JSONL reader and the tokenisation into input_ids / labels.

Each line is `{"prompt": str, "completion": str}` (loss on the completion only) or `{"text": str}` (loss on
every token). The first bad line stops the read with one line naming the file and the line number.
"""

import json
from pathlib import Path
from typing import Annotated, Any

import torch
from pydantic import Field, ValidationError

from serve.errors import ConfigError, first_error
from serve.store.manifest import StrictModel

MAX_LINES = 100_000
"""Examples in one file at most: a fine-tuning set, not a pretraining corpus."""
MAX_LINE_BYTES = 1 << 20
"""Longest line read (1 MiB); a line is truncated to max_length tokens anyway."""
IGNORE = -100
"""Label of tokens that carry no loss (the prompt and padding), as torch's cross_entropy ignores it."""

Text = Annotated[str, Field(min_length=1)]


class PromptExample(StrictModel):
    prompt: Text
    """Conditioning text: fed to the model, never scored."""
    completion: Text
    """What the model learns to write after the prompt; the tokenizer's eos is appended."""


class TextExample(StrictModel):
    text: Text
    """Scored on every token (language modelling); the tokenizer's eos is appended."""


TrainExample = PromptExample | TextExample


def parse_example(obj: Any) -> TrainExample:
    """One decoded JSON value -> an example; the model is picked by key so errors name the missing field."""
    if isinstance(obj, dict) and "text" in obj:
        return TextExample.model_validate(obj)
    if isinstance(obj, dict):
        return PromptExample.model_validate(obj)
    raise ValueError(f"expected a JSON object, got {type(obj).__name__}")  # not a ValidationError: no field


def read_jsonl(path: str | Path, max_lines: int = MAX_LINES) -> list[TrainExample]:
    """Every example of a JSONL training file; blank lines are skipped, anything else malformed is an error."""
    path = Path(path)
    examples: list[TrainExample] = []
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read training data ({e.strerror})") from e
    with f:
        for lineno, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if len(raw) > MAX_LINE_BYTES:
                raise ConfigError(f"{path}:{lineno}: line longer than {MAX_LINE_BYTES} bytes")
            if not raw.strip():
                continue
            if len(examples) == max_lines:
                raise ConfigError(f"{path}:{lineno}: more than {max_lines} examples")
            try:
                examples.append(parse_example(json.loads(raw.rstrip(b"\r\n").decode("utf-8"))))
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not UTF-8 (byte {e.start + 1})") from e
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from e
            except ValidationError as e:
                raise ConfigError(f"{path}:{lineno}: {first_error(e)}") from e
            except ValueError as e:
                raise ConfigError(f"{path}:{lineno}: {e}") from e
    if not examples:
        raise ConfigError(f"{path}: no training examples")
    return examples


def tokenize_example(tokenizer, example: TrainExample, max_length: int) -> dict[str, list[int]]:
    """input_ids and labels of one example, at most max_length tokens, eos appended.

    A prompt is cut from the left when prompt + completion do not fit: the completion and the end of the
    prompt just before it are what the loss needs. Plain text is cut from the right.
    """
    eos = [tokenizer.eos_token_id]
    if isinstance(example, TextExample):
        ids = (tokenizer(example.text, add_special_tokens=True)["input_ids"] + eos)[:max_length]
        return {"input_ids": ids, "labels": list(ids)}
    prompt = tokenizer(example.prompt, add_special_tokens=True)["input_ids"]
    completion = (tokenizer(example.completion, add_special_tokens=False)["input_ids"] + eos)[:max_length]
    room = max_length - len(completion)
    prompt = prompt[max(0, len(prompt) - room):] if room > 0 else []
    return {"input_ids": prompt + completion, "labels": [IGNORE] * len(prompt) + completion}


def tokenize_examples(tokenizer, examples: list[TrainExample], max_length: int) -> list[dict[str, list[int]]]:
    if max_length < 2:
        raise ConfigError(f"max_length must be >= 2, got {max_length}")
    return [tokenize_example(tokenizer, e, max_length) for e in examples]


def collate(features: list[dict[str, list[int]]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch: padding gets attention_mask 0 and label IGNORE (pad may equal eos, which is scored)."""
    width = max(len(f["input_ids"]) for f in features)
    input_ids = torch.full((len(features), width), pad_token_id, dtype=torch.long)  # [batch, width]
    labels = torch.full((len(features), width), IGNORE, dtype=torch.long)  # [batch, width]
    attention_mask = torch.zeros((len(features), width), dtype=torch.long)  # [batch, width]
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        input_ids[i, :n] = torch.tensor(f["input_ids"])
        labels[i, :n] = torch.tensor(f["labels"])
        attention_mask[i, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
