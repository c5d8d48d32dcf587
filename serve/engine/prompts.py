"""A base's requests as the event loop reads them: prompts to token ids, chats under the template, and the checks
that they fit, with the event loop's own tokenizer.

The compute thread has its own (BaseModelRuntime.tokenizer): a fast tokenizer changes its truncation and padding
state on every call and raises "Already borrowed" when two threads call it at once, so no tokenizer is ever
shared between threads.
"""

from serve.errors import BadRequest


def token_counts(tokenizer, texts: list[str]) -> list[int]:
    """Tokens of each text, special tokens included, before any truncation."""
    return [len(i) for i in tokenizer(texts)["input_ids"]] if texts else []


class Prompts:
    def __init__(self, name: str, tokenizer, max_length: int, max_input_tokens: int):
        self.name = name
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.max_input_tokens = max_input_tokens

    def check_inputs_fit(self, texts: list[str]) -> None:
        for i, n in enumerate(token_counts(self.tokenizer, texts)):
            if n > self.max_input_tokens:
                raise BadRequest(f"input {i}: {n} tokens; model '{self.name}' reads at most {self.max_input_tokens} "
                                 f"(send truncate: true to cut it)")

    def chat(self, messages: list[dict]) -> list[int]:
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

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def check_fits(self, prompt: list[int], max_tokens: int | None) -> None:
        """max_tokens None: the client sent none, so the prompt alone must leave room for one token (and the
        message names no max it never sent)."""
        n, context = len(prompt), self.max_length
        if not prompt:
            raise BadRequest("the prompt encodes to no tokens")
        if max_tokens is None and n > context:
            raise BadRequest(f"prompt ({n} tokens) exceeds the context of {context} tokens")
        if max_tokens is None and n == context:
            raise BadRequest(f"prompt ({n} tokens) fills the context of {context} tokens, leaving no room for a "
                             f"completion")
        if max_tokens is not None and n + max_tokens > context:
            raise BadRequest(f"prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds the context of {context} "
                             f"tokens")
