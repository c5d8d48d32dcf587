"""A base's requests as the event loop reads them: prompts to token ids, chats under the template, and the checks
that they fit, with the event loop's own tokenizer.

The compute thread has its own (BaseModelRuntime.tokenizer): a fast tokenizer changes its truncation and padding
state on every call and raises "Already borrowed" when two threads call it at once, so no tokenizer is ever
shared between threads.
"""

import json

from serve.engine.types import SamplingParams
from serve.errors import BadRequest

TOOL_PROMPT = """You may call these tools. To call one, answer with only this, one block a call:
<tool_call>
{{"name": "<the tool's name>", "arguments": <its arguments, a JSON object>}}
</tool_call>
Otherwise, answer as usual. The tools, as JSON:
{tools}"""
"""How tools reach a model whose chat template does not take them (as TGI's tool_prompt does): a system message (before
the conversation's own system message, in the same message), in Hermes' form of a call, which the ingress reads back
(serve/http/tools.py)."""


def token_counts(tokenizer, texts: list[str]) -> list[int]:
    """Tokens of each text, special tokens included, before any truncation."""
    return [len(i) for i in tokenizer(texts)["input_ids"]] if texts else []


class Prompts:
    def __init__(self, name: str, tokenizer, max_length: int, max_input_tokens: int):
        self.name = name
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.max_input_tokens = max_input_tokens
        self.context = "context"
        """What bounds a row's positions, as errors name it."""

    def limit(self, positions: int, by: str) -> None:
        """Rows hold at most `positions` positions, bounded by `by` (the KV cache where it holds fewer than
        max_model_len), which errors name."""
        self.max_length = self.max_input_tokens = positions
        self.context = by

    def check_inputs_fit(self, texts: list[str]) -> None:
        for i, n in enumerate(token_counts(self.tokenizer, texts)):
            if n > self.max_input_tokens:
                raise BadRequest(f"input {i}: {n} tokens; model '{self.name}' reads at most {self.max_input_tokens} "
                                 f"(send truncate: true to cut it)")

    @property
    def takes_tools(self) -> bool:
        """The chat template renders tools itself (it reads a `tools` variable), and tool calls and results with
        them."""
        return "tools" in (self.tokenizer.chat_template or "")

    def chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """messages (and tools) in OpenAI's form, under the template: with the template's own tools where it takes
        them, or else TOOL_PROMPT as a system message and the calls and their results written as text."""
        if not self.tokenizer.chat_template:
            raise BadRequest(f"model '{self.name}' has no chat template")
        from jinja2 import TemplateError

        if self.takes_tools:
            messages, extra = [_structured_calls(m) for m in messages], {"tools": tools} if tools else {}
        else:
            messages, extra = [_calls_as_text(m) for m in messages], {}
            if tools:
                messages = with_tool_prompt(messages, tools)
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False, **extra)
        except TemplateError as e:  # the template's own check, such as roles it does not take
            raise BadRequest(f"messages: the chat template of '{self.name}' refuses them: {e}") from None
        return list(ids)

    def check_sampling(self, params: SamplingParams) -> None:
        """Token ids a request's controls name are in the vocabulary."""
        vocab = len(self.tokenizer)
        named = (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids))
        for field, ids in named:
            for i in ids:
                if not 0 <= i < vocab:
                    raise BadRequest(f"{field}: token id {i} is outside the vocabulary (0 to {vocab - 1})")

    def check_token_ids(self, ids: list[int]) -> list[int]:
        vocab = len(self.tokenizer)
        for i in ids:
            if not 0 <= i < vocab:
                raise BadRequest(f"prompt: token id {i} is outside the vocabulary (0 to {vocab - 1})")
        return list(ids)

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def check_fits(self, prompt: list[int], max_tokens: int | None) -> None:
        """max_tokens None: the client sent none, so the prompt alone must leave room for one token (and the
        message names no max it never sent)."""
        n, context = len(prompt), f"the {self.context} of {self.max_length} tokens"
        if not prompt:
            raise BadRequest("the prompt encodes to no tokens")
        if max_tokens is None and n > self.max_length:
            raise BadRequest(f"prompt ({n} tokens) exceeds {context}")
        if max_tokens is None and n == self.max_length:
            raise BadRequest(f"prompt ({n} tokens) fills {context}, leaving no room for a completion")
        if max_tokens is not None and n + max_tokens > self.max_length:
            raise BadRequest(f"prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds {context}")


def with_tool_prompt(messages: list[dict], tools: list[dict]) -> list[dict]:
    """TOOL_PROMPT first in the conversation's own system (or developer) message, or as a system message of its own."""
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    prompt = TOOL_PROMPT.format(tools=listing)
    if messages and messages[0]["role"] in ("system", "developer"):
        return [{**messages[0], "content": prompt + "\n\n" + messages[0]["content"]}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _calls_as_text(m: dict) -> dict:
    """A message as a template that knows no tools reads it: an assistant's calls as <tool_call> blocks after its
    text, a tool's result inside <tool_response>."""
    if m["role"] == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
    if not m.get("tool_calls"):
        return m
    blocks = [f'<tool_call>\n{{"name": {json.dumps(c["function"]["name"])}, "arguments": {c["function"]["arguments"]}}}'
              f"\n</tool_call>" for c in m["tool_calls"]]
    text = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
    return {k: v for k, v in m.items() if k != "tool_calls"} | {"content": text}


def _structured_calls(m: dict) -> dict:
    """A message as templates that take tools read it (transformers' convention): a call's arguments as a mapping."""
    if not m.get("tool_calls"):
        return m
    calls = []
    for c in m["tool_calls"]:
        try:
            args = json.loads(c["function"]["arguments"])
        except ValueError:
            raise BadRequest(f"messages: tool call '{c['id']}' has arguments that are not JSON") from None
        calls.append({**c, "function": {"name": c["function"]["name"], "arguments": args}})
    return {**m, "tool_calls": calls}
