"""Scenario "structured": what tenants' programs send, through `manyfold serve` on the demo store and the clients those
programs use, over a PiSSA adapter (served as LoRA), an EMR task, a full fine-tune and the NeuZip base, in turn:

- the official client's `beta.chat.completions.parse(response_format=Article)` (serve/bench/structured.py's
  schema, BBC News test articles), 16 requests a model, 16 at once: how many return a parsed object; then the same
  requests without the constraint (the prompt spells the schema out): how many answers parse and validate;
- LangChain's `ChatOpenAI(...).with_structured_output(Article, method="json_schema")`, a request a model;
- `tool_choice="required"` with two tools, 32 requests streamed and 32 not: calls whose arguments validate against
  their function's parameters;
- a `choice` constraint on completions (vLLM's structured_outputs): only the listed labels;
- a streamed completion with `ignore_eos`, `max_tokens: 64` and `continuous_usage_stats` on every model: exactly 64
  tokens, usage in every chunk; GET /health.

    python -m loadtests.run --scenario structured [--requests 16] [--out bench-results/structured-serve.json]
"""

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import httpx
from pydantic import BaseModel, Field, ValidationError

from loadtests.fairness import Server
from loadtests.fairness_load import log
from loadtests.generator import free_port
from serve.bench.report import machine
from serve.bench.structured import MIX, Article, prompts, valid

LABELS = ["business", "entertainment", "politics", "sport", "tech"]


class Weather(BaseModel):
    city: str = Field(max_length=40)
    unit: Literal["celsius", "fahrenheit"]


class Clock(BaseModel):
    timezone: str = Field(max_length=40)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                           "parameters": Weather.model_json_schema()}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now in a time zone",
                                           "parameters": Clock.model_json_schema()}}]
ARGUMENTS = {"get_weather": Weather, "get_time": Clock}
QUESTIONS = ["What is the weather like in Paris?", "What time is it in Tokyo?", "Is it raining in London right now?",
             "Tell me the current time in New York."]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.run --scenario structured")
    p.add_argument("--scenario", default="structured")
    p.add_argument("--store", help="the demo store (default: built if missing)")
    p.add_argument("--requests", type=int, default=16, help="parse() requests a model (and as many without)")
    p.add_argument("--out", default="bench-results/structured-serve.json")
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.store is None:
        from serve.demo import build_demo_store

        args.store = str(build_demo_store().root)
    config = {"store": args.store, "port": free_port(), "limits": {"max_tokens": 256}}
    with Server(config, args.start_timeout_s) as url:
        report = {"machine": machine(), "models": list(MIX), "health": httpx.get(f"{url}/health").status_code,
                  "seconds": {}}
        for name, check in (("parse", lambda: parsed(url, args.requests)), ("langchain", lambda: langchain(url)),
                            ("tools", lambda: tool_calls(url)), ("choice", lambda: choices(url)),
                            ("ignore_eos", lambda: exact_tokens(url))):
            t0 = time.perf_counter()
            report[name] = check()
            report["seconds"][name] = time.perf_counter() - t0
            log(f"{name}: {json.dumps(report[name])}")
    print_report(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return report


def client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)


def each(jobs: list, fn, width: int = 16) -> list:
    with ThreadPoolExecutor(width) as pool:
        return list(pool.map(fn, jobs))


def parsed(url: str, per_model: int) -> dict:
    """parse() with the schema, then the same requests free: by model, how many answers are a valid Article."""
    oa, chats = client(url), prompts()
    jobs = [(MIX[i % len(MIX)], chats[i % len(chats)], i) for i in range(per_model * len(MIX))]

    def constrained(job) -> bool:
        model, chat, i = job
        r = oa.beta.chat.completions.parse(model=model, messages=chat, response_format=Article, max_tokens=160,
                                           temperature=0.7, seed=i)
        return isinstance(r.choices[0].message.parsed, Article)

    def free(job) -> bool:
        model, chat, i = job
        r = oa.chat.completions.create(model=model, messages=chat, max_tokens=160, temperature=0.7, seed=i)
        return valid(r.choices[0].message.content or "")

    out = {}
    for how, fn in (("constrained", constrained), ("free", free)):
        ok = each(jobs, fn)
        out[how] = {m: f"{sum(o for o, j in zip(ok, jobs) if j[0] == m)} of {per_model}" for m in MIX}
        out[how]["all"] = f"{sum(ok)} of {len(jobs)}"
    return out


def langchain(url: str) -> dict:
    from langchain_openai import ChatOpenAI

    chats = prompts()
    got = {}
    for i, model in enumerate(MIX):
        llm = ChatOpenAI(model=model, base_url=f"{url}/v1", api_key="none", max_tokens=160, temperature=0)
        answer = llm.with_structured_output(Article, method="json_schema").invoke(chats[i][0]["content"])
        got[model] = type(answer).__name__
    return {"objects": f"{sum(v == 'Article' for v in got.values())} of {len(MIX)}", "by_model": got}


def tool_calls(url: str) -> dict:
    """tool_choice required, two tools: 32 requests streamed, 32 not; every call's arguments against its function."""
    oa = client(url)
    jobs = [(MIX[i % len(MIX)], QUESTIONS[i % len(QUESTIONS)], i) for i in range(32)]

    def call(job, stream: bool) -> bool:
        model, question, i = job
        kw = dict(model=model, messages=[{"role": "user", "content": question}], tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, max_tokens=80, temperature=0.7, seed=i)
        if stream:
            name, arguments, reason = "", "", None
            for chunk in oa.chat.completions.create(stream=True, **kw):
                for d in chunk.choices[0].delta.tool_calls or []:
                    name += d.function.name or ""
                    arguments += d.function.arguments or ""
                reason = chunk.choices[0].finish_reason or reason
        else:
            r = oa.chat.completions.create(**kw)
            calls, reason = r.choices[0].message.tool_calls or [], r.choices[0].finish_reason
            name, arguments = (calls[0].function.name, calls[0].function.arguments) if calls else ("", "")
        try:
            return reason == "tool_calls" and ARGUMENTS[name].model_validate_json(arguments) is not None
        except (KeyError, ValidationError):
            return False

    out = {}
    for how, stream in (("not streamed", False), ("streamed", True)):
        ok = each(jobs, lambda j: call(j, stream))
        out[how] = f"{sum(ok)} of {len(jobs)}"
    return out


def choices(url: str) -> dict:
    """vLLM's structured_outputs choice on completions: every answer one of the labels."""
    oa, chats = client(url), prompts()
    jobs = [(MIX[i % len(MIX)], chats[i][0]["content"][-600:] + "\nTopic:", i) for i in range(16)]

    def ask(job) -> str:
        model, prompt, i = job
        r = oa.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0.7, seed=i,
                                  extra_body={"structured_outputs": {"choice": LABELS}})
        return r.choices[0].text

    texts = each(jobs, ask)
    return {"labels": f"{sum(t in LABELS for t in texts)} of {len(texts)}", "answers": sorted(set(texts))}


def exact_tokens(url: str) -> dict:
    """ignore_eos, max_tokens 64, continuous usage: the completion tokens of the last chunk, and whether every chunk
    carried usage, by model."""
    out = {}
    for model in MIX:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=600, json={
                "model": model, "prompt": "Hello", "max_tokens": 64, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        out[model] = {"completion_tokens": chunks[-1]["usage"]["completion_tokens"],
                      "usage_in_every_chunk": all(c.get("usage") for c in chunks), "chunks": len(chunks)}
    return out


def print_report(r: dict) -> None:
    print(f"structured outputs through manyfold serve, on {r['machine']}; GET /health {r['health']}")
    print(f"{'check':34} " + " ".join(f"{m:>20}" for m in MIX) + f" {'all':>12}")
    for how in ("constrained", "free"):
        row = r["parse"][how]
        print(f"{'parse(), ' + how:34} " + " ".join(f"{row[m]:>20}" for m in MIX) + f" {row['all']:>12}")
    print(f"{'langchain with_structured_output':34} {r['langchain']['objects']}")
    print(f"{'tool_choice required':34} not streamed {r['tools']['not streamed']}, streamed {r['tools']['streamed']}")
    print(f"{'choice constraint':34} {r['choice']['labels']} answers a label: {', '.join(r['choice']['answers'])}")
    print(f"{'ignore_eos, 64 tokens':34} " + " ".join(
        f"{str(v['completion_tokens']) + (' usage' if v['usage_in_every_chunk'] else ''):>20}"
        for v in r["ignore_eos"].values()))
