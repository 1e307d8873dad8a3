"""OpenAI's Responses API (`/v1/responses`) against a live daemon (MTP on, k = 1,
`--tool_call_parser=deepseek_v3 --enable_auto_tool_choice`), with the real `openai` client
and the OpenAI Agents SDK:

- text, instructions, text.format json_schema (parses and validates), a required function
  call (its arguments validate), follow-ups with a function_call_output item and with
  previous_response_id: each prompt counted against /tokenize of the same chat messages,
  and greedy output token-identical to /v1/chat/completions on the same conversation;
- `responses.stream`: every event parsed by the SDK, sequence numbers in order, and
  get_final_response() equal to the whole answer; an output cut short ends with
  response.incomplete; every event and body validates against the SDK's own types; a
  client that leaves a stream has its engine request aborted;
- GET and DELETE; an unknown previous_response_id is a 404 naming it; a hosted tool type
  named by tool_choice is a 400 naming tool_choice (hosted tools otherwise skipped, one
  warning per type); usage.speculative is what /metrics counted;
- the store: 1,000 responses over a bound of 100 leave the newest 100 (the class, on a
  clock of its own), and over HTTP (--responses_store_max=20) the oldest go
  first and an entry is gone once --responses_store_ttl has passed;
- an Agents SDK agent with one function tool runs two turns (a forced call, then text
  under a JSON schema: the tiny model never ends free text early), streamed and not.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.server_utils import HTTP, Server, assert_spec_counted, spec_totals
from xllm_py.entrypoints.responses import Reply, ResponsesRequest, ResponseStore

MODEL = "tiny-deepseek-v3-mtp"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": WEATHER,
        "strict": True,
    }
]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
              for t in TOOLS]  # fmt: skip
YES_NO = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
ANSWER = {"format": {"type": "json_schema", "name": "answer", "schema": YES_NO, "strict": True}}
EVENTS = TypeAdapter(ResponseStreamEvent)
STORE_MAX, STORE_TTL = 20, 8


@pytest.fixture(scope="module")
def server():
    with Server(
        "--dtype=float32",
        "--num_speculative_tokens=1",
        "--max_model_len=1024",
        "--tool_call_parser=deepseek_v3",
        "--enable_auto_tool_choice",
        f"--responses_store_max={STORE_MAX}",
        f"--responses_store_ttl={STORE_TTL}",  # follow-ups come within milliseconds
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def tokens(server, messages: list[dict], **kw) -> int:
    r = HTTP.post(server.url + "/tokenize", json={"messages": messages, **kw}, timeout=60)
    return r.json()["count"]


def chat(client, messages: list[dict], **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def raw(server, **body) -> dict:
    """The body as sent (the SDK builds its objects without validating them)."""
    r = HTTP.post(server.url + "/v1/responses", json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 200, r.text
    Response.model_validate_json(r.text)  # OpenAI's own type of it, strictly
    return r.json()


def summary(output) -> list[tuple]:
    """Output items without their ids (each request makes new ones)."""
    out = []
    for o in output:
        if o.type == "message":
            out.append(("message", o.status, [c.text for c in o.content]))
        else:
            out.append((o.type, o.status, o.name, o.arguments))
    return out


def test_text_and_instructions_are_the_chat_conversation(server, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    before = spec_totals(server.url)
    r = client.responses.create(
        model=MODEL, input="Hi", instructions="Be brief.", max_output_tokens=12, temperature=0
    )
    assert_spec_counted(r.usage.model_extra["speculative"], before, spec_totals(server.url))
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert r.usage.input_tokens == tokens(server, messages)
    assert r.usage.output_tokens == 12
    assert r.usage.total_tokens == r.usage.input_tokens + 12
    assert r.output_text == chat(client, messages, max_tokens=12).choices[0].message.content
    body = raw(server, input="Hi", instructions="Be brief.", max_output_tokens=12, temperature=0)
    assert body["output"][0]["content"][0]["text"] == r.output_text


def test_greedy_output_is_token_identical_to_chat_completions(server, client):
    prompts = ["Hello", "What is the capital of France?", "Write a haiku.", "2 + 2 ="]
    for prompt in prompts:
        r = client.responses.create(
            model=MODEL, input=[{"role": "user", "content": [{"type": "input_text",
            "text": prompt}]}], max_output_tokens=16, temperature=0, top_logprobs=2,
            include=["message.output_text.logprobs"],
        )  # fmt: skip
        c = chat(client, [{"role": "user", "content": prompt}], max_tokens=16, logprobs=True)
        theirs = c.choices[0].logprobs.content
        ours = r.output[0].content[0].logprobs
        assert [t.token for t in ours] == [t.token for t in theirs], prompt
        assert [t.logprob for t in ours] == pytest.approx([t.logprob for t in theirs], abs=1e-5)
        assert all(len(t.top_logprobs) == 2 for t in ours)
        assert r.output_text == c.choices[0].message.content
        assert r.usage.output_tokens == c.usage.completion_tokens == 16


def test_json_schema_output_parses_and_validates(server, client):
    r = client.responses.create(model=MODEL, input="Is the sky blue?", text=ANSWER, temperature=0)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), YES_NO)
    body = raw(server, input="Is the sky blue?", text=ANSWER, temperature=0)
    assert body["text"]["format"]["schema"] == YES_NO and body["status"] == "completed"


def required_call(client, **kw):
    return client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=TOOLS,
        tool_choice="required", parallel_tool_calls=False, temperature=0, **kw,
    )  # fmt: skip


def test_a_required_function_call_and_its_result_in_a_follow_up(server, client):
    r = required_call(client)
    assert r.status == "completed"
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    user = {"role": "user", "content": "What is the weather in Paris?"}
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    follow = client.responses.create(
        model=MODEL, input=[user, call.model_dump(exclude_none=True), result], tools=TOOLS,
        tool_choice="none", max_output_tokens=8, temperature=0,
    )  # fmt: skip
    assistant = {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id,
                 "type": "function", "function": {"name": call.name,
                 "arguments": call.arguments}}]}  # fmt: skip
    tool = {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}
    messages = [user, assistant, tool]
    assert follow.usage.input_tokens == tokens(server, messages, tools=CHAT_TOOLS)
    same = chat(client, messages, max_tokens=8, tools=CHAT_TOOLS, tool_choice="none")
    assert follow.output_text == same.choices[0].message.content


def test_previous_response_id_continues_the_stored_conversation(server, client):
    first = client.responses.create(
        model=MODEL, input="Tell me about the moon.", instructions="Be brief.",
        max_output_tokens=6, temperature=0,
    )  # fmt: skip
    second = client.responses.create(
        model=MODEL, input="And the sun?", previous_response_id=first.id, max_output_tokens=6,
        temperature=0,
    )  # fmt: skip
    assert second.previous_response_id == first.id
    # the instructions are not carried over (OpenAI's rule); the turns are
    messages = [
        {"role": "user", "content": "Tell me about the moon."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And the sun?"},
    ]
    assert second.usage.input_tokens == tokens(server, messages)
    assert second.output_text == chat(client, messages, max_tokens=6).choices[0].message.content
    third = client.responses.create(
        model=MODEL, input="Thanks.", previous_response_id=second.id, max_output_tokens=2
    )
    messages += [{"role": "assistant", "content": second.output_text},
                 {"role": "user", "content": "Thanks."}]  # fmt: skip
    assert third.usage.input_tokens == tokens(server, messages)


def streamed(client, **kw):
    with client.responses.stream(model=MODEL, temperature=0, **kw) as stream:
        events = list(stream)
        return events, stream.get_final_response()


@pytest.mark.parametrize("kind", ["text", "function_call"])
def test_a_stream_builds_the_whole_answer(client, kind):
    if kind == "text":
        ask = {"input": "Is the sky blue?", "text": ANSWER}
    else:
        ask = {"input": "What is the weather in Paris?", "tools": TOOLS,
               "tool_choice": "required", "parallel_tool_calls": False}  # fmt: skip
    whole = client.responses.create(model=MODEL, temperature=0, **ask)
    events, final = streamed(client, **ask)
    assert whole.status == final.status == "completed"
    assert summary(final.output) == summary(whole.output)
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-2:] == ["response.output_item.done", "response.completed"]
    lifecycle = {"response.created", "response.in_progress", "response.completed"}
    assert {e.response.id for e in events if e.type in lifecycle} == {final.id}
    deltas = [e.delta for e in events if e.type.endswith(".delta")]
    assert len(deltas) > 1  # it came in pieces
    if kind == "text":
        assert "".join(deltas) == final.output_text == whole.output_text
        assert "response.content_part.added" in types and "response.output_text.done" in types
    else:
        assert "".join(deltas) == final.output[0].arguments
        assert "response.function_call_arguments.done" in types


def test_a_stream_cut_short_ends_incomplete(server, client):
    whole = client.responses.create(model=MODEL, input="Hi", max_output_tokens=10, temperature=0)
    events = list(
        client.responses.create(
            model=MODEL, input="Hi", max_output_tokens=10, temperature=0, stream=True
        )
    )
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output_text == whole.output_text
    assert events[-2].item.status == "incomplete"


def test_a_client_that_leaves_a_stream_aborts_its_request(server):
    def aborted() -> float:
        return server.metric("xllm:request_success_total", finished_reason="abort")

    before = aborted()
    body = {"model": MODEL, "input": "Hi", "stream": True, "max_output_tokens": 900}
    with HTTP.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        for n, line in enumerate(r.iter_lines()):
            if n == 12:  # a few text deltas in: the client leaves
                assert line.startswith("event: response.output_text.delta")
                break
    deadline = time.monotonic() + 60
    while aborted() == before:  # the engine request is aborted (its blocks freed)
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert aborted() == before + 1


def test_every_event_has_the_sdk_types_shape():
    """Events of reasoning, text and a call (the chat deltas chat.py's readers make,
    reasoning included, which the test daemon has no parser for) validate against the
    SDK's event types, and the final object against its Response."""
    req = ResponsesRequest.model_validate({"input": "x", "include": [
        "message.output_text.logprobs"]})  # fmt: skip
    reply = Reply(req, {"id": "resp_1", "created": 1, "model": MODEL}, stream=True)
    lp = {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}
    bodies = [
        {"delta": {"reasoning_content": "Let me"}, "logprobs": None, "finish_reason": None},
        {"delta": {"reasoning_content": " think."}, "logprobs": None, "finish_reason": None},
        {"delta": {"content": "a"}, "logprobs": {"content": [lp]}, "finish_reason": None},
        {"delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": ""}}]}, "logprobs": None,
            "finish_reason": None},
        {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]},
            "logprobs": None, "finish_reason": "tool_calls"},
    ]  # fmt: skip
    text = reply.sse({"type": "response.created", "response": reply.resource("in_progress", [],
                     None)}) + "".join(reply.take(b) for b in bodies)  # fmt: skip
    final = reply.finished({"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8})
    text += reply.sse({"type": "response.completed", "response": final})
    events = [
        EVENTS.validate_python(json.loads(line[6:]))
        for line in text.splitlines()
        if line.startswith("data: ")
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Let me think."
    assert final["output"][1]["content"][0]["logprobs"] == [lp]
    assert {e.type for e in events} >= {
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_text.delta", "response.function_call_arguments.done",
    }  # fmt: skip
    Response.model_validate(final)


def test_get_and_delete_a_stored_response(server, client):
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, temperature=0)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    gone = httpx.delete(f"{server.url}/v1/responses/{r.id}", timeout=30)
    assert gone.json() == {"id": r.id, "object": "response", "deleted": True}
    for method in ("GET", "DELETE"):
        again = HTTP.request(method, f"{server.url}/v1/responses/{r.id}", timeout=30)
        assert again.status_code == 404 and r.id in again.json()["error"]["message"]
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_bad_requests_name_their_field(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id" and "resp_nope" in e.value.message
    hosted = [*TOOLS, {"type": "web_search"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model=MODEL, input="Hi", tools=hosted, tool_choice={"type": "web_search"}
        )
    assert e.value.body["param"] == "tool_choice" and "web_search" in e.value.message
    bad = {
        "input": {"input": [{"role": "user", "content": [{"type": "input_image",
                  "image_url": "https://x/y.png"}]}]},
        "max_output_tokens": {"input": "Hi", "max_output_tokens": 5000},
        "background": {"input": "Hi", "background": True},
        "text": {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
    }  # fmt: skip
    for param, body in bad.items():
        r = HTTP.post(server.url + "/v1/responses", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "input_image" in HTTP.post(server.url + "/v1/responses", json=bad["input"]).text
    for _ in range(2):  # a hosted tool beside a function tool is skipped, logged once
        r = client.responses.create(model=MODEL, input="Hi", tools=hosted, max_output_tokens=2)
        assert r.tools[1].type == "web_search"
    logged = [ln for ln in server.output().splitlines() if "'web_search'" in ln]
    assert len(logged) == 1 and "WARNING" in logged[0]


def test_the_store_keeps_the_newest_within_its_bound_and_ttl():
    now = [0.0]
    store = ResponseStore(100, ttl=60.0, clock=lambda: now[0])
    for i in range(1000):
        store.put(f"resp_{i}", {"id": f"resp_{i}"}, ())
        now[0] += 0.01
        assert len(store) == min(i + 1, 100)
    assert all(store.get(f"resp_{i}") is None for i in range(900))
    assert all(store.get(f"resp_{i}").response["id"] == f"resp_{i}" for i in range(900, 1000))
    now[0] = 9.9 + 60.0  # puts were at 0.00 .. 9.99: those up to 9.90 have expired
    assert [i for i in range(900, 1000) if store.get(f"resp_{i}")] == list(range(991, 1000))
    assert store.delete("resp_999") and not store.delete("resp_999") and len(store) == 8
    assert len(ResponseStore(0, 60.0)) == 0


def test_over_http_the_oldest_go_first_and_an_entry_expires(server):
    url = server.url + "/v1/responses"

    def create() -> str:
        r = HTTP.post(url, json={"input": "Hi", "max_output_tokens": 1}, timeout=60)
        return r.json()["id"]

    made = []
    for _ in range(STORE_MAX + 5):
        made.append((create(), time.monotonic()))
    kept = 0  # (a loaded machine may take a while: a response past its TTL is 404 anyway)
    for i, (rid, at) in enumerate(made):
        status = HTTP.get(f"{url}/{rid}", timeout=30).status_code
        if i < 5:  # the oldest went first
            assert status == 404, i
        elif time.monotonic() - at < STORE_TTL - 1:  # surely still within its TTL
            assert status == 200, i
            kept += 1
    assert kept >= STORE_MAX // 2, kept
    sent = time.monotonic()
    rid = create()
    assert HTTP.get(f"{url}/{rid}", timeout=30).status_code == 200
    while HTTP.get(f"{url}/{rid}", timeout=30).status_code == 200:  # until it expires
        assert time.monotonic() - sent < 60
        time.sleep(0.2)
    assert time.monotonic() - sent >= STORE_TTL  # not before --responses_store_ttl
    follow = HTTP.post(url, json={"input": "x", "previous_response_id": rid}, timeout=60)
    assert follow.status_code == 404 and follow.json()["error"]["param"] == "previous_response_id"


def test_an_agents_sdk_agent_calls_its_tool_and_answers(server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    settings = agents.ModelSettings(
        tool_choice="required",  # the first turn; the SDK resets it to auto after the call
        parallel_tool_calls=False,
        temperature=0,
        extra_body={"text": ANSWER},  # free text from the tiny model never ends early
    )

    def agent():  # a client per event loop
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        model = agents.OpenAIResponsesModel(MODEL, client)
        return agents.Agent(name="weather", instructions="Use the tool.", tools=[get_weather],
                            model=model, model_settings=settings)  # fmt: skip

    async def streamed():
        run = agents.Runner.run_streamed(agent(), "Is it sunny in Paris?", max_turns=4)
        async for _ in run.stream_events():
            pass
        return run

    for result in (agents.Runner.run_sync(agent(), "Is it sunny in Paris?", max_turns=4),
                   asyncio.run(streamed())):  # fmt: skip
        assert [[o.type for o in r.output] for r in result.raw_responses] == [
            ["function_call"],
            ["message"],
        ]
        assert isinstance(result.final_output, str)
        jsonschema.validate(json.loads(result.final_output), YES_NO)
    assert len(calls) == 2 and calls[0] == calls[1] and isinstance(calls[0], str)
