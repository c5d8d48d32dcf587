"""HTTP bodies: OpenAI-compatible where OpenAI has the route (the official client must work), pydantic-checked. The
generation routes' request bodies, with vLLM's documented extras, are generation_schemas.py's; their answers are
here."""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from serve.engine.types import Residency
from serve.store.manifest import TenantEntry

Text = Annotated[str, Field(max_length=1_000_000)]


class StrictBody(BaseModel):
    """A request's body: requests ignore nothing silently, an unknown field is a 422 naming it."""

    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Prompt tokens read from the prefix cache, as OpenAI reports them."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class InputUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    truncated_inputs: int = 0
    """Inputs cut to the model's input limit (all-MiniLM-L6-v2: 256 tokens)."""


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape: parallel lists, one entry per token; the prompt's first token has no logprob."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CalledFunction(BaseModel):
    name: str
    arguments: str
    """JSON text."""


class CalledTool(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    """None when it calls tools and says nothing else."""
    tool_calls: list[CalledTool] | None = None
    function_call: CalledFunction | None = None
    """The deprecated `functions` asked: its one call."""


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


FinishReason = Literal["stop", "length", "tool_calls", "function_call"]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChunkChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    function_call: FunctionDelta | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ClassifyRequest(StrictBody):
    model: str
    input: Text | Annotated[list[Text], Field(min_length=1)]
    truncate: bool = True
    """Inputs longer than the model reads are cut (counted in usage.truncated_inputs); false refuses them."""


class Classification(BaseModel):
    index: int
    label: str
    probs: dict[str, float]


class ClassifyResponse(BaseModel):
    object: Literal["list"] = "list"
    model: str
    data: list[Classification]
    usage: InputUsage


class EmbeddingRequest(StrictBody):
    model: str
    input: Text | Annotated[list[Text], Field(min_length=1)]
    encoding_format: Literal["float", "base64"] = "float"
    """The official client asks for base64 (little-endian float32) unless told otherwise."""
    user: str | None = None
    dimensions: None = None
    truncate: bool = True
    """As for classify."""


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: InputUsage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "manyfold"
    kind: str
    parent: str | None
    residency: Residency
    """hot (the fast tier), warm (host memory) or cold (on disk only): serve/engine/types.py."""
    labels: list[str] | None = None
    status: Literal["ready", "unavailable"] = "ready"
    """"unavailable": its base has no running replica now (requests to it get 503 with the reason)."""
    form: str | None = None
    """A variant's form: its kind, or what `store add --kind auto` chose ("lora r8 (auto, agreement 99.0%, ...)")."""
    alias_of: str | None = None
    """The stored model that answers this name (parent: its base), when an upgrade moved the name there."""

    @classmethod
    def of(cls, info) -> "ModelCard":
        """A ModelInfo (serve/engine/types.py, from an engine or the router) as the API shows a model."""
        return cls(id=info.name, kind=info.kind, parent=info.base, residency=info.residency, labels=info.labels,
                   status=info.status, form=info.form, alias_of=info.alias_of)


class ModelList(BaseModel):
    """OpenAI's list, with the cursor fields of its paginated lists (`?limit=N&after=ID`): harmless to a client
    that reads `data` only (the official one's models.list())."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
    has_more: bool = False
    """More models after last_id: ask again with after=last_id."""
    first_id: str | None = None
    last_id: str | None = None


class AddVariantRequest(StrictBody):
    name: str
    kind: Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,31}$")] = "full"
    """A registered variant kind (full, lora, pissa, ...): the base's replica checks it."""
    base: str
    path: str
    """A directory on the server's filesystem: a HF model directory (full) or a PEFT adapter (lora, pissa)."""


MAX_BATCH_VARIANTS = 10_000


class AddVariantsRequest(StrictBody):
    variants: Annotated[list[AddVariantRequest], Field(min_length=1, max_length=MAX_BATCH_VARIANTS)]


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str
    param: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class AddVariantOutcome(BaseModel):
    """One item of a batch add: its own HTTP status (201, or the status add_variant would have answered) and
    either its model card or its error."""

    name: str
    status: int
    model: ModelCard | None = None
    error: ErrorDetail | None = None


class AddVariantsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[AddVariantOutcome]
    """In the order of the request's `variants`."""


class TenantRequest(TenantEntry):
    """POST /v1/admin/tenants: a tenant as the store keeps it. Its keys are sent as their sha256 digests
    (`key_digest` in serve/config.py): a key itself never reaches the server's store or logs."""


class TenantCard(BaseModel):
    """A tenant as the admin routes show it: the entry, where it comes from, and its revision (as the audit log
    records it)."""

    object: Literal["tenant"] = "tenant"
    tenant: TenantEntry
    source: Literal["config", "store"]
    """"config": read from the config file at start (a store tenant of its name would replace it); "store": added
    through POST /v1/admin/tenants."""
    revision: str


class TenantList(BaseModel):
    object: Literal["list"] = "list"
    data: list[TenantCard]
