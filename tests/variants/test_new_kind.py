"""A variant kind defined in this file alone (a bias added to one Linear) registers its manifest entry, its kind
and its correction family, is stored, read back from disk, loaded through the variant cache, and served in one
forward beside rows of the base, a full variant and a LoRA adapter, and over HTTP: no other file knows of it."""

import shutil
from pathlib import Path
from typing import Literal

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from serve.config import ServeConfig, SlotsConfig
from serve.engine.step.batch import BatchPlan
from serve.engine.engine import Engine
from serve.engine.families.slots import FAMILIES, Slots, register_family
from serve.errors import VariantIncompatible
from serve.http.app import build_http_app
from serve.store.manifest import VariantEntryBase, register_entry, unregister_entry
from serve.store.store import Store
from serve.store.tensors import Alloc, SafetensorsSource
from serve.variants import VARIANT_KINDS, variant_kind
from serve.variants.base import BaseView, LoadedVariant, Progress, VariantKind, register_variant
from serve.variants.full import add_full_variant
from tests.forwards import forward_rows
from tests.models import write_lora, write_perturbed, write_tiny_causal

BIAS_FILE = "bias.safetensors"
MODULE = "model.layers.0.mlp.down_proj"


class BiasEntry(VariantEntryBase):
    kind: Literal["bias"] = "bias"
    module: str
    """The Linear it adds its bias to."""


class BiasSlots(Slots):
    """Family "bias": a slot per attached variant; its rows get y += b in the one module it names."""

    family = "bias"

    def __init__(self, base: BaseView, device: torch.device, config: SlotsConfig, family: str = "bias"):
        super().__init__(base, device)
        self.variants: dict[int, LoadedVariant] = {}
        self.refs: dict[int, int] = {}

    @property
    def in_use(self) -> int:
        return sum(self.refs.values())

    def attach(self, variant: LoadedVariant) -> int:
        slot = next((s for s, v in self.variants.items() if v is variant), None)
        if slot is None:
            slot = max(self.variants, default=-1) + 1
            self.variants[slot] = variant
        self.refs[slot] = self.refs.get(slot, 0) + 1
        return slot

    def detach(self, slot: int) -> None:
        self.refs[slot] -= 1
        if not self.refs[slot]:
            del self.refs[slot], self.variants[slot]

    def retire(self, key: str) -> None:
        """Slots hold a variant only while its rows run: nothing to free."""

    def touches(self, name: str, plan: BatchPlan) -> bool:
        return any(name in self.variants[slot].tensors for slot in plan.slot_set(self.family))

    def apply(self, name: str, module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
              plan: BatchPlan) -> torch.Tensor:
        for slot, tokens in plan.groups(self.family, y.shape[0]):
            bias = self.variants[slot].tensors.get(name)
            if bias is not None:
                y[tokens] = y[tokens] + bias  # [n, out] + [out]
        return y


class BiasKind(VariantKind):
    kind = "bias"
    family = "bias"
    help = "a bias added to one Linear of the base (bias.safetensors: one tensor named after the module)"

    def add(self, store: Store, name: str, base: str, path: Path, progress: Progress | None = None,
            slots: SlotsConfig = SlotsConfig()) -> BiasEntry:
        (module, bias), = load_file(path / BIAS_FILE).items()
        out = SafetensorsSource(store.base_dir(base))[f"{module}.weight"].shape[0]
        if bias.shape != (out,):
            raise VariantIncompatible(f"bias of '{module}' is {list(bias.shape)}; the module gives [{out}]")
        with store.stage() as staged:
            shutil.copy2(path / BIAS_FILE, staged / BIAS_FILE)
            entry = BiasEntry(name=name, base=base, architecture=store.base(base).architecture,
                              raw_bytes=bias.numel() * bias.element_size(), files=[], module=module)
            return store.commit(staged, entry)

    def load(self, store: Store, entry: BiasEntry, base: BaseView, alloc: Alloc) -> LoadedVariant:
        bias = load_file(store.variant_dir(entry.name) / BIAS_FILE)[entry.module]
        return LoadedVariant(entry.name, self.kind, self.family, {entry.module: bias})


@pytest.fixture(scope="module")
def bias_kind():
    register_entry(BiasEntry)
    register_family(BiasSlots)
    register_variant(BiasKind())
    yield
    unregister_entry("bias")
    del FAMILIES["bias"], VARIANT_KINDS["bias"]


@pytest.fixture(scope="module")
def store(bias_kind, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("new-kind")
    lm = write_tiny_causal(tmp / "lm")
    store = Store(tmp / "store", create=True)
    store.add_base("lm", lm)
    add_full_variant(store, "lm-full", "lm", write_perturbed(lm, tmp / "full", seed=1, scale=0.5))
    variant_kind("lora").add(store, "lm-lora", "lm", write_lora(lm, tmp / "lora", seed=2, r=4,
                                                                 targets=["q_proj", "v_proj"]))
    (tmp / "bias").mkdir()
    bias = torch.randn(32, generator=torch.Generator().manual_seed(3))  # [out]
    save_file({MODULE: bias}, tmp / "bias" / BIAS_FILE)
    variant_kind("bias").add(store, "lm-bias", "lm", tmp / "bias")
    return store.root, {"lm": lm, "lm-full": tmp / "full", "bias": bias}


def reference_logits(model_dir: Path, ids: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    if bias is not None:
        model.get_submodule(MODULE).register_forward_hook(lambda m, args, y: y + bias)
    with torch.no_grad():
        return model(input_ids=ids).logits[0]


def test_a_kind_defined_in_one_file_serves_in_a_mixed_forward(store):
    root, refs = store
    assert type(Store(root).variant("lm-bias")).__name__ == "BiasEntry"  # read back from the manifest on disk
    engine = Engine(ServeConfig(store=root))
    rt = engine.bases["lm"]
    rows = ["lm", "lm-bias", "lm-full", "lm-lora", "lm-bias"]
    ids = torch.tensor([rt.prompts.encode("the cat sat on the mat")] * len(rows))
    logits = forward_rows(engine, "lm", rows, ids)  # [rows, seq, vocab]
    expected = {"lm": reference_logits(refs["lm"], ids[:1]),
                "lm-bias": reference_logits(refs["lm"], ids[:1], refs["bias"]),
                "lm-full": reference_logits(refs["lm-full"], ids[:1])}
    for i, model in enumerate(rows):
        if model in expected:
            torch.testing.assert_close(logits[i], expected[model], atol=1e-4, rtol=1e-4, msg=f"row {i} ({model})")
    assert not torch.allclose(logits[0], logits[1]) and not torch.allclose(logits[1], logits[3])
    assert engine.holds() == {}


def test_a_kind_defined_in_one_file_is_served_over_http(store):
    root, _ = store
    config = ServeConfig(store=root)
    body = {"prompt": "the cat sat on", "max_tokens": 4, "temperature": 0}
    with TestClient(build_http_app(Engine(config), config)) as c:
        cards = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        answers = {m: c.post("/v1/completions", json={**body, "model": m}) for m in ("lm", "lm-bias")}
    assert cards["lm-bias"]["kind"] == "bias" and cards["lm-bias"]["parent"] == "lm"
    assert {m: r.status_code for m, r in answers.items()} == {"lm": 200, "lm-bias": 200}
