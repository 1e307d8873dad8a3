"""Tool calls in DeepSeek-V3's format (`--tool_call_parser=deepseek_v3`).

- The parser (xllm_py/formats/tool_parser.py) on text fixtures written from
  DeepSeek-V3's documented format: one call, parallel calls, text before the calls, the
  output cut into stream chunks at every place (arguments split included), a malformed
  call, parallel_tool_calls=false, an output cut short inside a call.
- Chat templates render as HF transformers' `apply_chat_template` renders them, on
  DeepSeek-V3's and DeepSeek-R1's real template text (tests/fixtures: the `chat_template`
  of their tokenizer_config.json) and on the bundled model's, tools included.
- The bundled tokenizer has DeepSeek-V3's tool tokens, one id each.
- The tool-call grammar (tool_choice "required" or named) admits exactly well-formed calls
  to declared functions, and greedy output under it is identical for k = 0, 1 and 3.
- Over HTTP with the real `openai` client: a required call and a named one, streamed and
  not, with valid JSON arguments; a follow-up turn with the tool's result; 400s naming
  the field.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import jinja2
import jsonschema
import openai
import pytest

from tests import grammar_utils
from tests.server_utils import HTTP, Server
from tests.test_bundled_model import held_out_user_turns
from xllm_py import LLM, SamplingParams
from xllm_py.assets import BUNDLED_MODEL_DIR
from xllm_py.engine.tokenizer import Tokenizer
from xllm_py.entrypoints.openai_protocol import APIError, ChatCompletionRequest
from xllm_py.formats import tool_parser
from xllm_py.formats.tool_parser import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
    ToolCallStream,
    parse,
)
from xllm_py.sampling_params import StructuredOutput

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def call(name: str, args: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{args}\n```{CALL_END}"


ONE = CALLS_BEGIN + call("get_weather", '{"location": "Tokyo"}') + CALLS_END
TWO = (
    CALLS_BEGIN
    + call("get_weather", '{"location": "Tokyo"}')
    + "\n"
    + call("get_time", '{"timezone": "Asia/Tokyo", "format": "24h"}')
    + CALLS_END
)
NESTED = CALLS_BEGIN + call("search", '{"q": "a\\nb ``` c", "filters": {"year": [2024]}}')
NESTED += CALLS_END
# (output text, content, [(name, arguments)])
FIXTURES_PARSE = [
    ("The weather is sunny.", "The weather is sunny.", []),
    (ONE, None, [("get_weather", '{"location": "Tokyo"}')]),
    (
        TWO,
        None,
        [
            ("get_weather", '{"location": "Tokyo"}'),
            ("get_time", '{"timezone": "Asia/Tokyo", "format": "24h"}'),
        ],
    ),
    (
        "Let me look that up." + ONE,
        "Let me look that up.",
        [("get_weather", '{"location": "Tokyo"}')],
    ),
    (NESTED, None, [("search", '{"q": "a\\nb ``` c", "filters": {"year": [2024]}}')]),
    (  # pretty-printed arguments keep their newlines
        CALLS_BEGIN + call("f", '{\n  "a": 1\n}') + CALLS_END,
        None,
        [("f", '{\n  "a": 1\n}')],
    ),
    (  # a call whose header does not parse is skipped, the next one kept
        CALLS_BEGIN + f"{CALL_BEGIN}garbage{CALL_END}\n" + call("f", "{}") + CALLS_END,
        None,
        [("f", "{}")],
    ),
    (  # after the calls end nothing more is read
        ONE + "trailing",
        None,
        [("get_weather", '{"location": "Tokyo"}')],
    ),
    (  # cut short (max_tokens) inside the arguments: what arrived is kept
        CALLS_BEGIN + f'{CALL_BEGIN}function{SEP}f\n```json\n{{"a": ',
        None,
        [("f", '{"a": ')],
    ),
    ("<｜tool▁calls", "<｜tool▁calls", []),  # a marker that never completed is text
]


def pieces(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str]], list[dict]]:
    """(content, [(name, arguments)], the tool-call deltas) of streamed delta fields."""
    content = "".join(d.get("content", "") for d in deltas) or None
    calls: dict[int, list] = {}
    tool_deltas = [t for d in deltas for t in d.get("tool_calls", [])]
    for t in tool_deltas:
        if "id" in t:  # id, type and name come first, once
            assert t["index"] not in calls and t["type"] == "function"
            assert t["id"].startswith("call_") and t["function"]["arguments"] == ""
            calls[t["index"]] = [t["function"]["name"], ""]
        else:
            assert set(t) == {"index", "function"} and set(t["function"]) == {"arguments"}
            calls[t["index"]][1] += t["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)], tool_deltas


def stream(text: str, cuts: list[int]) -> list[dict]:
    s = ToolCallStream()
    bounds = [0, *cuts, len(text)]
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    return [s.feed(c, final=i == len(chunks) - 1) for i, c in enumerate(chunks)]


@pytest.mark.parametrize("text,content,calls", FIXTURES_PARSE)
def test_whole_outputs_parse(text, content, calls):
    got_content, got = parse(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls
    assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("text,content,calls", FIXTURES_PARSE)
def test_streamed_outputs_parse_the_same_however_they_are_cut(text, content, calls):
    for cut in range(1, len(text)):
        got_content, got, _ = pieces(stream(text, [cut]))
        assert (got_content, got) == (content, calls), cut
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 12))))
        assert pieces(stream(text, cuts))[:2] == (content, calls), cuts
    # one character at a time: arguments arrive in fragments, after the name
    got_content, got, deltas = pieces(stream(text, list(range(1, len(text)))))
    assert (got_content, got) == (content, calls)
    fragments = [d for d in deltas if "id" not in d]
    if calls and len(calls[0][1]) > 3:
        assert len(fragments) > len(calls)


def test_nothing_that_cannot_be_a_marker_is_held_back():
    s = ToolCallStream()
    assert s.feed("Hello <") == {"content": "Hello "}  # "<" might start the calls
    assert s.feed("b>") == {"content": "<b>"}
    assert s.feed(CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "f\n```json\n{") == {
        "tool_calls": [
            {"index": 0, "id": s.calls[0].id, "type": "function", "function": {"name": "f"}}
            | {"function": {"name": "f", "arguments": ""}},
            {"index": 0, "function": {"arguments": "{"}},
        ]
    }
    # "}\n``" might be the end of the arguments: only "}" is certain
    assert s.feed("}\n``") == {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}
    assert s.feed("`" + CALL_END + CALLS_END) == {}


def test_parallel_tool_calls_false_keeps_the_first_call():
    content, calls = parse(TWO, parallel=False)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"location": "Tokyo"}')]


# ---- chat templates ---------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"type": "string", "maxLength": 12}},
                "required": ["timezone"],
            },
        },
    },
]
CALL_A = {
    "id": "call_a",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
}
CALL_B = {
    "id": "call_b",
    "type": "function",
    "function": {"name": "get_time", "arguments": '{"timezone": "CET"}'},
}
USER = {"role": "user", "content": "What is the weather in Paris, and the time?"}
CONVERSATIONS = [
    [USER],
    [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Be kind."}, USER],
    [USER, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks"}],
    [USER, {"role": "assistant", "content": None, "tool_calls": [CALL_A]}],
    [
        {"role": "system", "content": "You can call tools."},
        USER,
        {"role": "assistant", "content": None, "tool_calls": [CALL_A, CALL_B]},
        {"role": "tool", "tool_call_id": "call_a", "content": "21 C, sunny"},
        {"role": "tool", "tool_call_id": "call_b", "content": "14:05"},
        {"role": "assistant", "content": "It is 21 C and 14:05."},
        {"role": "user", "content": "And tomorrow?"},
    ],
    [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [CALL_A]},
        {"role": "tool", "tool_call_id": "call_a", "content": "21 C"},
    ],
]


def hf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def with_template(tmp_path: Path, template: str) -> Path:
    """The bundled tokenizer with DeepSeek-V3's special-token names and `template`."""
    shutil.copy(BUNDLED_MODEL_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<｜begin▁of▁sentence｜>",
        "eos_token": "<｜end▁of▁sentence｜>",
        "chat_template": template,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return tmp_path


def rendered_or_error(render, *args, **kw) -> str:
    try:
        return render(*args, **kw)
    except jinja2.TemplateError as e:  # the template's own error, the same for both
        return f"{type(e).__name__}: {e}"


def with_empty_content(conv: list[dict]) -> list[dict]:
    """`conv` with "" instead of None as a tool-calling turn's content."""
    return [{**m, "content": ""} if m.get("content", 0) is None else m for m in conv]


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_r1"])
def test_deepseek_templates_render_as_transformers_renders_them(tmp_path, name):
    path = with_template(tmp_path, (FIXTURES / f"{name}_chat_template.jinja").read_text())
    ours, hf = Tokenizer.from_dir(path), hf_tokenizer(path)
    results = []
    for conv in [*CONVERSATIONS, *map(with_empty_content, CONVERSATIONS[3:])]:
        for gen in (True, False):
            want = rendered_or_error(
                hf.apply_chat_template, conv, tokenize=False, add_generation_prompt=gen
            )
            got = rendered_or_error(ours.apply_chat_template, conv, gen)
            assert got == want, (conv, gen)
            results.append(want)
    # HF drops None-valued keys, and these templates then fail on a turn without content
    # (both say so); with "" as its content, R1's renders the calls in its own format
    assert sum(r.startswith("UndefinedError") for r in results) == 6
    assert len(set(results)) >= 12
    calls = ours.apply_chat_template(with_empty_content(CONVERSATIONS[4]))
    assert "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>21 C, sunny" in calls
    if name == "deepseek_r1":
        assert CALLS_BEGIN + call("get_weather", CALL_A["function"]["arguments"]) in calls
        assert "\n" + call("get_time", '{"timezone": "CET"}') + CALLS_END in calls


def test_the_bundled_template_renders_tools_as_transformers_does():
    path = BUNDLED_MODEL_DIR
    ours, hf = Tokenizer.from_dir(path), hf_tokenizer(path)
    for conv in CONVERSATIONS:
        for tools in (None, TOOLS):
            want = hf.apply_chat_template(
                conv, tools=tools, tokenize=False, add_generation_prompt=True
            )
            assert ours.apply_chat_template(conv, tools=tools) == want
    text = ours.apply_chat_template(CONVERSATIONS[4], tools=TOOLS)
    assert '"required": ["city", "unit"]' in text and "### get_time" in text
    assert call("get_time", '{"timezone": "CET"}') in text
    # without tools, the format the model was trained on, unchanged
    assert ours.apply_chat_template(CONVERSATIONS[2][:2], add_generation_prompt=False) == (
        "<|bos|><|user|>\nWhat is the weather in Paris, and the time?\n<|assistant|>\nSunny."
        "<|eos|>\n"
    )


def test_the_bundled_tokenizer_has_deepseek_v3s_tool_tokens():
    tok = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    vocab = json.loads((BUNDLED_MODEL_DIR / "config.json").read_text())["vocab_size"]
    markers = [CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP]
    markers += ["<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"]
    markers += ["<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]
    ids = [tok.encode(m, add_special_tokens=False) for m in markers]
    assert all(len(i) == 1 and 8192 <= i[0] < vocab for i in ids)
    assert tok.decode([i[0] for i in ids]) == "".join(markers)  # kept when decoding


# ---- the grammar of tool_choice "required" and named ------------------------------------------


def follows(spec: str, text: str) -> bool:
    return grammar_utils.follows(StructuredOutput("structural_tag", spec), text)


def test_the_tool_grammar_admits_exactly_well_formed_calls():
    pytest.importorskip("xgrammar")
    required = tool_parser.tool_call_grammar(TOOLS, None, True)
    a = call("get_weather", '{"city": "Paris", "unit": "celsius"}')
    b = call("get_time", '{"timezone": "CET"}')
    assert follows(required, CALLS_BEGIN + a + CALLS_END)
    assert follows(required, CALLS_BEGIN + a + "\n" + b + CALLS_END)
    assert not follows(required, "Sure." + CALLS_BEGIN + a + CALLS_END)  # calls only
    assert not follows(required, CALLS_BEGIN + CALLS_END)  # at least one
    assert not follows(required, CALLS_BEGIN + call("rm_rf", "{}") + CALLS_END)
    assert not follows(required, CALLS_BEGIN + call("get_time", '{"tz": "CET"}') + CALLS_END)
    assert not follows(required, CALLS_BEGIN + call("get_weather", '{"city": "P"}') + CALLS_END)
    single = tool_parser.tool_call_grammar(TOOLS, None, False)
    assert follows(single, CALLS_BEGIN + a + CALLS_END)
    assert not follows(single, CALLS_BEGIN + a + "\n" + b + CALLS_END)
    named = tool_parser.tool_call_grammar(TOOLS, "get_time", True)
    assert follows(named, CALLS_BEGIN + b + CALLS_END)
    assert not follows(named, CALLS_BEGIN + a + CALLS_END)
    # the markers must be the tokens themselves, not their spelling in pieces
    m = grammar_utils.bundled_matcher(StructuredOutput("structural_tag", required))
    assert not m.accept(grammar_utils.encode("<")[0])


TOOL_OPTIONS = dict(dtype="float32", block_size=16)


def tool_outputs(k: int, prompts: list[str], spec: str):
    llm = LLM(num_speculative_tokens=k, **TOOL_OPTIONS)
    so = StructuredOutput("structural_tag", spec)
    sp = SamplingParams(max_tokens=96, temperature=0.0, structured=so)
    return [o.outputs[0] for o in llm.generate(prompts, sp)], llm


def test_required_tool_calls_are_well_formed_and_lossless_under_mtp():
    pytest.importorskip("xgrammar")
    tok = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": t}], tools=TOOLS)
        for t in held_out_user_turns(16)
    ]
    spec = tool_parser.tool_call_grammar(TOOLS, None, False)
    plain, _ = tool_outputs(0, prompts, spec)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for out in plain:
        assert out.finish_reason == "stop", out.text
        content, calls = parse(out.text)
        assert content is None and len(calls) == 1
        jsonschema.validate(json.loads(calls[0].arguments), schemas[calls[0].name])
    for k in (1, 3):
        spec_out, llm = tool_outputs(k, prompts, spec)
        assert [o.token_ids for o in spec_out] == [o.token_ids for o in plain], k
        m = llm.get_metrics()
        assert 0 < m.accepted_tokens < m.draft_tokens


# ---- over HTTP ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    with Server(
        "--dtype=float32",
        "--num_speculative_tokens=1",
        "--tool_call_parser=deepseek_v3",
        "--enable_auto_tool_choice",
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def model(client) -> str:
    return client.models.list().data[0].id


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def required(client) -> dict:
    """One required call (parallel_tool_calls false), greedy."""
    return dict(
        model=model(client),
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=0,
    )


def test_a_required_call_comes_back_parsed_streamed_and_not(client):
    kw = required(client)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (tc,) = choice.message.tool_calls
    assert tc.type == "function" and tc.id.startswith("call_")
    jsonschema.validate(json.loads(tc.function.arguments), SCHEMAS[tc.function.name])

    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    parts = [t for d in deltas for t in d.tool_calls or []]
    assert parts[0].id and parts[0].function.name == tc.function.name  # id and name first
    assert all(p.id is None and p.function.name is None for p in parts[1:])
    assert len(parts) > 2  # the arguments came in fragments
    assert "".join(p.function.arguments or "" for p in parts) == tc.function.arguments
    assert not any(d.content for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_named_function_is_called(client):
    r = client.chat.completions.create(
        model=model(client),
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=96,
        temperature=0,
    )
    (tc,) = r.choices[0].message.tool_calls
    assert tc.function.name == "get_time"
    jsonschema.validate(json.loads(tc.function.arguments), SCHEMAS["get_time"])


def test_a_follow_up_turn_with_the_tool_result_renders_and_completes(server, client):
    first = client.chat.completions.create(**required(client))
    assistant = first.choices[0].message.model_dump(exclude_none=True)
    result = {
        "role": "tool",
        "tool_call_id": first.choices[0].message.tool_calls[0].id,
        "content": '{"temperature": 21}',
    }
    messages = [*ASK, assistant, result]
    tokens = HTTP.post(
        server.url + "/tokenize", json={"messages": messages, "tools": TOOLS}, timeout=60
    ).json()["tokens"]
    hf = hf_tokenizer(BUNDLED_MODEL_DIR)
    want = hf.apply_chat_template(
        [*ASK, {**assistant, "content": None}, result],
        tools=TOOLS,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert tokens == Tokenizer.from_dir(BUNDLED_MODEL_DIR).encode(want)
    assert "<｜tool▁output▁begin｜>" in want and "<｜tool▁calls▁begin｜>" in want
    r = client.chat.completions.create(
        model=model(client), messages=messages, tools=TOOLS, max_tokens=24, temperature=0
    )  # tool_choice "auto": this model answers in text
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.content and r.usage.prompt_tokens == len(tokens)


@pytest.mark.parametrize(
    "field,body",
    [
        ("tool_choice", {"tool_choice": {"type": "function", "function": {"name": "nope"}}}),
        ("tool_choice", {"tools": None, "tool_choice": "required"}),
        (
            "response_format",
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
        ),
        ("tools", {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}),
        ("tools", {"tools": [{"type": "retrieval"}]}),
        ("tool_choice", {"tool_choice": "sometimes"}),
        ("messages", {"messages": [{"role": "tool", "content": 3}]}),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(server, field, body):
    base = {"messages": ASK, "tools": TOOLS, "max_tokens": 4}
    r = HTTP.post(server.url + "/v1/chat/completions", json={**base, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text


def test_tools_need_a_parser_and_auto_needs_the_flag():
    req = ChatCompletionRequest.model_validate({"messages": ASK, "tools": TOOLS})
    with pytest.raises(APIError) as e:
        req.tool_mode("", False)
    assert e.value.param == "tools" and "--tool_call_parser" in str(e.value)
    with pytest.raises(APIError) as e:
        req.tool_mode("deepseek_v3", False)  # tools given: tool_choice defaults to auto
    assert e.value.param == "tool_choice" and "--enable_auto_tool_choice" in str(e.value)
    assert req.tool_mode("deepseek_v3", True) == ("auto", None)
    none = ChatCompletionRequest.model_validate(
        {"messages": ASK, "tools": TOOLS, "tool_choice": "none"}
    )
    assert none.tool_mode("", False) == ("none", None)  # tools rendered, nothing parsed
