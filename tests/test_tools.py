"""Tool calling through the official openai client: forced calls (required, a named function) validate against
their tool's schema, streamed deltas reassemble to the plain answer, tool_choice "none" is plain text, "auto"
finds a call the model writes, tool results and earlier calls reach the prompt; the reply parser on text."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from serve_parts import tiny_model_and_tokenizer, tiny_tokenizer

from bitnetlm.serve import protocol as P
from bitnetlm.serve import start
from bitnetlm.serve.offload import _chat_ids
from bitnetlm.serve.tools import Tools, ToolStream, parse_calls

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": -9, "maximum": 9},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
SCHEMA = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

# a LLaMA-3.1-style template that renders tools itself (on the tiny tokenizer's special tokens)
NATIVE = (
    "{{ bos_token }}{% if tools is not none %}<|start|>system\nEnvironment: ipython\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\n'
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|end|>\n{% endif %}"
    "{% for m in messages %}{% if m.tool_calls is defined %}<|start|>assistant\n"
    '{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    "{% endfor %}<|end|>\n{% elif m.role == 'tool' %}<|start|>ipython\n{{ m.content }}<|end|>\n"
    "{% else %}<|start|>{{ m.role }}\n{{ m.content }}<|end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def server():
    model, tok = tiny_model_and_tokenizer(max_len=1024)
    h = start(model, tok, port=0, max_batch=8, max_queue=64, log_level="warning")
    yield h
    h.stop()


def _check(calls) -> None:
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), SCHEMA[c.function.name])


def _chat(client, **kw):
    base = dict(model="bitnet", messages=ASK, tools=TOOLS, max_tokens=300, temperature=1.0, seed=5)
    return client.chat.completions.create(**{**base, **kw})


def test_parser_on_text():
    assert parse_calls('{"name": "f", "parameters": {"x": 1}}') == [("f", {"x": 1})]
    assert parse_calls('<|python_tag|>{"name": "f", "arguments": "{\\"x\\": 2}"}') == [("f", {"x": 2})]
    two = [("f", {"x": 1}), ("g", {})]
    assert parse_calls('{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}') == two
    assert parse_calls(' [{"name": "f", "arguments": {"x": 1}}, {"name": "g"}]\n') == two
    for text in ("Paris is sunny.", '{"name": "f", "parameters": {"x": 1}} and more', '{"x": 1}', "{", ""):
        assert parse_calls(text) is None, text
    t = Tools([{"name": "f"}], "auto", parallel=False)
    assert t.parse('{"name": "g", "parameters": {}}') is None  # not an offered tool
    [call] = t.parse('{"name": "f", "parameters": {"x": 1}}; {"name": "f", "parameters": {}}')
    assert call["function"] == {"name": "f", "arguments": '{"x": 1}'} and call["type"] == "function"


def _replay(tools: Tools, text: str, step: int = 3):
    """Feed `text` to a ToolStream in chunks of `step` characters; (content, calls, finish) reassembled."""
    ts, content, calls, finish = ToolStream(tools), "", {}, None
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for k, piece in enumerate(pieces):
        for delta, _, fin in ts.feed(piece, [], "stop" if k == len(pieces) - 1 else None):
            finish = fin or finish
            content += delta.get("content", "")
            for d in delta.get("tool_calls", []):
                c = calls.setdefault(d["index"], {"name": "", "arguments": ""})
                c["name"] += d.get("function", {}).get("name", "")
                c["arguments"] += d.get("function", {}).get("arguments", "")
    return content, [calls[i] for i in sorted(calls)], finish


def test_tool_stream_on_text():
    tools = Tools([{"name": "f"}, {"name": "g"}], "auto")
    text = '[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {}}]'
    want = [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in tools.parse(text)
    ]
    assert _replay(tools, text) == ("", want, "tool_calls") and len(want) == 2
    assert _replay(tools, "Paris is sunny.") == ("Paris is sunny.", [], "stop")
    assert _replay(tools, '{"name": "h"}') == ('{"name": "h"}', [], "stop")  # not an offered tool: content


def test_required_and_named_calls_validate(client):
    for seed in range(3):
        r = _chat(client, tool_choice="required", parallel_tool_calls=False, seed=seed)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        assert len(r.choices[0].message.tool_calls) == 1
        _check(r.choices[0].message.tool_calls)
    r = _chat(client, tool_choice={"type": "function", "function": {"name": "add"}})
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "add"
    _check([call])


def test_required_parallel_calls_validate(client):
    """Parallel calls are a JSON array; this random model would rather list calls forever than close it, so a
    bias against commas (still allowed where the grammar needs one: the mask outranks any bias) ends it."""
    tok = tiny_tokenizer()
    commas = {str(i): -100 for i in range(tok.vocab_size) if "," in tok.decode([i])}
    for seed in range(2):
        r = _chat(client, tool_choice="required", seed=seed, logit_bias=commas)
        assert r.choices[0].finish_reason == "tool_calls"
        _check(r.choices[0].message.tool_calls)


def test_streamed_tool_call_deltas_reassemble_to_the_plain_answer(client):
    kw = dict(tool_choice="required", parallel_tool_calls=False, temperature=0.0)
    plain = _chat(client, **kw)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in _chat(client, **kw, stream=True):
        ch = chunk.choices[0]
        finish = ch.finish_reason or finish
        for d in ch.delta.tool_calls or []:
            c = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None})
            c["id"] = d.id or c["id"]
            c["name"] += (d.function.name or "") if d.function else ""
            c["arguments"] += (d.function.arguments or "") if d.function else ""
    want = [(c.function.name, c.function.arguments) for c in plain.choices[0].message.tool_calls]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == want
    assert finish == "tool_calls" and all(c["id"].startswith("call_") for c in calls.values())


def test_tool_choice_none_is_plain_text(client):
    r = _chat(client, tool_choice="none", max_tokens=20, temperature=0.0)
    ref = client.chat.completions.create(model="bitnet", messages=ASK, max_tokens=20, temperature=0.0)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == ref.choices[0].message.content


def test_auto_finds_a_call_the_model_writes(client):
    """Under tool_choice auto a reply is free; a guided_json makes this model write a call, which auto parses."""
    call = {
        "type": "object",
        "properties": {"name": {"const": "get_weather"}, "parameters": WEATHER},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }
    r = _chat(client, tool_choice="auto", extra_body={"guided_json": call})
    assert r.choices[0].finish_reason == "tool_calls"
    _check(r.choices[0].message.tool_calls)
    r = _chat(client, tool_choice="auto", max_tokens=10, temperature=0.0)  # noise: no call, plain content
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_multi_turn_with_a_tool_result(client):
    first = _chat(client, tool_choice="required", parallel_tool_calls=False).choices[0].message
    [call] = first.tool_calls
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    r = _chat(client, messages=history, tool_choice={"type": "function", "function": {"name": "add"}})
    _check(r.choices[0].message.tool_calls)
    plain = _chat(client, messages=history, tool_choice="none", max_tokens=5)
    assert plain.usage.prompt_tokens > _chat(client, tool_choice="none", max_tokens=5).usage.prompt_tokens


def _history():
    return [
        P.ChatMessage(**ASK[0]),
        P.ChatMessage(
            role="assistant",
            tool_calls=[{"id": "call_1", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}],
        ),
        P.ChatMessage(role="tool", tool_call_id="call_1", content="3"),
    ]


def test_prompt_through_a_template_with_tools_and_the_generic_fallback():
    tools = P.ChatCompletionRequest(messages=ASK, tools=TOOLS).tool_setup()
    native = tiny_tokenizer()
    native.chat_template = NATIVE
    text = native.decode(_chat_ids(native, _history(), True, tools), skip_special_tokens=False)
    assert "Environment: ipython" in text and '"name": "get_weather"' in text  # the template's own rendering
    assert '{"name": "add", "parameters": {"a": 1, "b": 2}}' in text and "ipython\n3" in text
    plain = tiny_tokenizer()  # a template that never mentions tools: the tools in a system message
    text = plain.decode(_chat_ids(plain, _history(), True, tools), skip_special_tokens=False)
    assert text.count("<|start|>system") == 1 and "respond with only a JSON object" in text
    assert '"get_weather"' in text and '{"name": "add", "parameters": {"a": 1, "b": 2}}' in text
    assert "<|start|>tool\n3" in text


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_tool_errors(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(
            client,
            **{k: v for k, v in kw.items() if v is not None},
            **({} if kw.get("tools", 1) else {"tools": openai.NOT_GIVEN}),
        )
    assert e.value.body["param"] == param and "\n" not in e.value.body["message"]
