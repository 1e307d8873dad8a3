"""Tool calls in DeepSeek-V3.2's DSML (`--tool_call_parser=deepseek_v32`).

- The reader (xllm_py/formats/dsml.py, `DsmlStream`) on text fixtures written
  from the format as DeepSeek's encoder writes it (`\\n\\n`, the calls' tag, one invoke a
  line, one parameter a line): typed (`string="false"`, JSON) and raw (`string="true"`)
  parameters, nested JSON, several invokes, text before the block, malformed invokes and
  parameters skipped, text after the block dropped, an output cut short inside a call, a
  tag that never completed; each parsed whole, streamed cut in two at every place, one
  character at a time and at random cuts, all giving the same content and calls, and the
  arguments always the JSON of the parameters.
- Arguments stream as JSON text as it arrives: a raw value's text before its end tag.
- The grammar of `tool_choice` required / named admits exactly well-formed calls to
  declared functions whose parameters follow the schema (string properties raw, the rest
  JSON), and what it admits reads back to schema-valid arguments.
- Over HTTP with the real `openai` client, on a copy of the bundled model with the DSML
  tags added as tokens, served with `--chat_template=deepseek_v32
  --tool_call_parser=deepseek_v32`: `tool_choice="required"` gives a schema-valid call,
  whole and streamed; the prompt is V3.2's encoding (/tokenize); the tool's result
  renders into the next turn.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import jsonschema
import openai
import pytest
import torch
from safetensors.torch import save_file

from tests import grammar_utils
from tests.server_utils import HTTP, ROOT, Server, eager_unless_asked
from tests.test_tool_calls import TOOLS
from tests.test_tool_parsers_v31_kimi import named, pieces, required_call, stream
from xllm_py.assets import BUNDLED_MODEL_DIR
from xllm_py.formats import encoding_dsv32, tool_parser
from xllm_py.formats.dsml import (
    DSML_CALLS_BEGIN,
    DSML_CALLS_END,
    DSML_INVOKE_END,
    DSML_PARAM_END,
)
from xllm_py.formats.tool_parser import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
    parse,
    stream_for,
)
from xllm_py.sampling_params import StructuredOutput
from xllm_py.weights.loader import INDEX_FILE

D = "｜DSML｜"  # the format's marker, spelled here independently of the code


def p(key: str, value: str, string: bool = True) -> str:
    """One parameter line as the encoder writes it."""
    return f'<{D}parameter name="{key}" string="{str(string).lower()}">{value}</{D}parameter>'


def invoke(name: str, *params: str) -> str:
    return "\n".join([f'<{D}invoke name="{name}">', *params, f"</{D}invoke>"])


def block(*invokes: str) -> str:
    return "\n\n" + "\n".join([f"<{D}function_calls>", *invokes, f"</{D}function_calls>"])


WEATHER = invoke("get_weather", p("city", "Paris"), p("unit", "celsius"))
WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'
TIME = invoke("get_time", p("timezone", "CET"))
TIME_ARGS = '{"timezone": "CET"}'
RAW = 'a "quoted" <b> & \\ back\nslash, tab\t </｜DSML｜invoke> inside'  # raw text, as is
NESTED = '{"year": [2024, 2025], "tags": {"a": null, "b": true}}'

# (output text, content, [(name, arguments)])
FIXTURES = [
    ("The weather is sunny.", "The weather is sunny.", []),
    (block(WEATHER), None, [("get_weather", WEATHER_ARGS)]),
    (  # typed parameters: JSON as written; raw ones: a JSON string of the text
        block(invoke("search", p("q", RAW), p("limit", "10", False), p("filters", NESTED, False),
                     p("exact", "false", False), p("score", "-1.5e3", False))),
        None,
        [("search", '{"q": ' + json.dumps(RAW, ensure_ascii=False) + ', "limit": 10, '
                    f'"filters": {NESTED}, "exact": false, "score": -1.5e3}}')],
    ),
    (block(WEATHER, TIME), None, [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)]),
    (  # text before the block: the "\n\n" the format puts before it is not content
        "Let me look that up." + block(WEATHER),
        "Let me look that up.",
        [("get_weather", WEATHER_ARGS)],
    ),
    ("Two lines:\n" + block(TIME), "Two lines:\n", [("get_time", TIME_ARGS)]),
    (  # the calls' tag without the "\n\n" (as text ends), and an invoke without parameters
        "Sure." + DSML_CALLS_BEGIN + invoke("ping") + DSML_CALLS_END,
        "Sure.",
        [("ping", "{}")],
    ),
    (  # a raw value of a string-typed JSON-looking text stays a string
        block(invoke("f", p("s", "[1, 2]"), p("n", ""))), None, [("f", '{"s": "[1, 2]", "n": ""}')]
    ),
    (  # invokes whose header does not parse are skipped, the others kept
        block(invoke("bad name", p("a", "1")), f'<{D}invoke>\n{p("a", "1")}\n</{D}invoke>',
              f'<{D}invoke name="x"\n{p("a", "1")}\n</{D}invoke>', WEATHER,
              invoke("", p("a", "1")), TIME),
        None,
        [("get_weather", WEATHER_ARGS), ("get_time", '{"timezone": "CET"}')],
    ),
    (  # inside an invoke: a parameter whose header does not parse and a second one of a
       # name are skipped; stray text between parameters is read past; a typed value that
       # is not JSON is taken as text (the arguments stay JSON)
        block(invoke("f", f'<{D}parameter name="a">1</{D}parameter>', p("b", "2", False),
                     p("b", "3", False), "stray text", p("c", "{oops", False),
                     f'<{D}parameter name="d" string="maybe">x</{D}parameter>',
                     p("e", "NaN", False))),
        None,
        [("f", '{"b": 2, "c": "{oops", "e": "NaN"}')],
    ),
    (  # after the block ends nothing more is read
        block(TIME) + "trailing" + block(WEATHER), None, [("get_time", TIME_ARGS)]
    ),
    (  # cut short (max_tokens) inside a raw value: what arrived is kept
        "\n\n" + DSML_CALLS_BEGIN + "\n" + f'<{D}invoke name="get_weather">\n'
        + p("unit", "celsius") + f'\n<{D}parameter name="city" string="true">Par',
        None,
        [("get_weather", '{"unit": "celsius", "city": "Par')],
    ),
    (  # cut short inside a typed value, and inside a parameter's header
        DSML_CALLS_BEGIN + f'<{D}invoke name="f">' + p("a", "[1, ", False)[:-len(DSML_PARAM_END)],
        None,
        [("f", '{"a": [1, ')],
    ),
    (DSML_CALLS_BEGIN + f'<{D}invoke name="f">' + p("a", "1", False) + f'<{D}parameter name="b',
     None, [("f", '{"a": 1')]),
    (DSML_CALLS_BEGIN + f'<{D}invoke name="get_wea', None, []),  # cut inside the header
    ("x\n\n<｜DSML｜function", "x\n\n<｜DSML｜function", []),  # a tag that never completed
    ("a\n\nb", "a\n\nb", []),  # "\n\n" that no block follows is content
    (  # DeepSeek-V3's markers are text to the DSML reader
        CALLS_BEGIN + CALL_BEGIN + "f" + SEP + "{}" + CALL_END + CALLS_END,
        CALLS_BEGIN + CALL_BEGIN + "f" + SEP + "{}" + CALL_END + CALLS_END,
        [],
    ),
]  # fmt: skip


@pytest.mark.parametrize("text,content,calls", FIXTURES)
def test_whole_outputs_parse(text, content, calls):
    got_content, got = parse(text, parser="deepseek_v32")
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls
    assert len({c.id for c in got}) == len(got) and all(c.id.startswith("call_") for c in got)
    for c in got:
        if c.arguments.endswith("}"):  # a call that ended: its arguments are one JSON object
            assert isinstance(json.loads(c.arguments), dict)


@pytest.mark.parametrize("text,content,calls", FIXTURES)
def test_streamed_outputs_parse_the_same_however_they_are_cut(text, content, calls):
    for cut in range(1, len(text)):
        got_content, got = stream("deepseek_v32", text, [cut])
        assert (got_content, named(got)) == (content, calls), cut
    got_content, got = stream("deepseek_v32", text, list(range(1, len(text))))  # by character
    assert (got_content, named(got)) == (content, calls)
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 12))))
        got_content, got = stream("deepseek_v32", text, cuts)
        assert (got_content, named(got)) == (content, calls), cuts


def test_arguments_stream_as_json_text_as_it_arrives():
    s = stream_for("deepseek_v32")
    assert s.feed("Checking.\n") == {"content": "Checking."}  # "\n" might begin the block
    got = s.feed("\n" + DSML_CALLS_BEGIN + f'\n<{D}invoke name="get_weather">\n')["tool_calls"]
    assert got == [{"index": 0, "id": s.calls[0].id, "type": "function",
                    "function": {"name": "get_weather", "arguments": ""}}]  # fmt: skip
    got = s.feed(f'<{D}parameter name="city" string="true">New "Yo')
    assert got == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "New \\"Yo'}}]}
    assert s.feed("rk</｜DSML｜para") == {
        "tool_calls": [{"index": 0, "function": {"arguments": "rk"}}]
    }
    assert s.feed("meter>\n") == {"tool_calls": [{"index": 0, "function": {"arguments": '"'}}]}
    got = s.feed(f'<{D}parameter name="days" string="false">1')
    assert got == {"tool_calls": [{"index": 0, "function": {"arguments": ', "days": '}}]}
    assert s.feed("4") == {}  # a JSON value goes out whole, once its end tag came
    assert s.feed(DSML_PARAM_END + "\n" + DSML_INVOKE_END) == {
        "tool_calls": [{"index": 0, "function": {"arguments": "14}"}}]
    }
    assert s.feed("\n" + DSML_CALLS_END, final=True) == {}
    assert json.loads(s.calls[0].arguments) == {"city": 'New "York', "days": 14}


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = block(WEATHER, TIME)
    _, calls = parse(text, parallel=False, parser="deepseek_v32")
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", WEATHER_ARGS)]
    s = tool_parser.stream_for("deepseek_v32", parallel=False)
    assert named(pieces([s.feed(ch) for ch in text] + [s.feed("", final=True)])[1]) == [
        ("get_weather", WEATHER_ARGS)
    ]


def test_calls_the_encoder_writes_read_back():
    """An assistant turn's calls as encoding_dsv32.py writes them into a prompt read back to
    the same arguments (a tool-calling turn's DSML, round trip)."""
    args = [{"city": "Zürich", "unit": "celsius"},
            {"q": "a\nb", "n": 3, "f": [1.5, {"x": None}], "ok": False, "empty": {}}]  # fmt: skip
    names = ["get_weather", "search"]
    calls = [{"id": f"c{i}", "type": "function",
              "function": {"name": n, "arguments": json.dumps(a)}}
             for i, (n, a) in enumerate(zip(names, args))]  # fmt: skip
    prompt = encoding_dsv32.encode_messages(
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "On it.", "tool_calls": calls},
        ]
    )
    turn = prompt.split("<｜Assistant｜></think>")[1].removesuffix("<｜end▁of▁sentence｜>")
    content, got = parse(turn, parser="deepseek_v32")
    assert content == "On it."
    assert [(c.name, json.loads(c.arguments)) for c in got] == list(
        zip(["get_weather", "search"], args)
    )


# ---- the grammar of tool_choice "required" and named ------------------------------------------


def test_the_dsml_grammar_admits_exactly_well_formed_calls():
    pytest.importorskip("xgrammar")

    def follows(spec: str, text: str) -> bool:
        return grammar_utils.follows(StructuredOutput("structural_tag", spec), text)

    required = tool_parser.tool_call_grammar(TOOLS, None, True, "deepseek_v32")
    assert follows(required, block(WEATHER))
    assert follows(required, block(WEATHER, TIME))
    assert follows(
        required, block(invoke("get_weather", p("city", "São Paulo"), p("unit", "fahrenheit")))
    )
    assert not follows(required, block())  # at least one call
    assert not follows(required, "Sure." + block(WEATHER))  # nothing before the calls
    assert not follows(required, block(WEATHER).removeprefix("\n\n"))  # the encoder's "\n\n"
    assert not follows(required, block(invoke("rm_rf", p("path", "/"))))  # undeclared
    assert not follows(required, block(invoke("get_weather", p("city", "Paris"))))  # required unit
    assert not follows(
        required, block(invoke("get_weather", p("unit", "celsius"), p("city", "Paris")))
    )
    assert not follows(
        required, block(invoke("get_weather", p("city", "Paris"), p("unit", "kelvin")))
    )
    assert not follows(
        required, block(invoke("get_time", p("timezone", "Antarctica/Troll")))
    )  # max 12
    assert not follows(
        required, block(invoke("get_time", p("timezone", '"CET"', False)))
    )  # a string
    assert not follows(required, block(invoke("get_time", p("timezone", "CET"), p("x", "1"))))
    assert not follows(
        required, block(invoke("get_time", p("timezone", "CET") + "\n\n\n"))
    )  # padding
    assert not follows(required, CALLS_BEGIN + CALL_BEGIN + "get_time" + SEP + '{"timezone": "CET"}'
                       + CALL_END + CALLS_END)  # fmt: skip
    single = tool_parser.tool_call_grammar(TOOLS, None, False, "deepseek_v32")
    assert follows(single, block(TIME))
    assert not follows(single, block(WEATHER, TIME))
    named_ = tool_parser.tool_call_grammar(TOOLS, "get_time", True, "deepseek_v32")
    assert follows(named_, block(TIME))
    assert not follows(named_, block(WEATHER))
    # what the grammar admits, the reader reads back to schema-valid arguments
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    _, calls = parse(block(WEATHER, TIME), parser="deepseek_v32")
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), schemas[c.name])


def test_typed_parameters_in_the_grammar_are_json():
    pytest.importorskip("xgrammar")
    tools = [{"type": "function", "function": {"name": "plan", "parameters": {
        "type": "object",
        "properties": {"days": {"type": "integer"},
                       "stops": {"type": "array", "items": {"type": "string"}},
                       "note": {"type": "string"}},
        "required": ["days"],
    }}}]  # fmt: skip
    spec = StructuredOutput(
        "structural_tag", tool_parser.tool_call_grammar(tools, None, True, "deepseek_v32")
    )
    ok = block(
        invoke(
            "plan", p("days", "3", False), p("stops", '["Lyon", "Nice"]', False), p("note", "hi")
        )
    )
    assert grammar_utils.follows(spec, ok)
    assert grammar_utils.follows(spec, block(invoke("plan", p("days", "3", False))))
    assert not grammar_utils.follows(spec, block(invoke("plan", p("days", "3"))))  # not raw
    assert not grammar_utils.follows(spec, block(invoke("plan", p("days", "3.5", False))))
    assert not grammar_utils.follows(spec, block(invoke("plan", p("note", "hi"))))  # days required
    _, (call,) = parse(ok, parser="deepseek_v32")
    assert json.loads(call.arguments) == {"days": 3, "stops": ["Lyon", "Nice"], "note": "hi"}


# ---- over HTTP, with the openai client ----------------------------------------------------------

DSML_TAGS = [DSML_CALLS_BEGIN, DSML_CALLS_END, f"<{D}invoke", DSML_INVOKE_END, f"<{D}parameter",
             DSML_PARAM_END]  # fmt: skip


def as_deepseek_v32(model: Path) -> None:
    """The checkpoint made a DeepSeek-V3.2 one: its architecture, and a random lightning
    indexer in every layer (the MTP layer's too) whose index_topk, 4096, is past the whole
    2048-token context, so every query keeps every token and the trained weights decode
    as they did."""
    cfg = json.loads((model / "config.json").read_text())
    cfg |= {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
            "index_topk": 4096, "index_head_dim": 64, "index_n_heads": 4}  # fmt: skip
    g = torch.Generator().manual_seed(0)
    h, q, d, heads = cfg["hidden_size"], cfg["q_lora_rank"], 64, 4
    tensors = {}
    for i in range(cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]):
        p = f"model.layers.{i}.self_attn.indexer"
        tensors[f"{p}.wq_b.weight"] = torch.randn(heads * d, q, generator=g) * q**-0.5
        tensors[f"{p}.wk.weight"] = torch.randn(d, h, generator=g) * h**-0.5
        tensors[f"{p}.k_norm.weight"], tensors[f"{p}.k_norm.bias"] = torch.ones(d), torch.zeros(d)
        tensors[f"{p}.weights_proj.weight"] = torch.randn(heads, h, generator=g) * h**-0.5
    save_file(tensors, str(model / "model-indexer.safetensors"))
    index = json.loads((model / INDEX_FILE).read_text())
    index["weight_map"] |= dict.fromkeys(tensors, "model-indexer.safetensors")
    (model / INDEX_FILE).write_text(json.dumps(index))
    (model / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def dsml_server(tmp_path_factory):
    """The daemon on a DeepSeek-V3.2 test checkpoint: a copy of the bundled model with the
    DSML tags added as tokens (tools/add_special_tokens.py) and a lightning indexer
    (`as_deepseek_v32`), V3.2's encoding and the DSML reader."""
    model = tmp_path_factory.mktemp("dsml-bundled") / "model"
    tokens = [a for tag in DSML_TAGS for a in ("--token", tag)]
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "add_special_tokens.py"), "--model",
         str(BUNDLED_MODEL_DIR), "--output-dir", str(model), *tokens],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    as_deepseek_v32(model)
    flags = ["--dtype=float32", f"--model={model}", "--chat_template=deepseek_v32",
             "--tool_call_parser=deepseek_v32", "--num_speculative_tokens=0"]  # fmt: skip
    with Server(*eager_unless_asked(flags)) as s:
        yield s.url, openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)


def test_a_required_call_is_valid_dsml_streamed_and_not(dsml_server):
    url, client = dsml_server
    kw, choice, tc, _ = required_call(client, max_tokens=256)
    # the prompt is V3.2's encoding (not the bundled model's own template)
    body = {"messages": kw["messages"], "tools": TOOLS}
    ids = HTTP.post(url + "/tokenize", json=body, timeout=30).json()["tokens"]
    text = HTTP.post(url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert text == encoding_dsv32.render(kw["messages"], TOOLS)
    # the call and its result render into the next turn
    follow_up = [
        *kw["messages"],
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": tc.id, "content": '{"temperature": 21}'},
    ]
    body = {"messages": follow_up, "tools": TOOLS}
    ids = HTTP.post(url + "/tokenize", json=body, timeout=30).json()["tokens"]
    text = HTTP.post(url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    result = '<result>{"temperature": 21}</result>'
    assert text.endswith(f"\n\n<function_results>\n{result}\n</function_results>\n\n</think>")
    again = client.chat.completions.create(**dict(kw, messages=follow_up, tool_choice="none"))
    assert again.choices[0].finish_reason in ("stop", "length")
