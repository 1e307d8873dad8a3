"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) with the
real `anthropic` SDK against the real daemon, MTP on (k = 1): a system prompt and earlier
turns; tool_choice any giving a tool_use whose input fits the schema, and the tool_result
turn after it; a named tool; thinking blocks under --reasoning_parser=deepseek_r1;
`messages.stream` accumulating to the whole answer (text, tool input, thinking) and its
event order; count_tokens against /tokenize; x-api-key; bad input as 400s in Anthropic's
error shape naming the field; and greedy answers identical to /v1/chat/completions for
the same conversation (each side written here, in its own API's shape)."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.server_utils import HTTP, Server

KEY = "sk-messages-test"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 12}},
    "required": ["timezone"],
}
TOOLS = [
    {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER},
    {"name": "get_time", "input_schema": TIME},
]
OPENAI_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description":
     "The weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server():
    with Server(
        "--dtype=float32",
        "--num_speculative_tokens=1",
        "--tool_call_parser=deepseek_v3",
        "--enable_auto_tool_choice",
        f"--api_key={KEY}",
    ) as s:
        yield s


@pytest.fixture(scope="module")
def thinker():
    with Server(
        "--dtype=float32", "--num_speculative_tokens=1", "--reasoning_parser=deepseek_r1"
    ) as s:
        yield s


def sdk(server, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=120)


def name(server) -> str:
    auth = {"Authorization": f"Bearer {KEY}"}
    return HTTP.get(server.url + "/v1/models", headers=auth, timeout=10).json()["data"][0]["id"]


def post(server, path: str, body: dict) -> httpx.Response:
    return HTTP.post(server.url + path, json=body, headers={"x-api-key": KEY}, timeout=120)


def tokenized(server, messages: list[dict], tools: list | None = None) -> int:
    """/tokenize's count of the rendered chat conversation (the OpenAI shape)."""
    body = {"messages": messages} | ({"tools": tools} if tools else {})
    return post(server, "/tokenize", body).json()["count"]


def chat(server, messages: list[dict], **kw) -> dict:
    body = {"messages": messages, "temperature": 0, **kw}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def without_ids(message) -> dict:
    """The message as a dict, without its id and its tool_use blocks' (fresh each call),
    and without usage.speculative (the SDK keeps message_start's usage fields other than
    the token counts; the daemon's extension is in message_delta's usage)."""
    d = message.model_dump(exclude={"id"})
    d["usage"].pop("speculative", None)
    d["content"] = [{k: v for k, v in b.items() if k != "id"} for b in d["content"]]
    return d


def texts(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


CONVERSATION = dict(
    system="You are a terse assistant.",
    messages=[
        {"role": "user", "content": "Hello, who are you?"},
        {"role": "assistant", "content": [{"type": "text", "text": "A small model."}]},
        {"role": "user", "content": [{"type": "text", "text": "Tell me about the sea."}]},
    ],
)
AS_CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Hello, who are you?"},
    {"role": "assistant", "content": "A small model."},
    {"role": "user", "content": "Tell me about the sea."},
]


def test_a_conversation_with_a_system_prompt_and_earlier_turns(server):
    client = sdk(server)
    m = client.messages.create(model=name(server), max_tokens=16, extra_body=GREEDY, **CONVERSATION)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == name(server)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert m.usage.input_tokens == tokenized(server, AS_CHAT)
    assert 0 < m.usage.output_tokens <= 16
    if m.stop_reason == "max_tokens":
        assert m.usage.output_tokens == 16
    # a stop sequence cuts the answer where it appears, and says so
    word = m.content[0].text.split()[1]
    cut = client.messages.create(
        model=name(server), max_tokens=16, stop_sequences=[word], extra_body=GREEDY,
        **CONVERSATION,
    )  # fmt: skip
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert m.content[0].text.startswith(cut.content[0].text) and word not in cut.content[0].text


def any_tool(client, model: str) -> dict:
    return dict(
        model=model,
        max_tokens=96,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    )


def test_tool_choice_any_gives_a_tool_use_and_the_tool_result_turn_follows(server):
    client = sdk(server)
    m = client.messages.create(**any_tool(client, name(server)))
    assert m.stop_reason == "tool_use"
    (call,) = [b for b in m.content if b.type == "tool_use"]
    assert call.id and call.name in ("get_weather", "get_time")
    jsonschema.validate(call.input, {"get_weather": WEATHER, "get_time": TIME}[call.name])
    result = {"type": "tool_result", "tool_use_id": call.id, "content": '{"temperature": 21}'}
    follow = [*ASK, {"role": "assistant", "content": m.content}, {"role": "user",
              "content": [result]}]  # fmt: skip
    r = client.messages.create(
        model=name(server), max_tokens=24, messages=follow, tools=TOOLS, extra_body=GREEDY
    )  # tool_choice auto: this model answers in text
    assert r.stop_reason in ("end_turn", "max_tokens") and texts(r)
    as_chat = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function",
         "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]  # fmt: skip
    assert r.usage.input_tokens == tokenized(server, as_chat, OPENAI_TOOLS)
    named = client.messages.create(
        **{**any_tool(client, name(server)), "tool_choice": {"type": "tool", "name": "get_time"}}
    )
    (call,) = named.content
    assert call.type == "tool_use" and call.name == "get_time"
    jsonschema.validate(call.input, TIME)


def test_a_stream_accumulates_to_the_whole_answer(server):
    client = sdk(server)
    ask = dict(model=name(server), max_tokens=24, extra_body=GREEDY, **CONVERSATION)
    whole = client.messages.create(**ask)
    with client.messages.stream(**ask) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == texts(whole)
    assert without_ids(final) == without_ids(whole)
    tools = any_tool(client, name(server))
    whole = client.messages.create(**tools)
    with client.messages.stream(**tools) as stream:
        events = list(stream)
        final = stream.get_final_message()
    fragments = [e for e in events if e.type == "content_block_delta"]
    assert len(fragments) > 2 and all(e.delta.type == "input_json_delta" for e in fragments)
    assert final.content[0].input == whole.content[0].input and final.stop_reason == "tool_use"
    assert without_ids(final) == without_ids(whole)


def test_the_event_stream_is_anthropics_sequence(server):
    body = {"messages": ASK, "max_tokens": 8, "stream": True, "temperature": 0}
    with HTTP.stream(
        "POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    names = [ln[7:] for ln in lines if ln.startswith("event: ")]
    datas = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]
    assert [d["type"] for d in datas] == names  # each event's data names it too
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert datas[0]["message"]["content"] == [] and datas[0]["message"]["stop_reason"] is None
    assert datas[-2]["delta"]["stop_reason"] == "max_tokens"
    assert datas[-2]["usage"]["output_tokens"] == 8
    spec = datas[-2]["usage"]["speculative"]  # MTP on (--report_speculative_usage)
    assert 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]


def test_count_tokens_is_the_rendered_prompts_length(server):
    client = sdk(server)
    counted = client.messages.count_tokens(model=name(server), tools=TOOLS, **CONVERSATION)
    assert counted.input_tokens == tokenized(server, AS_CHAT, OPENAI_TOOLS)
    plain = client.messages.count_tokens(model=name(server), **CONVERSATION)
    assert plain.input_tokens == tokenized(server, AS_CHAT) < counted.input_tokens


def test_the_api_key_is_checked_and_refusals_are_anthropic_shaped(server):
    with pytest.raises(anthropic.AuthenticationError) as e:
        sdk(server, key="wrong").messages.create(model=name(server), max_tokens=2, messages=ASK)
    assert e.value.status_code == 401
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error"
    assert "x-api-key" in e.value.body["error"]["message"]
    r = HTTP.post(server.url + "/v1/messages", json={"messages": ASK, "max_tokens": 2})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        sdk(server).messages.create(model="claude-nope", max_tokens=2, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error" and "claude-nope" in str(e.value)
    ok = HTTP.post(server.url + "/v1/chat/completions", json={"messages": ASK})
    assert set(ok.json()["error"]) == {"message", "type", "param", "code"}  # OpenAI's, there


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
PDF = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}
DROP = object()  # the field left out
ORPHAN = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                        "content": "ok"}]}]  # fmt: skip


@pytest.mark.parametrize(
    "named, body",
    [
        ("max_tokens", {"max_tokens": DROP}),
        ("max_tokens", {"max_tokens": None}),
        ("max_tokens", {"max_tokens": "8"}),
        ("max_tokens", {"max_tokens": 0}),
        ("messages[2].content[0].tool_use_id", {"messages": ORPHAN}),
        ("messages.0.content", {"messages": [{"role": "user", "content": [IMAGE]}]}),
        ("'image'", {"messages": [{"role": "user", "content": [IMAGE]}]}),
        ("'document'", {"messages": [{"role": "user", "content": [PDF]}]}),
        ("messages.0.role", {"messages": [{"role": "system", "content": "Hi"}]}),
        ("messages[1]", {"messages": [*ASK, {"role": "assistant", "content": "The"}]}),
        ("temperature", {"temperature": 1.5}),
        ("top_k", {"top_k": -1}),
        ("stop_sequences", {"stop_sequences": ["x"] * 17}),
        ("tool_choice.name", {"tools": TOOLS, "tool_choice": {"type": "tool"}}),
        ("tool_choice", {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}),
        ("tools.0", {"tools": [{"type": "bash_20250124", "name": "bash"}]}),
        ("tools[0].input_schema", {"tools": [{"name": "f", "input_schema": {"type": "string"}}]}),
        ("thinking.type", {"thinking": {"type": "enabled", "budget_tokens": 8}}),
        ("output_config", {"tools": TOOLS, "tool_choice": {"type": "any"},
                           "output_config": {"format": {"type": "json_schema", "schema": {}}}}),
        ("mcp_servers", {"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(server, named, body):
    body = {k: v for k, v in {"messages": ASK, "max_tokens": 8, **body}.items() if v is not DROP}
    r = post(server, "/v1/messages", body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and set(err["error"]) == {"type", "message"}
    assert err["error"]["type"] == "invalid_request_error"
    assert named in err["error"]["message"], err


def test_a_bad_request_raises_the_sdks_error(server):
    with pytest.raises(anthropic.BadRequestError) as e:
        sdk(server).messages.create(
            model=name(server), max_tokens=8, messages=[{"role": "user", "content": [IMAGE]}]
        )
    assert "'image'" in e.value.body["error"]["message"]


def test_thinking_comes_back_as_a_thinking_block(thinker):
    """The bundled model never closes its <think>, so a thinking answer is one thinking
    block: chat's reasoning_content for the same conversation."""
    client = sdk(thinker)
    ask = dict(model=name(thinker), max_tokens=12, messages=ASK, extra_body=GREEDY)
    m = client.messages.create(**ask, thinking={"type": "enabled", "budget_tokens": 12})
    want = chat(thinker, ASK, max_tokens=12)["choices"][0]["message"]
    assert [b.type for b in m.content] == ["thinking"]
    assert m.content[0].thinking == want["reasoning_content"] and want["content"] is None
    assert m.stop_reason == "max_tokens"
    with client.messages.stream(**ask, thinking={"type": "adaptive"}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert without_ids(final) == without_ids(m)
    assert any(e.type == "content_block_delta" and e.delta.type == "thinking_delta"
               for e in events)  # fmt: skip
    hidden = client.messages.create(**ask, thinking={"type": "adaptive", "display": "omitted"})
    assert [(b.type, b.thinking) for b in hidden.content] == [("thinking", "")]
    for thinking, field in (
        ({"type": "enabled", "budget_tokens": 11}, "thinking.budget_tokens"),
        ({"type": "enabled"}, "thinking.budget_tokens"),
        ({"type": "disabled"}, "thinking.type"),
    ):
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(**ask, thinking=thinking)
        assert e.value.body["error"]["message"].startswith(field), e.value.body


PROMPTS = [
    [{"role": "user", "content": "Tell me a story about a cat."}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "How do planes fly?"},
    ],  # fmt: skip
    [{"role": "user", "content": "Write a haiku about rain."}],
]


@pytest.mark.parametrize("messages", PROMPTS)
def test_greedy_answers_are_chats_answers(server, messages):
    m = sdk(server).messages.create(
        model=name(server), max_tokens=32, messages=messages, system="Be helpful.",
        extra_body=GREEDY,
    )  # fmt: skip
    c = chat(server, [{"role": "system", "content": "Be helpful."}, *messages], max_tokens=32)
    assert texts(m) == c["choices"][0]["message"]["content"]
    assert m.usage.output_tokens == c["usage"]["completion_tokens"]
    assert m.usage.input_tokens == c["usage"]["prompt_tokens"]
    reason = {"length": "max_tokens", "stop": "end_turn"}[c["choices"][0]["finish_reason"]]
    assert m.stop_reason == reason


def test_openapi_declares_the_routes(server):
    doc = HTTP.get(server.url + "/openapi.json", timeout=10).json()
    for route, model in (
        ("/v1/messages", "MessagesRequest"),
        ("/v1/messages/count_tokens", "CountTokensRequest"),
    ):
        op = doc["paths"][route]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}"
        assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/AnthropicError"
        )
    assert {"messages", "max_tokens"} <= set(doc["components"]["schemas"]["MessagesRequest"][
        "required"])  # fmt: skip
