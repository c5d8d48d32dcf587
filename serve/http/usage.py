"""Token accounting of an answer: OpenAI's usage bodies and the Prometheus token counter."""

from serve.http import schemas as S
from serve.metrics import Metrics


def usage(gens: list, n: int = 1) -> S.Usage:
    """Summed over the generations of one request (or their latest streamed pieces), n choices a prompt, in order:
    a prompt counts once, as OpenAI and vLLM count it, and so do its tokens read from the prefix cache (the first
    choice's); completion counts every token sampled, the end-of-turn token included (Generation.completion_tokens)."""
    prompt = sum(g.prompt_tokens for g in gens[::n])
    completion = sum(g.completion_tokens for g in gens)
    cached = sum(g.cached_tokens for g in gens[::n])
    return S.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=S.PromptTokensDetails(cached_tokens=cached))


def input_usage(result) -> S.InputUsage:
    """Encoders read tokens and write none."""
    return S.InputUsage(prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens,
                        truncated_inputs=result.truncated)


def count_tokens(metrics: Metrics, model: str, gen, first: bool = True) -> None:
    """first: the generation is its prompt's first choice (a prompt's tokens count once)."""
    label = metrics.model_label(model)
    if first:
        metrics.tokens.labels(label, "prompt").inc(gen.prompt_tokens)
    metrics.tokens.labels(label, "completion").inc(gen.completion_tokens)
