"""Tool calls on chat, as OpenAI answers them: what constrains the output when a call is required, and the calls read
back out of the text (whole, or as a stream goes).

How tools reach the model is the base's chat template's (serve/engine/prompts.py: the template's own `tools`, or one
system message naming them and the form of a call). What comes back:
- tool_choice "required": the output is constrained to a JSON list of calls, each {"name", "arguments"} with
  arguments that match that function's parameters (one call at most without parallel_tool_calls);
- a named function: the output is constrained to its arguments;
- "auto": the model's own form is read: Hermes-style `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks
  anywhere in the text, or a whole answer that is a call or a list of calls in Llama-3's JSON form
  ({"name": ..., "parameters": ...}, after `<|python_tag|>` or not); text that is not a call stays text.
"""

import json
import re
import uuid
from dataclasses import dataclass

from serve.engine.types import Constraint
from serve.http import generation_schemas as G
from serve.http import schemas as S

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str
    """JSON text."""


def tools_for_prompt(body: G.ChatCompletionRequest) -> list[dict] | None:
    """The tools as the chat template takes them (OpenAI's form); None when the model is not to call any."""
    if body.chosen_tool() == "none":
        return None
    return [{"type": "function", "function": f.model_dump(exclude_none=True, by_alias=True)} for f in body.tool_defs()]


def call_constraint(body: G.ChatCompletionRequest) -> Constraint | None:
    """What the output must match when the request requires a call (None: it does not)."""
    choice, defs = body.chosen_tool(), body.tool_defs()
    if isinstance(choice, G.NamedFunction):
        f = next(f for f in defs if f.name == choice.name)
        return G.json_constraint(f.parameters or ANY_OBJECT)
    if choice != "required":
        return None
    one_of = [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.parameters or ANY_OBJECT},
               "required": ["name", "arguments"]} for f in defs]
    calls = {"type": "array", "items": {"anyOf": one_of}, "minItems": 1}
    if not body.parallel_tool_calls:
        calls["maxItems"] = 1
    return G.json_constraint(calls)


def read_calls(body: G.ChatCompletionRequest, text: str) -> tuple[str | None, list[Call]]:
    """The answer's text -> (its content, None where it is only calls; its calls)."""
    choice = body.chosen_tool()
    if choice == "none":
        return text, []
    if isinstance(choice, G.NamedFunction):
        return None, [Call(choice.name, text)]
    names = {f.name for f in body.tool_defs()}
    if choice == "required":
        calls = _json_calls(text, names)
        return (None, calls) if calls else (text, [])
    outside, calls = _auto_calls(text, names)
    return (outside.strip() or None, calls) if calls else (text, [])


def _auto_calls(text: str, names: set[str]) -> tuple[str, list[Call]]:
    """-> (the text outside the calls, as it is; the calls), or (text, []) where it holds none."""
    if CALL_OPEN in text:
        calls, rest = [], []
        for i, part in enumerate(re.split(f"{re.escape(CALL_OPEN)}(.*?)(?:{re.escape(CALL_CLOSE)}|$)", text,
                                          flags=re.S)):
            if i % 2 == 0:
                rest.append(part)
            else:
                found = _json_calls(part, names)
                if not found:
                    return text, []
                calls += found
        return "".join(rest), calls
    whole = text.strip().removeprefix(PYTHON_TAG).strip()
    if whole[:1] in "{[" and whole:
        calls = _json_calls(whole, names)
        if calls:
            return "", calls
    return text, []


def _json_calls(text: str, names: set[str]) -> list[Call]:
    """A call or a list of calls as JSON ({"name", "arguments"}, or Llama-3's {"name", "parameters"}) of the given
    functions; [] if the text is anything else."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return []
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return []
        if not isinstance(args, dict):
            return []
        calls.append(Call(item["name"], json.dumps(args, ensure_ascii=False)))
    return calls


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_message(body: G.ChatCompletionRequest, content: str | None, calls: list[Call]) -> S.AssistantMessage:
    """The answer as OpenAI shapes it: tool_calls, or with the deprecated functions, function_call (its first)."""
    if not calls:
        return S.AssistantMessage(content=content)
    if body.functions is not None:
        return S.AssistantMessage(content=content, function_call=S.CalledFunction(name=calls[0].name,
                                                                                   arguments=calls[0].arguments))
    return S.AssistantMessage(content=content, tool_calls=[
        S.CalledTool(id=new_call_id(), function=S.CalledFunction(name=c.name, arguments=c.arguments)) for c in calls])


def finish_reason(body: G.ChatCompletionRequest, calls: list[Call], reason: str) -> str:
    """An answer that called tools ends with tool_calls (function_call, deprecated), unless it was cut short."""
    if not calls or reason == "length":
        return reason
    return "function_call" if body.functions is not None else "tool_calls"


class StreamedCalls:
    """A streamed answer's text split, as it comes, into content that can go now and calls sent once whole. Text
    that may start a call is held back: from `<tool_call>` (or a partial one at the end) to the end of the answer;
    under a required call, all of it; under "auto", all of it while the answer may be a call in JSON form. A named
    function's arguments stream as they come."""

    def __init__(self, body: G.ChatCompletionRequest):
        self.body = body
        self.choice = body.chosen_tool()
        self.text = ""
        self.sent = 0
        """Characters of text sent as content (or as a named call's arguments)."""
        self.call_id = new_call_id()
        self.named = False
        """A named function's first delta (its id and name) is out."""

    def piece(self, text: str) -> S.ChatDelta | None:
        """More text -> the delta to send now (None: nothing yet)."""
        self.text += text
        if self.choice == "none":
            return self._content(len(self.text))
        if isinstance(self.choice, G.NamedFunction):
            return self._named_arguments()
        if self.choice == "required" or self._may_be_json_call():
            return None
        return self._content(self._safe_end())

    def end(self, reason: str) -> tuple[S.ChatDelta | None, str]:
        """The answer is whole -> (the last delta: held content, or the calls; the finish reason)."""
        if self.choice == "none":
            return self._content(len(self.text)), reason
        if isinstance(self.choice, G.NamedFunction):
            return self._named_arguments(), finish_reason(self.body, [Call(self.choice.name, "")], reason)
        if self.choice == "required":
            outside, calls = ("", _json_calls(self.text, {f.name for f in self.body.tool_defs()}))
        else:
            outside, calls = _auto_calls(self.text, {f.name for f in self.body.tool_defs()})
        if not calls:
            return self._content(len(self.text)), reason
        deltas = [S.ToolCallDelta(index=i, id=new_call_id(), type="function",
                                  function=S.FunctionDelta(name=c.name, arguments=c.arguments))
                  for i, c in enumerate(calls)]
        held = outside[self.sent:].rstrip() or None  # what was sent is the start of the text outside the calls
        if self.body.functions is not None:
            delta = S.ChatDelta(content=held, function_call=deltas[0].function)
        else:
            delta = S.ChatDelta(content=held, tool_calls=deltas)
        return delta, finish_reason(self.body, calls, reason)

    def _content(self, end: int) -> S.ChatDelta | None:
        if end <= self.sent:
            return None
        out, self.sent = self.text[self.sent:end], end
        return S.ChatDelta(content=out)

    def _named_arguments(self) -> S.ChatDelta | None:
        first, self.named = not self.named, True
        piece, self.sent = self.text[self.sent:], len(self.text)
        if not piece and not first:
            return None
        fn = S.FunctionDelta(name=self.choice.name if first else None, arguments=piece)
        if self.body.functions is not None:
            return S.ChatDelta(function_call=fn)
        return S.ChatDelta(tool_calls=[S.ToolCallDelta(index=0, id=self.call_id if first else None,
                                                       type="function" if first else None, function=fn)])

    def _may_be_json_call(self) -> bool:
        """Nothing sent yet, and the answer so far starts as a call in JSON form may."""
        if self.sent:
            return False
        head = self.text.lstrip()
        return not head or head[0] in "{[" or PYTHON_TAG.startswith(head[:len(PYTHON_TAG)])

    def _safe_end(self) -> int:
        """Where the text that cannot be part of a call ends."""
        at = self.text.find(CALL_OPEN)
        if at >= 0:
            return at
        for k in range(min(len(CALL_OPEN) - 1, len(self.text)), 0, -1):  # a partial <tool_call> at the end
            if CALL_OPEN.startswith(self.text[-k:]):
                return len(self.text) - k
        return len(self.text)
