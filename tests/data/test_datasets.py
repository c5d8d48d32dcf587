import pytest

from serve.data import datasets


@pytest.mark.parametrize("name,labels", [("topic", ["business", "entertainment", "politics", "sports", "tech"]),
                                         ("sentiment", ["negative", "neutral", "positive"]),
                                         ("spam", ["ham", "spam"])])
def test_packaged_corpora_have_disjoint_fixed_splits(name, labels):
    load = datasets.CLASSIFICATION[name]
    train, test = load("train"), load("test")
    assert train.labels == labels
    assert len(test.examples) > 200 and len(train.examples) > 3 * len(test.examples)
    assert not {e.text for e in train.examples} & {e.text for e in test.examples}
    assert {e.label for e in test.examples} == set(labels)
    assert load("test").examples == test.examples  # stable across calls


def test_fortunes_are_plain_quotes():
    train = datasets.fortunes("train")
    test = datasets.fortunes("test")
    assert len(train) > 5000 and len(test) > 1000
    assert not set(train) & set(test)
    assert all("\n%\n" not in q and q.strip() == q for q in train[:500])
