"""The generation routes' request bodies (POST /v1/completions, /v1/chat/completions): OpenAI's fields, vLLM's
documented extras known by their names (its sampling controls, structured_outputs and the older guided_*), chat
messages, tools and response formats, each checked at the boundary."""

import json
from typing import Annotated, Literal

from pydantic import Field, StringConstraints, field_validator, model_validator

from serve.engine.types import Constraint
from serve.http.schemas import StrictBody, Text


class StreamOptions(StrictBody):
    include_usage: bool = False
    """A last chunk with no choices and the request's usage, as OpenAI sends it."""
    continuous_usage_stats: bool = False
    """vLLM's: every chunk carries the usage so far."""


JsonSchema = Annotated[dict | str, Field(description="a JSON schema, as an object or as JSON text")]
Regex = Annotated[str, Field(min_length=1, max_length=10_000)]
Choices = Annotated[list[Annotated[str, Field(max_length=1000)]], Field(min_length=1, max_length=256)]
Grammar = Annotated[str, Field(min_length=1, max_length=100_000)]


class StructuredOutputs(StrictBody):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: JsonSchema | None = Field(None, alias="json")
    regex: Regex | None = None
    choice: Choices | None = None
    grammar: Grammar | None = None
    """EBNF (xgrammar's dialect, as vLLM's default backend takes it)."""
    json_object: Literal[True] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        if len(self.model_fields_set) != 1:
            raise ValueError("set exactly one of json, regex, choice, grammar, json_object")
        return self

    def constraint(self) -> Constraint:
        if self.json_ is not None:
            return json_constraint(self.json_)
        if self.choice is not None:
            return Constraint("choice", json.dumps(self.choice))
        if self.regex is not None:
            return Constraint("regex", self.regex)
        if self.grammar is not None:
            return Constraint("grammar", self.grammar)
        return Constraint("json_object")


def json_constraint(schema: dict | str) -> Constraint:
    return Constraint("json", schema if isinstance(schema, str) else json.dumps(schema))


GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
"""vLLM's older names for structured_outputs' json, regex, choice and grammar."""

TokenId = Annotated[int, Field(ge=0)]


class _Sampling(StrictBody):
    model: str
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    n: Annotated[int, Field(ge=1, le=8)] = 1
    """Choices per prompt: each is a row of its own, sharing the prompt's cached blocks (serve/README.md)."""
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    seed: int | None = None
    """Choice i of a prompt draws from seed + i."""
    stream: bool = False
    """Server-sent events, one chunk per piece of text, then `data: [DONE]`."""
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=1024)] | None = None
    """Token id (as a string, as OpenAI sends it) -> added to its logit."""
    # vLLM's documented extras, with vLLM's meanings
    top_k: Annotated[int, Field(ge=-1)] = 0
    """0 or -1: every token."""
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] = 1.0
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None
    guided_json: JsonSchema | None = None
    guided_regex: Regex | None = None
    guided_choice: Choices | None = None
    guided_grammar: Grammar | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not key.isdigit():
                raise ValueError(f"keys are token ids, got '{key[:40]}'")
        return v

    @model_validator(mode="after")
    def _one_constraint(self):
        asked = self.constraints_asked()
        if len(asked) > 1:
            raise ValueError(f"{asked[1]}: set only one of {', '.join(asked)}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: {self.min_tokens} is more than max_tokens ({self.max_tokens})")
        return self

    def constraints_asked(self) -> list[str]:
        """The fields of this request that constrain its output."""
        return [f for f in ("structured_outputs", *GUIDED) if getattr(self, f) is not None]

    def constraint(self) -> Constraint | None:
        """What the output must match, however the request named it (None: free text)."""
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        for name in GUIDED:
            if getattr(self, name) is not None:
                older = {name.removeprefix("guided_"): getattr(self, name)}
                return StructuredOutputs.model_validate(older).constraint()
        return None

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(s for s in self.stop if s)


TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(_Sampling):
    prompt: (Text | Annotated[list[Text], Field(min_length=1)] | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1)])
    """A text, a list of texts, a list of token ids, or a list of lists of token ids: n choices each, in order."""
    max_tokens: Annotated[int, Field(ge=0)] = 16
    """OpenAI's default for completions."""
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    """Log probabilities of the tokens, with this many most likely alternatives at each."""
    echo: bool = False
    """The prompt comes back before the completion (with its tokens' log probabilities, when asked)."""
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None
    suffix: None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        return [p] if p and isinstance(p[0], int) else list(p)  # type: ignore[list-item]


class TextPart(StrictBody):
    type: Literal["text"]
    text: Text


FunctionName = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]


class FunctionCall(StrictBody):
    """A call as a message carries it: its arguments are JSON text."""

    name: FunctionName
    arguments: Annotated[str, Field(max_length=1_000_000)]


class ToolCall(StrictBody):
    id: Annotated[str, Field(max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Text | Annotated[list[TextPart], Field(min_length=1)] | None = None
    """A string, or a list of text parts (other part types, such as images, are refused); an assistant message
    that calls tools may have none."""
    name: Annotated[str, Field(max_length=256)] | None = None
    tool_call_id: Annotated[str, Field(max_length=256)] | None = None
    """A tool message: the call it answers."""
    tool_calls: Annotated[list[ToolCall], Field(min_length=1, max_length=128)] | None = None
    """An assistant message: the calls it made."""
    function_call: FunctionCall | None = None
    """OpenAI's deprecated form of one call."""
    refusal: None = None

    @model_validator(mode="after")
    def _content_or_calls(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.function_call)):
            raise ValueError("content: needed, unless an assistant message makes tool calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def as_dict(self) -> dict:
        """As the engine takes it (serve/engine/prompts.py): OpenAI's message, its text joined."""
        calls = self.tool_calls or ([ToolCall(id="call_0", function=self.function_call)] if self.function_call else [])
        out = {"role": "tool" if self.role == "function" else self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if calls:
            out["tool_calls"] = [c.model_dump() for c in calls]
        return out


class JsonSchemaFormat(StrictBody):
    name: Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None
    """Either way the output matches the schema here (it is sampled under its grammar)."""


class ResponseFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema: given exactly when type is json_schema")
        return self

    def constraint(self) -> Constraint | None:
        if self.type == "json_object":
            return Constraint("json_object")
        if self.type == "json_schema":
            return json_constraint(self.json_schema.schema_ or {})
        return None


class FunctionDef(StrictBody):
    name: FunctionName
    description: Annotated[str, Field(max_length=10_000)] | None = None
    parameters: dict | None = None
    """A JSON schema of its arguments (an object); None: none."""
    strict: bool | None = None


class Tool(StrictBody):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(StrictBody):
    name: FunctionName


class NamedTool(StrictBody):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedTool

UNSUPPORTED_CHAT = ("audio", "modalities", "prediction", "web_search_options")


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=256)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    """Neither set: generation runs to an end-of-turn token or the end of the context, within the server's
    max_tokens limit."""
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(min_length=1, max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    """None: "auto" with tools, "none" without."""
    parallel_tool_calls: bool = True
    """False: at most one call an answer."""
    functions: Annotated[list[FunctionDef], Field(min_length=1, max_length=128)] | None = None
    """OpenAI's deprecated tools (answered with message.function_call)."""
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    """OpenAI's deprecated tool_choice."""
    store: Literal[False] = False
    """Nothing is stored here."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        if isinstance(data, dict):
            for key in UNSUPPORTED_CHAT:
                if data.get(key) is not None:
                    raise ValueError(f"{key}: not supported by this server")
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        if self.tools is not None and self.functions is not None:
            raise ValueError("functions: set tools or functions (deprecated), not both")
        if self.tool_choice is not None and self.function_call is not None:
            raise ValueError("function_call: set tool_choice or function_call (deprecated), not both")
        choice, defs = self.chosen_tool(), self.tool_defs()
        if choice not in ("none", "auto") and not defs:
            raise ValueError("tool_choice: needs tools")
        if isinstance(choice, NamedFunction) and choice.name not in {f.name for f in defs}:
            raise ValueError(f"tool_choice: function '{choice.name}' is not in tools")
        asked = self.constraints_asked()
        if self.forces_call() and asked:
            forced = choice if isinstance(choice, str) else "naming a function"
            raise ValueError(f"{asked[0]}: not with tool_choice {forced}")
        return self

    def constraints_asked(self) -> list[str]:
        fmt = ["response_format"] if self.response_format is not None and self.response_format.type != "text" else []
        return fmt + super().constraints_asked()

    def constraint(self) -> Constraint | None:
        fmt = self.response_format.constraint() if self.response_format is not None else None
        return fmt or super().constraint()

    def tool_defs(self) -> list[FunctionDef]:
        """The functions the model may call (tools or the deprecated functions)."""
        if self.tools is not None:
            return [t.function for t in self.tools]
        return list(self.functions or [])

    def chosen_tool(self) -> Literal["none", "auto", "required"] | NamedFunction:
        """tool_choice (or function_call), its default resolved."""
        choice = self.tool_choice if self.tool_choice is not None else self.function_call
        if choice is None:
            return "auto" if self.tool_defs() else "none"
        return choice.function if isinstance(choice, NamedTool) else choice

    def forces_call(self) -> bool:
        return self.chosen_tool() not in ("none", "auto")
