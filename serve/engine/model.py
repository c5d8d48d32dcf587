"""One base model in memory, run for rows of many variants at once.

The base's leaf modules are wrapped once at load (serve/engine/layers.py); a forward takes a BatchPlan that
says which slot of which correction family each row uses, so rows of the base, of full variants and of
adapters share one forward. Encoders give embeddings (mean pooling + L2 normalisation, as all-MiniLM-L6-v2's
sentence-transformers config says) and classification (BERT pooler + each row's own head); causal LMs
generate in serve.engine.generation.
"""

import json
from pathlib import Path

import torch

from serve.config import SlotsConfig
from serve.engine.batch import BASE_ROW, BatchPlan, RowSlot
from serve.engine.layers import SlotLayers, leaf_modules
from serve.engine.neuzip import CodedWeights
from serve.engine.neuzip import load_model as load_neuzip
from serve.engine.slots import FAMILIES, Slots, family_class
from serve.engine.types import SamplingParams
from serve.errors import BadRequest
from serve.codecs.neuzip_file import NEUZIP_FILE, NzpFile
from serve.store.tensors import SafetensorsSource, tensor_digest
from serve.variants.base import BaseView, LoadedVariant


class BaseModelRuntime:
    def __init__(self, name: str, model_dir: str | Path, device: str = "cpu", slots: SlotsConfig = SlotsConfig(),
                 decoded_bytes: int = 0):
        """decoded_bytes: a NeuZip base's decoded-layer budget (serve/engine/neuzip.py)."""
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

        self.name = name
        self.device = torch.device(device)
        config = AutoConfig.from_pretrained(model_dir)
        self.causal = any(a.endswith("ForCausalLM") for a in (config.architectures or []))
        cls = AutoModelForCausalLM if self.causal else AutoModel
        nzp_path = Path(model_dir) / NEUZIP_FILE
        streams = {}
        if nzp_path.exists():  # coded weights stay coded; decoders read the stored lossless base
            nzp = NzpFile(nzp_path)
            self.model, streams = load_neuzip(cls, model_dir, nzp, self.device)
            digests = {n: r.source_digest for n, r in nzp.records.items()}
            host = SafetensorsSource(model_dir)
        else:
            self.model = cls.from_pretrained(model_dir, dtype="auto").eval()  # as stored: deltas match
            host = {n: t.detach() for n, t in self.model.state_dict().items()}
            digests = {}
        for n, t in self.model.state_dict().items():
            if n not in digests and not t.is_meta:
                digests[n] = tensor_digest(t.cpu())  # on the host, before the move
        if not streams:
            self.model.to(self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if self.causal and self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.max_length = int(getattr(config, "max_position_embeddings", 512))
        self.max_input_tokens = self.max_length if self.causal else encoder_limit(model_dir, self.max_length)
        tensors = {n: t.detach() for n, t in self.model.state_dict().items()}
        if self.device.type != "cpu":
            host = SafetensorsSource(model_dir)  # decoders read the stored base; no second copy stays resident
        self.view = BaseView(name, tensors, host, digests, leaf_modules(self.model))
        self.slots_config = slots
        self.families: dict[str, Slots] = {f: cls(self.view, self.device, slots) for f, cls in FAMILIES.items()
                                           if f != "emr"}
        self.layers = SlotLayers(self.view.modules, self.families)
        # After the correction hooks: a coded weight goes back to its placeholder once they have run.
        self.coded = CodedWeights(self.model, streams, decoded_bytes) if streams else None
        eos = self.model.generation_config.eos_token_id if self.causal else None
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    @property
    def nbytes(self) -> int:
        """Resident weight bytes: parameters held as tensors, plus a NeuZip base's streams and decoded buffer."""
        params = [p for p in self.model.parameters() if not p.is_meta]  # parameters() yields a tied one once
        return sum(p.numel() * p.element_size() for p in params) + (self.coded.nbytes if self.coded else 0)

    # ---- slots
    def slots(self, family: str) -> Slots:
        """A family's slots; a group's own family ("emr:<group>") gets them on first use."""
        if family not in self.families:
            self.families[family] = family_class(family)(self.view, self.device, self.slots_config, family=family)
        return self.families[family]

    def attach(self, variant: LoadedVariant | None) -> RowSlot | None:
        """A row's place in the next forwards; None when its family has no free slot (the row waits)."""
        if variant is None:
            return BASE_ROW
        slot = self.slots(variant.family).attach(variant)
        return None if slot is None else RowSlot(variant.family, slot)

    def detach(self, row: RowSlot) -> None:
        if row.family is not None:
            self.families[row.family].detach(row.slot)

    def forget(self, name: str) -> None:
        for family in self.families.values():
            family.forget(name)

    def call(self, plan: BatchPlan, **kwargs):
        with self.layers.planned(plan):
            return self.model(**kwargs)

    # ---- encoders
    def input_lengths(self, texts: list[str]) -> list[int]:
        """Tokens of each text, special tokens included, before any truncation."""
        return [len(i) for i in self.tokenizer(texts)["input_ids"]] if texts else []

    def check_inputs_fit(self, texts: list[str]) -> None:
        for i, n in enumerate(self.input_lengths(texts)):
            if n > self.max_input_tokens:
                raise BadRequest(f"input {i}: {n} tokens; model '{self.name}' reads at most {self.max_input_tokens} "
                                 f"(send truncate: true to cut it)")

    @torch.no_grad()
    def _encode(self, texts: list[str], rows: list[RowSlot]) -> tuple[list, list[int]]:
        """Every text through the encoder, cut to max_input_tokens, in forwards of texts of similar length
        (length_buckets); -> (each text's (last hidden states [seq, hidden], pooler output [hidden]) over its
        real tokens, tokens read)."""
        ids = self.tokenizer(texts, truncation=True, max_length=self.max_input_tokens)["input_ids"]
        out: list = [None] * len(texts)
        for group in length_buckets([len(i) for i in ids]):
            enc = self.tokenizer.pad({"input_ids": [ids[i] for i in group]}, return_tensors="pt")
            enc = {k: v.to(self.device) for k, v in enc.items()}
            res = self.call(BatchPlan([rows[i] for i in group], self.device), **enc)
            real = enc["attention_mask"].bool()  # [k, seq]
            for j, i in enumerate(group):
                out[i] = (res.last_hidden_state[j][real[j]], res.pooler_output[j])
        return out, [len(i) for i in ids]

    def embed(self, texts: list[str], rows: list[RowSlot]) -> tuple[torch.Tensor, torch.Tensor]:
        """([n, hidden] unit vectors: mean of the last hidden states over real tokens, [n] tokens read per text,
        special tokens included, as truncated)."""
        self._need(encoder=True)
        encoded, lengths = self._encode(texts, rows)
        pooled = torch.stack([hidden.mean(0) for hidden, _ in encoded])  # [n, hidden]
        return torch.nn.functional.normalize(pooled, dim=-1), torch.tensor(lengths)

    @torch.no_grad()
    def classify(self, texts: list[str], rows: list[RowSlot], heads: list[dict[str, torch.Tensor]]
                 ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(one [labels] probability vector per text, each under its own row's head, as
        BertForSequenceClassification computes them in eval mode; [n] tokens read per text)."""
        self._need(encoder=True)
        for head in heads:
            if "weight" not in head or "bias" not in head:
                raise BadRequest("this model has no classifier head")
        encoded, lengths = self._encode(texts, rows)
        pooled = torch.stack([p for _, p in encoded])  # [n, hidden]
        out: list[torch.Tensor | None] = [None] * len(texts)
        for idx, head in _group_by_head(heads):
            logits = pooled[idx] @ head["weight"].T + head["bias"]  # [k, labels]
            for i, p in zip(idx, logits.softmax(-1)):
                out[i] = p
        return out, torch.tensor(lengths)  # type: ignore[return-value]

    def _need(self, encoder: bool) -> None:
        if encoder == self.causal:
            what = "an encoder" if encoder else "a causal language model"
            raise BadRequest(f"model '{self.name}' is not {what}")

    def require_causal(self) -> None:
        self._need(encoder=False)

    # ---- prompts
    def chat_prompt(self, messages: list[dict]) -> list[int]:
        if not self.tokenizer.chat_template:
            raise BadRequest(f"model '{self.name}' has no chat template")
        from jinja2 import TemplateError

        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
        except TemplateError as e:  # the template's own check, such as roles it does not take
            raise BadRequest(f"messages: the chat template of '{self.name}' refuses them: {e}") from None
        return list(ids)

    def check_token_ids(self, ids: list[int]) -> list[int]:
        vocab = len(self.tokenizer)
        for i in ids:
            if not 0 <= i < vocab:
                raise BadRequest(f"prompt: token id {i} is outside the vocabulary (0 to {vocab - 1})")
        return list(ids)

    def encode_prompt(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def check_fits(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise BadRequest("the prompt encodes to no tokens")
        if len(prompt) + params.max_tokens > self.max_length:
            raise BadRequest(f"prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                             f"context of {self.max_length} tokens")


def encoder_limit(model_dir: str | Path, positions: int) -> int:
    """Tokens an encoder reads: sentence-transformers' max_seq_length where the model directory has one
    (all-MiniLM-L6-v2: 256, though its positions go to 512), so embeddings equal the reference model's."""
    try:
        limit = json.loads((Path(model_dir) / "sentence_bert_config.json").read_text()).get("max_seq_length")
    except (OSError, ValueError, AttributeError):
        limit = None
    return min(positions, int(limit)) if isinstance(limit, int) and limit > 0 else positions


MAX_PADDING = 0.25
"""Share of a forward's tokens that may be padding: a CPU forward costs its padded tokens, and batching rows
of very different lengths would cost more than it saves."""


def length_buckets(lengths: list[int], max_padding: float = MAX_PADDING) -> list[list[int]]:
    """Indices of texts grouped by length, shortest first, each group one forward whose padding (every row
    padded to the group's longest) is at most `max_padding` of its tokens."""
    groups: list[list[int]] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if groups and (len(groups[-1]) + 1) * lengths[i] <= (1 + max_padding) * (real + lengths[i]):
            groups[-1].append(i)
            real += lengths[i]
        else:
            groups.append([i])
            real = lengths[i]
    return groups


def _group_by_head(heads: list[dict[str, torch.Tensor]]) -> list[tuple[list[int], dict[str, torch.Tensor]]]:
    """Rows that share a head object (the same variant), in first-seen order: one matmul per head."""
    groups: dict[int, tuple[list[int], dict]] = {}
    for i, head in enumerate(heads):
        groups.setdefault(id(head), ([], head))[0].append(i)
    return list(groups.values())

