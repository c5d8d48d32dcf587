"""One base model in memory, run for groups of rows with a variant's weights swapped in.

A variant never copies the base module: `torch.func.functional_call` runs the one base module with the
variant's differing tensors in place of the base's, for that call only. Encoders give embeddings (mean
pooling + L2 normalisation, as all-MiniLM-L6-v2's sentence-transformers config says) and classification
(BERT pooler + the variant's own head); causal LMs generate in serve.engine.generation.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.func import functional_call

from serve.codecs.fmdelta_file import match_base_name
from serve.errors import BadRequest, VariantIncompatible

HEAD_PREFIXES = ("classifier.",)
"""Tensors of a BertForSequenceClassification fine-tune that are its own head, not base weights."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    """0 is greedy."""
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass
class Generation:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    prompt_tokens: int = 0


class BaseModelRuntime:
    def __init__(self, name: str, model_dir: str | Path, device: str = "cpu"):
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

        self.name = name
        self.device = torch.device(device)
        config = AutoConfig.from_pretrained(model_dir)
        self.causal = any(a.endswith("ForCausalLM") for a in (config.architectures or []))
        cls = AutoModelForCausalLM if self.causal else AutoModel
        self.model = cls.from_pretrained(model_dir, dtype="auto").to(self.device).eval()  # as stored: deltas match
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if self.causal and self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.max_length = int(getattr(config, "max_position_embeddings", 512))
        self._params = dict(self.model.named_parameters())
        self._param_names = set(self._params)
        eos = self.model.generation_config.eos_token_id if self.causal else None
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self._params.values())

    def split_variant(self, tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
        """A full fine-tune's tensors -> (module weights that differ from the base, its head).

        Tensors the fine-tune left unchanged arrive as the base's own objects (FmdFile.decode_all with
        share_unchanged) and are left out: the module keeps using its own.
        """
        weights, head = {}, {}
        for name, t in tensors.items():
            target = match_base_name(name, self._param_names)
            if target is None:
                if not name.startswith(HEAD_PREFIXES):
                    raise VariantIncompatible(f"tensor '{name}' matches nothing in base '{self.name}'")
                head[name.split(".", 1)[1]] = t
                continue
            base_t = self._params[target]
            if t.shape != base_t.shape:
                raise VariantIncompatible(f"tensor '{name}' is {list(t.shape)}; base '{self.name}' has "
                                          f"{list(base_t.shape)}")
            if t is base_t or (t.data_ptr() == base_t.data_ptr() and t.dtype == base_t.dtype):
                continue
            weights[target] = t.to(base_t.dtype)
        return weights, head

    def call(self, weights: dict[str, torch.Tensor] | None, **kwargs):
        if not weights:
            return self.model(**kwargs)
        return functional_call(self.model, weights, args=(), kwargs=kwargs, strict=False)

    def _tokenize(self, texts: list[str]) -> dict[str, torch.Tensor]:
        enc = self.tokenizer(texts, padding=True, truncation=True, max_length=min(self.max_length, 512),
                             return_tensors="pt")
        return {k: v.to(self.device) for k, v in enc.items()}

    @torch.no_grad()
    def embed(self, texts: list[str], weights: dict[str, torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """([n, hidden] unit vectors: mean of the last hidden states over real tokens, [n] tokens read per text,
        special tokens included, as truncated)."""
        self._need(encoder=True)
        enc = self._tokenize(texts)
        hidden = self.call(weights, **enc).last_hidden_state  # [n, seq, hidden]
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1), enc["attention_mask"].sum(1)

    @torch.no_grad()
    def classify(self, texts: list[str], weights: dict[str, torch.Tensor] | None, head: dict) -> torch.Tensor:
        """[n, labels] probabilities, as BertForSequenceClassification computes them in eval mode."""
        self._need(encoder=True)
        if "weight" not in head or "bias" not in head:
            raise BadRequest("this model has no classifier head")
        pooled = self.call(weights, **self._tokenize(texts)).pooler_output  # [n, hidden]
        logits = pooled @ head["weight"].T + head["bias"]  # [n, labels]
        return logits.softmax(-1)

    def _need(self, encoder: bool) -> None:
        if encoder == self.causal:
            what = "an encoder" if encoder else "a causal language model"
            raise BadRequest(f"model '{self.name}' is not {what}")

    def require_causal(self) -> None:
        self._need(encoder=False)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        if not self.tokenizer.chat_template:
            raise BadRequest(f"model '{self.name}' has no chat template")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        return list(ids)

    def encode_prompt(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def check_fits(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise BadRequest("the prompt encodes to no tokens")
        if len(prompt) + params.max_tokens > self.max_length:
            raise BadRequest(f"prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                             f"context of {self.max_length} tokens")

    def advance(self, gen: Generation, tok: int, params: SamplingParams) -> bool:
        """Append one token; -> whether the row is finished."""
        if tok in self.eos_ids:
            gen.finish_reason = "stop"
            return True
        gen.token_ids.append(tok)
        gen.text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        for s in params.stop:
            at = gen.text.find(s)
            if at >= 0:
                gen.text = gen.text[:at]
                gen.finish_reason = "stop"
                return True
        if len(gen.token_ids) >= params.max_tokens:
            gen.finish_reason = "length"
            return True
        return False

