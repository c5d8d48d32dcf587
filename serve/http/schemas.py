"""HTTP bodies: OpenAI-compatible where OpenAI has the route (the official client must work), pydantic-checked."""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

Text = Annotated[str, Field(max_length=1_000_000)]


class _Request(BaseModel):
    """Requests ignore nothing silently: an unknown field is a 422 naming it."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False
    """A last chunk with no choices and the request's usage, as OpenAI sends it."""


class _Sampling(_Request):
    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    n: Literal[1] = 1
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    seed: int | None = None
    stream: bool = False
    """Server-sent events, one chunk per piece of text, then `data: [DONE]`."""
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: Literal[0, 0.0] = 0
    presence_penalty: Literal[0, 0.0] = 0

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(s for s in self.stop if s)


class CompletionRequest(_Sampling):
    prompt: Text | Annotated[list[Text], Field(min_length=1, max_length=1)]


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant"]
    content: Text


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=256)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]


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
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ClassifyRequest(_Request):
    model: str
    input: Text | Annotated[list[Text], Field(min_length=1)]


class Classification(BaseModel):
    index: int
    label: str
    probs: dict[str, float]


class ClassifyResponse(BaseModel):
    object: Literal["list"] = "list"
    model: str
    data: list[Classification]


class EmbeddingRequest(_Request):
    model: str
    input: Text | Annotated[list[Text], Field(min_length=1)]
    encoding_format: Literal["float", "base64"] = "float"
    """The official client asks for base64 (little-endian float32) unless told otherwise."""
    user: str | None = None
    dimensions: None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "manyfold"
    kind: str
    parent: str | None
    residency: Literal["device", "cpu", "disk"]
    labels: list[str] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class AddVariantRequest(_Request):
    name: str
    kind: Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,31}$")] = "full"
    """A registered variant kind (full, lora, pissa, ...): the base's replica checks it."""
    base: str
    path: str
    """A directory on the server's filesystem: a HF model directory (full) or a PEFT adapter (lora, pissa)."""


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str
    param: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail
