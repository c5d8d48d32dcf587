"""Tool calls read back out of a model's text, whole and streamed (Hermes' <tool_call> blocks, Llama-3's JSON form,
text that is not a call), and tools reaching the prompt: through a template that takes them, or one system message
where it does not (SmolLM2's)."""

import json

import pytest

from serve.data.models import smollm2_dir
from serve.engine.prompts import TOOL_PROMPT, Prompts
from serve.http import generation_schemas as G
from serve.http.tools import StreamedCalls, read_calls

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}


def request(**kw) -> G.ChatCompletionRequest:
    return G.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                   tools=[{"type": "function", "function": f} for f in (WEATHER, TIME)], **kw)


HERMES = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
LLAMA = '<|python_tag|>{"name": "get_time", "parameters": {}}'


@pytest.mark.parametrize("text,content,calls", [
    (HERMES, "Let me look.", [("get_weather", {"city": "Paris"})]),
    (HERMES + '\n<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>', "Let me look.",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    (LLAMA, None, [("get_time", {})]),
    ('[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]', None,
     [("get_time", {}), ("get_weather", {"city": "Oslo"})]),
    ("It is sunny.", "It is sunny.", []),
    ('{"name": "not_a_tool", "arguments": {}}', '{"name": "not_a_tool", "arguments": {}}', []),
    (HERMES[13:-20], HERMES[13:-20], []),  # a call cut short stays text
])
def test_auto_reads_calls_in_the_models_own_forms_and_leaves_other_text_as_text(text, content, calls):
    got_content, got = read_calls(request(), text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def streamed(body: G.ChatCompletionRequest, pieces: list[str], reason: str = "stop") -> tuple[list, str]:
    split = StreamedCalls(body)
    deltas = [split.piece(p) for p in pieces]
    last, reason = split.end(reason)
    return [d for d in deltas + [last] if d is not None], reason


def test_a_stream_sends_text_at_once_and_holds_back_a_call_until_it_is_whole():
    pieces = ["Let me", " look.", "\n<tool", "_call>\n", '{"name": "get_weather", ', '"arguments": {"city": "Paris"}}',
              "\n</tool_call>"]
    deltas, reason = streamed(request(), pieces)
    assert [d.content for d in deltas if d.content] == ["Let me", " look.", "\n"]
    calls = [c for d in deltas for c in d.tool_calls or []]
    assert reason == "tool_calls" and [(c.index, c.function.name) for c in calls] == [(0, "get_weather")]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"} and calls[0].id.startswith("call_")


def test_a_stream_of_text_that_only_looked_like_json_is_sent_whole_at_the_end():
    deltas, reason = streamed(request(), ["{not", " a call}"])
    assert reason == "stop" and [d.content for d in deltas] == ["{not a call}"]


def test_a_named_functions_arguments_stream_as_they_come():
    body = request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    deltas, reason = streamed(body, ['{"city"', ': "Rome"}'])
    assert reason == "tool_calls"
    assert deltas[0].tool_calls[0].function.name == "get_weather" and deltas[0].tool_calls[0].id
    assert "".join(d.tool_calls[0].function.arguments for d in deltas) == '{"city": "Rome"}'


def test_tool_choice_none_is_plain_text_even_when_it_reads_as_a_call():
    deltas, reason = streamed(request(tool_choice="none"), [HERMES])
    assert reason == "stop" and deltas[0].content == HERMES and read_calls(request(tool_choice="none"), HERMES)[1] == []


@pytest.fixture
def prompts():
    from transformers import AutoTokenizer

    return Prompts("smollm2", AutoTokenizer.from_pretrained(smollm2_dir()), 2048, 2048)


CALLED = [{"role": "user", "content": "weather"},
          {"role": "assistant", "content": "", "tool_calls": [
              {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
          {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
TOOLS = [{"type": "function", "function": WEATHER}]


def test_a_template_without_tools_gets_them_in_one_system_message_and_calls_as_text(prompts):
    assert not prompts.takes_tools  # SmolLM2's template knows no tools
    expected = prompts.tokenizer.apply_chat_template([
        {"role": "system", "content": TOOL_PROMPT.format(tools=json.dumps(WEATHER))},
        {"role": "user", "content": "weather"},
        {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                                         '</tool_call>'},
        {"role": "tool", "content": "<tool_response>\nsunny\n</tool_response>"}], tokenize=False,
        add_generation_prompt=True)
    assert prompts.tokenizer.decode(prompts.chat(CALLED, TOOLS)) == expected
    assert "get_weather" not in prompts.tokenizer.decode(prompts.chat(CALLED[:1]))


def test_a_template_that_takes_tools_renders_them_itself(prompts):
    prompts.tokenizer.chat_template = (
        "{% for t in tools %}TOOL {{ t['function']['name'] }} | {% endfor %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
        "{% for c in m.get('tool_calls', []) %}CALL {{ c['function']['arguments']['city'] }}{% endfor %} | "
        "{% endfor %}assistant:")
    assert prompts.takes_tools
    text = prompts.tokenizer.decode(prompts.chat(CALLED, TOOLS))
    assert text == "TOOL get_weather | user: weather | assistant: CALL Oslo | tool: sunny | assistant:"
