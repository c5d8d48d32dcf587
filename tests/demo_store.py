"""The demo store in miniature: the real demo's three bases (MiniLM, SmolLM2, SmolLM2 as NeuZip) and one variant of
each kind the demo trains (a MiniLM classifier, a SmolLM2 top-layer fine-tune, a PiSSA adapter), each a step or two
on the real packaged data. Built once a session (tests/conftest.py, `demo_store`): the demo's training tests read
it, and its serving tests serve it."""

from pathlib import Path

from serve.demo import AdapterTask, DemoTask, LmTask, build_demo_store
from serve.store.store import Store

CLASSIFIER = DemoTask("minilm-spam", "spam", 32, 32)
TOP_LAYERS = LmTask("smollm2-fortunes", "fortunes", steps=1, top_layers=1, max_len=32)
ADAPTER = AdapterTask("smollm2-spam-pissa", "spam", 8, steps=1, max_length=32)


def build_small_demo_store(root: Path, log=lambda m: None) -> Store:
    return build_demo_store(root, tasks=(CLASSIFIER,), lm_tasks=(TOP_LAYERS,), adapter_tasks=(ADAPTER,),
                            emr_groups=(), log=log)
