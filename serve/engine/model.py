"""One base model in memory, run for rows of many variants at once.

The base's leaf modules are wrapped once at load (serve/engine/families/layers.py); a forward takes a BatchPlan that
says which slot of which correction family each row uses, so rows of the base, of full variants and of
adapters share one forward. Encoders give embeddings (mean pooling + L2 normalisation, as all-MiniLM-L6-v2's
sentence-transformers config says) and classification (BERT pooler + each row's own head); causal LMs
generate in serve.engine.generation.decode_batch.
"""

import hashlib
import json
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import torch

from serve.config import DEFAULT_KV_ROWS, BatchConfig, EngineConfig, SlotsConfig
import serve.engine.families.adapter_pool  # noqa: F401  (registers the "lora" family)
import serve.engine.families.emr_slots  # noqa: F401  (registers the "emr" family)
import serve.engine.families.weight_pool  # noqa: F401  (registers the "weights" family)
from serve.engine import faults
from serve.engine.step.batch import BASE_ROW, BatchPlan, RowSlot
from serve.engine.step.fused import fuse_layers
from serve.engine.step.graphs import StepGraphs
from serve.engine.kv.store import ATTENTION, KVStore, token_bytes
from serve.engine.families.layers import Corrections, wrap_modules, leaf_modules
from serve.engine.neuzip.coded import CodedWeights
from serve.engine.neuzip.coded import load_model as load_neuzip
from serve.engine.families.slots import FAMILIES, Slots, family_class
from serve.engine.prompts import Prompts, token_counts
from serve.engine.stats import Seconds
from serve.errors import BadRequest
from serve.codecs.neuzip_file import NEUZIP_FILE, NzpFile
from serve.store.model_dir import is_causal_lm
from serve.store.tensors import SafetensorsSource, tensor_digest
from serve.variants.base import BaseView, LoadedVariant


class BaseModelRuntime:
    def __init__(self, name: str, model_dir: str | Path, device: str = "cpu", slots: SlotsConfig = SlotsConfig(),
                 decoded_bytes: int = 0, batch: BatchConfig = BatchConfig(), engine: EngineConfig = EngineConfig()):
        """decoded_bytes: a NeuZip base's decoded-layer budget (serve/engine/neuzip/coded.py); batch: the KV store's
        size (a causal LM's rows and positions) and a step's token budget."""
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

        self.name = name
        self.device = torch.device(device)
        config = AutoConfig.from_pretrained(model_dir)
        self.causal = is_causal_lm(config.architectures)
        host, digests, streams = self._load_weights(AutoModelForCausalLM if self.causal else AutoModel, model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        """The compute thread's; the event loop has its own in `prompts` (serve/engine/prompts.py)."""
        if self.causal and self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        positions = int(getattr(config, "max_position_embeddings", 512))
        self.max_length = min(positions, batch.max_model_len) if self.causal else positions
        """A causal LM's context: a row's prompt and generated tokens together (its KV slot's positions)."""
        self.max_input_tokens = self.max_length if self.causal else encoder_limit(model_dir, self.max_length)
        self.prompts = Prompts(name, AutoTokenizer.from_pretrained(model_dir), self.max_length, self.max_input_tokens)
        tensors = {n: t.detach() for n, t in self.model.state_dict().items()}
        if self.device.type != "cpu":
            host = SafetensorsSource(model_dir)  # decoders read the stored base; no second copy stays resident
        self.view = BaseView(name, tensors, host, digests, leaf_modules(self.model))
        self.slots_config = slots
        self.families: dict[str, Slots] = {f: cls(self.view, self.device, slots) for f, cls in FAMILIES.items()
                                           if not cls.per_entry}
        self.seconds = Seconds()
        """Compute-thread time by part: "forward" (every forward), inside it each family's corrections, and
        "staging" (writing variants into their slots)."""
        self.coded = CodedWeights(self.model, streams, decoded_bytes) if streams else None  # by the modules' names
        self.corrections = Corrections(self.families, self.seconds, self.coded)
        self.wrappers = wrap_modules(self.model, self.view.modules, self.corrections)
        self.fixed_shapes = False
        """Steps run at row and token buckets and the families read per-token maps (serve/engine/step/layout.py): on
        CUDA, so that steps replay as graphs; a test may ask for them on CPU (use_fixed_shapes)."""
        self.max_step_chunks: int | None = None
        """Prompt chunks one step holds at most (fixed shapes: the chunk table's rows), None: any."""
        self.use_fixed_shapes(self.device.type == "cuda")
        self.max_step_tokens = batch.max_step_tokens
        self.batch_invariant = engine.batch_invariant
        """Generation steps run under serve/engine/step/invariant.py's BatchInvariant (engine.batch_invariant)."""
        self.step_counts: Counter[str] = Counter()
        """Generation steps by how they ran: "graphed", or "eager:<reason>" (serve/engine/step/layout.py)."""
        self.prefix_tokens: Counter[str] = Counter()
        """Prompt tokens of rows admitted ("queries") and those found in the prefix cache ("hits"), as vLLM counts."""
        self.token_counts: Counter[str] = Counter()
        """Decode and prompt tokens by how their step ran: "decode:graphed", "prompt:eager", ..."""
        self.kv: KVStore | None = None
        """A causal LM's KV cache (serve/engine/kv/store.py), allocated once here."""
        self.graphs: StepGraphs | None = None
        if self.causal:
            self._ready_to_generate(config, batch, engine)
        eos = self.model.generation_config.eos_token_id if self.causal else None
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    def _load_weights(self, cls, model_dir: str | Path) -> tuple:
        """self.model on its device; -> (the host's tensors that decoders and deltas read, each tensor's digest,
        a NeuZip base's coded streams)."""
        self.held_form: dict = {}
        """A NeuZip base's mantissa bits and its coded tensors' digests (held_digest)."""
        nzp_path = Path(model_dir) / NEUZIP_FILE
        streams = {}
        if nzp_path.exists():  # coded weights stay coded; decoders read the stored lossless base
            nzp = NzpFile(nzp_path)
            self.model, streams = load_neuzip(cls, model_dir, nzp, self.device)
            digests = {n: r.source_digest for n, r in nzp.records.items()}
            self.held_form = {"neuzip_bits": nzp.bits, "coded": {n: r.digest for n, r in nzp.records.items()}}
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
        return host, digests, streams

    def _ready_to_generate(self, config, batch: BatchConfig, engine: EngineConfig) -> None:
        """The attention that reads the KV cache, the cache itself, layers fused where they can be
        (serve/engine/step/fused.py), and on CUDA the base rows' step graphs. A cache smaller than max_model_len
        positions is what a row may hold."""
        self.model.set_attn_implementation(ATTENTION)
        fuse_layers(self.model)
        dtype = next(p.dtype for p in self.model.parameters() if p.is_floating_point())
        block = min(batch.kv_block_tokens, self.max_length)
        blocks = kv_blocks(batch, config, self.max_length, block, dtype)
        if blocks * block < self.max_length:
            self.max_length = self.max_input_tokens = blocks * block
            self.prompts.limit(self.max_length, "KV cache")
        self.kv = KVStore(config, batch.max_batch_size, blocks, block, self.max_length, dtype, self.device,
                          self.held_digest(), batch.prefix_caching)
        if self.device.type == "cuda" and engine.cuda_graphs == "auto" and not engine.batch_invariant:
            self.graphs = StepGraphs(self)
            self.graphs.warm_up()

    def held_digest(self) -> bytes:
        """A digest of the weights as this base holds them: every tensor's digest (of the stored, lossless ones)
        and, for a NeuZip base, the mantissa bits it keeps and its coded tensors' digests (a lossy base computes
        other keys and values than the plain one)."""
        held = json.dumps({"digests": self.view.digests, **self.held_form}, sort_keys=True)
        return hashlib.blake2b(held.encode(), digest_size=16).digest()

    @property
    def nbytes(self) -> int:
        """Resident weight bytes: parameters held as tensors, plus a NeuZip base's streams and decoded buffer (the
        KV store is counted apart: kv.nbytes)."""
        params = [p for p in self.model.parameters() if not p.is_meta]  # parameters() yields a tied one once
        return sum(p.numel() * p.element_size() for p in params) + (self.coded.nbytes if self.coded else 0)

    def use_fixed_shapes(self, on: bool) -> None:
        """Row and token buckets and per-token maps on (CUDA's default) or off; every family, present and future,
        follows."""
        from serve.engine.step.layout import CHUNK_ROWS

        self.fixed_shapes = on
        self.max_step_chunks = CHUNK_ROWS if on else None
        for family in self.families.values():
            family.fixed_shapes = on

    # ---- slots: created, attached, detached and removed on the compute thread only
    def _new_family(self, family: str) -> Slots:
        made = family_class(family)(self.view, self.device, self.slots_config, family=family)
        made.fixed_shapes = self.fixed_shapes
        return made

    def check(self, variant: LoadedVariant) -> None:
        """Raise VariantIncompatible if the variant can never sit in its family's slots (any thread: it reads
        the family if there is one, and creates none)."""
        (self.families.get(variant.family) or self._new_family(variant.family)).check(variant)

    def attach(self, variant: LoadedVariant | None) -> RowSlot | None:
        """A row's place in the next forwards; None when its family has no free slot (the row waits). A group's
        own family ("emr:<group>") gets its slots on first use."""
        if variant is None:
            faults.hit("attach", [self.name])
            return BASE_ROW
        faults.hit("attach", [variant.name, variant.entry])
        with self.seconds.timing("staging"):
            if variant.family not in self.families:
                self.families[variant.family] = self._new_family(variant.family)
            slot = self.families[variant.family].attach(variant)
        return None if slot is None else RowSlot(variant.family, slot)

    def detach(self, row: RowSlot) -> None:
        if row.family is not None:
            self.families[row.family].detach(row.slot)

    def retire(self, key: str) -> None:
        """The store no longer has this revision of an entry: its idle slots are freed, and a group's own family
        ("emr:<key>") goes once no row uses it."""
        for family in list(self.families.values()):
            family.retire(key)
        for name in [n for n, f in self.families.items() if n.partition(":")[2] == key and f.in_use == 0]:
            del self.families[name]
            if self.graphs is not None:
                self.graphs.forget(name)

    def slot_refs(self) -> dict[str, int]:
        """Rows holding a slot, per family (zero everywhere once every row has left)."""
        return {f: s.in_use for f, s in self.families.items() if s.in_use}

    def call(self, plan: BatchPlan, **kwargs):
        ids = kwargs.get("input_ids")
        tokens = ids.numel() if ids is not None else plan.rows * self.max_length  # embeddings given: assume long
        decoding = self.coded.decoder.forward(tokens) if self.coded else nullcontext()
        for family in plan.families:
            self.families[family].prepare(plan)
        with self.seconds.timing("forward"), self.corrections.planned(plan), decoding:
            return self.model(**kwargs)

    # ---- encoders
    def input_lengths(self, texts: list[str]) -> list[int]:
        """Tokens of each text before any truncation (compute thread: its tokenizer)."""
        return token_counts(self.tokenizer, texts)

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
        self.require(self.name, encoder=True)
        encoded, lengths = self._encode(texts, rows)
        pooled = torch.stack([hidden.mean(0) for hidden, _ in encoded])  # [n, hidden]
        return torch.nn.functional.normalize(pooled, dim=-1), torch.tensor(lengths)

    @torch.no_grad()
    def classify(self, texts: list[str], rows: list[RowSlot], heads: list[dict[str, torch.Tensor]]
                 ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(one [labels] probability vector per text, each under its own row's head, as
        BertForSequenceClassification computes them in eval mode; [n] tokens read per text)."""
        self.require(self.name, encoder=True)
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

    def require(self, model: str, encoder: bool) -> None:
        """BadRequest naming `model`, the name the client asked for (this base, or one of its variants), when
        this base is not the kind of model the route needs."""
        if encoder == self.causal:
            need = "an encoder" if encoder else "a causal language model"
            have = "a causal language model" if self.causal else "an encoder"
            base = f" (its base '{self.name}' is {have})" if model != self.name else ""
            raise BadRequest(f"model '{model}' is not {need}{base}")


def kv_blocks(batch: BatchConfig, config, positions: int, block_tokens: int, dtype: torch.dtype) -> int:
    """Blocks of `block_tokens` positions the KV cache holds: what batch.kv_cache_mib buys (None: DEFAULT_KV_ROWS
    rows of `positions`), at least one."""
    if batch.kv_cache_mib is None:
        return DEFAULT_KV_ROWS * -(-positions // block_tokens)
    return max(1, int(batch.kv_cache_mib * (1 << 20)) // (block_tokens * token_bytes(config, dtype)))


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

