"""Token accounting of an answer: OpenAI's usage bodies and the Prometheus token counter."""

from serve.http import schemas as S
from serve.metrics import Metrics


def usage(*gens) -> S.Usage:
    """Summed over the generations of one request (one per prompt); completion counts every token sampled, the
    end-of-turn token included (Generation.completion_tokens)."""
    prompt, completion = sum(g.prompt_tokens for g in gens), sum(g.completion_tokens for g in gens)
    return S.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def input_usage(result) -> S.InputUsage:
    """Encoders read tokens and write none."""
    return S.InputUsage(prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens,
                        truncated_inputs=result.truncated)


def count_tokens(metrics: Metrics, model: str, gen) -> None:
    label = metrics.model_label(model)
    metrics.tokens.labels(label, "prompt").inc(gen.prompt_tokens)
    metrics.tokens.labels(label, "completion").inc(gen.completion_tokens)
