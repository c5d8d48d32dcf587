"""Limits the routes check beyond their schemas, from config.limits: inputs per request, characters per input,
max_tokens. (The body-size limit is checked earlier, in middleware.py.)"""

from serve.config import LimitsConfig
from serve.errors import BadRequest, TooLarge


def check_texts(limits: LimitsConfig, texts: list[str]) -> None:
    if len(texts) > limits.max_inputs:
        raise TooLarge(f"{len(texts)} inputs; at most {limits.max_inputs} per request")
    for t in texts:
        if len(t) > limits.max_input_chars:
            raise TooLarge(f"an input of {len(t)} characters; at most {limits.max_input_chars}")


def check_max_tokens(limits: LimitsConfig, max_tokens: int | None) -> None:
    """max_tokens None: the engine runs to the end of the context, within limits.max_tokens."""
    if max_tokens is not None and max_tokens > limits.max_tokens:
        raise BadRequest(f"max_tokens: at most {limits.max_tokens} on this server, got {max_tokens}")
