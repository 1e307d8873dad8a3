"""Tool calls in DeepSeek-V3.1's format (`--tool_call_parser=deepseek_v31`) and Kimi-K2's
(`--tool_call_parser=kimi_k2`).

- The reader (xllm_py/formats/tool_parser.py) on text fixtures written from the
  formats as the models' chat templates render them: one call, several in one section,
  text before the section, a malformed call skipped, text after the section dropped, an
  output cut short inside a call, a marker that never completed; each parsed whole,
  streamed cut in two at every place, one character at a time and at random cuts, all
  giving the same content and calls.
- Kimi-K2's `functions.NAME:IDX` is the call's OpenAI id, exactly, streamed and whole.
- The tool-call grammar of each format admits exactly well-formed calls to declared
  functions (V3.1 over the bundled tokenizer, which has DeepSeek's tool tokens; Kimi over
  the bundled tokenizer with Kimi's markers added), and the bundled model's greedy output
  under V3.1's grammar parses back into valid calls.
- Over HTTP with the real `openai` client, under each parser, `tool_choice="required"`
  gives a schema-valid call on the bundled model (grammar-forced; Kimi's run on a copy with
  Kimi's markers added as tokens), whole and streamed, and Kimi's id comes back as the
  model wrote it and is accepted as the next turn's `tool_call_id`.
- A parser name `xllm` does not know is refused on the command line, naming the bad value
  and the valid ones.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys

import jsonschema
import openai
import openai.types.chat as oai
import pytest

from tests import grammar_utils
from tests.server_utils import ROOT, Server
from tests.test_tool_calls import TOOLS
from xllm_py import LLM, SamplingParams
from xllm_py.assets import BUNDLED_MODEL_DIR
from xllm_py.config import ModelConfig
from xllm_py.engine.tokenizer import Tokenizer
from xllm_py.formats import reasoning, tool_parser
from xllm_py.formats.tool_parser import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    KIMI_ARGS_BEGIN,
    KIMI_CALL_BEGIN,
    KIMI_CALL_END,
    KIMI_CALLS_BEGIN,
    KIMI_CALLS_END,
    SEP,
    parse,
    stream_for,
)
from xllm_py.sampling_params import StructuredOutput


def v31(name: str, args: str) -> str:
    return f"{CALL_BEGIN}{name}{SEP}{args}{CALL_END}"


def kimi(call_id: str, args: str) -> str:
    return f"{KIMI_CALL_BEGIN}{call_id}{KIMI_ARGS_BEGIN}{args}{KIMI_CALL_END}"


WEATHER, TIME = '{"location": "Tokyo"}', '{"timezone": "Asia/Tokyo", "format": "24h"}'
NESTED = '{"q": "a < b, <｜tool▁sep｜ and }{", "filters": {"year": [2024]}}'

# (output text, content, [(name, arguments)])
V31_FIXTURES = [
    ("The weather is sunny.", "The weather is sunny.", []),
    (CALLS_BEGIN + v31("get_weather", WEATHER) + CALLS_END, None, [("get_weather", WEATHER)]),
    (  # several calls, back to back as V3.1's template writes them
        CALLS_BEGIN + v31("get_weather", WEATHER) + v31("get_time", TIME) + CALLS_END,
        None,
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    (  # a line break between calls is read past
        CALLS_BEGIN + v31("get_weather", WEATHER) + "\n" + v31("get_time", TIME) + CALLS_END,
        None,
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    (
        "Let me look that up.\n\n" + CALLS_BEGIN + v31("get_weather", WEATHER) + CALLS_END,
        "Let me look that up.\n\n",
        [("get_weather", WEATHER)],
    ),
    (CALLS_BEGIN + v31("search", NESTED) + CALLS_END, None, [("search", NESTED)]),
    (  # pretty-printed arguments keep their newlines
        CALLS_BEGIN + v31("f", '{\n  "a": 1\n}') + CALLS_END, None, [("f", '{\n  "a": 1\n}')]
    ),
    (  # V3's header (`function<sep>NAME` and a fence) is not V3.1's: its name is "function"
        CALLS_BEGIN + v31("function", 'f\n```json\n{}\n```') + CALLS_END,
        None,
        [("function", 'f\n```json\n{}\n```')],
    ),
    (  # calls whose header does not parse are skipped, the others kept
        CALLS_BEGIN + f'{CALL_BEGIN}{{"a": 1}}{CALL_END}' + v31("f", "{}")
        + v31("bad name", "{}") + v31("", "{}") + v31("g", '{"b": 2}') + CALLS_END,
        None,
        [("f", "{}"), ("g", '{"b": 2}')],
    ),
    (  # after the calls end nothing more is read
        CALLS_BEGIN + v31("f", "{}") + CALLS_END + "trailing" + v31("g", "{}"),
        None,
        [("f", "{}")],
    ),
    (  # cut short (max_tokens) inside the arguments: what arrived is kept
        CALLS_BEGIN + f'{CALL_BEGIN}f{SEP}{{"a": ', None, [("f", '{"a": ')]
    ),
    (CALLS_BEGIN + f"{CALL_BEGIN}get_wea", None, []),  # cut short inside the header
    ("<｜tool▁calls", "<｜tool▁calls", []),  # a marker that never completed is text
]  # fmt: skip

# (output text, content, [(id, name, arguments)])
KIMI_FIXTURES = [
    ("The weather is sunny.", "The weather is sunny.", []),
    (
        KIMI_CALLS_BEGIN + kimi("functions.get_weather:0", WEATHER) + KIMI_CALLS_END,
        None,
        [("functions.get_weather:0", "get_weather", WEATHER)],
    ),
    (  # several calls; the index counts calls over the conversation, not within one turn
        KIMI_CALLS_BEGIN + kimi("functions.get_weather:3", WEATHER)
        + kimi("functions.get_time:4", TIME) + KIMI_CALLS_END,
        None,
        [("functions.get_weather:3", "get_weather", WEATHER),
         ("functions.get_time:4", "get_time", TIME)],
    ),
    (  # the same function twice: two ids
        KIMI_CALLS_BEGIN + kimi("functions.f:0", '{"a": 1}') + "\n"
        + kimi("functions.f:1", '{"a": 2}') + KIMI_CALLS_END,
        None,
        [("functions.f:0", "f", '{"a": 1}'), ("functions.f:1", "f", '{"a": 2}')],
    ),
    (
        "Let me check.\n" + KIMI_CALLS_BEGIN + kimi("functions.search:0", NESTED)
        + KIMI_CALLS_END,
        "Let me check.\n",
        [("functions.search:0", "search", NESTED)],
    ),
    (  # spaces around the id and the arguments, as some outputs have them
        KIMI_CALLS_BEGIN + " " + kimi(" functions.f:0 ", ' {"a": 1} ') + " " + KIMI_CALLS_END,
        None,
        [("functions.f:0", "f", ' {"a": 1} ')],
    ),
    (  # an id without the `functions.` prefix names the function all the same
        KIMI_CALLS_BEGIN + kimi("lookup:7", "{}") + KIMI_CALLS_END,
        None,
        [("lookup:7", "lookup", "{}")],
    ),
    (  # calls whose header does not parse (no index, no name, no argument marker) skipped
        KIMI_CALLS_BEGIN + kimi("functions.f", "{}") + kimi(":0", "{}")
        + f"{KIMI_CALL_BEGIN}functions.f:0{{}}{KIMI_CALL_END}"
        + kimi("functions.g:2", '{"b": 2}') + KIMI_CALLS_END,
        None,
        [("functions.g:2", "g", '{"b": 2}')],
    ),
    (  # after the section ends nothing more is read
        KIMI_CALLS_BEGIN + kimi("functions.f:0", "{}") + KIMI_CALLS_END + "done."
        + kimi("functions.g:1", "{}"),
        None,
        [("functions.f:0", "f", "{}")],
    ),
    (  # cut short inside the arguments: what arrived is kept
        KIMI_CALLS_BEGIN + f"{KIMI_CALL_BEGIN}functions.f:0{KIMI_ARGS_BEGIN}" + '{"a": [1, ',
        None,
        [("functions.f:0", "f", '{"a": [1, ')],
    ),
    ("x <|tool_calls_sec", "x <|tool_calls_sec", []),  # a marker that never completed
    (  # DeepSeek's markers are text to Kimi's reader
        CALLS_BEGIN + v31("f", "{}") + CALLS_END, CALLS_BEGIN + v31("f", "{}") + CALLS_END, []
    ),
]  # fmt: skip

CASES = [("deepseek_v31", t, c, [(n, a) for n, a in calls]) for t, c, calls in V31_FIXTURES]
CASES += [("kimi_k2", t, c, [(n, a) for _, n, a in calls]) for t, c, calls in KIMI_FIXTURES]


def pieces(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str, str]]]:
    """(content, [(id, name, arguments)]) of streamed delta fields, checking their shape:
    id, type and name first, once per call, then argument fragments only."""
    content = "".join(d.get("content", "") for d in deltas) or None
    calls: dict[int, list] = {}
    for t in [t for d in deltas for t in d.get("tool_calls", [])]:
        if "id" in t:
            assert t["index"] not in calls and t["type"] == "function"
            assert t["function"]["arguments"] == ""
            calls[t["index"]] = [t["id"], t["function"]["name"], ""]
        else:
            assert set(t) == {"index", "function"} and set(t["function"]) == {"arguments"}
            calls[t["index"]][2] += t["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in sorted(calls)]


def stream(parser: str, text: str, cuts: list[int]) -> tuple[str | None, list[tuple]]:
    s = stream_for(parser)
    bounds = [0, *cuts, len(text)]
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    return pieces([s.feed(c, final=i == len(chunks) - 1) for i, c in enumerate(chunks)])


def named(calls: list[tuple]) -> list[tuple[str, str]]:
    return [(name, args) for _, name, args in calls]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_whole_outputs_parse(parser, text, content, calls):
    got_content, got = parse(text, parser=parser)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls
    assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_streamed_outputs_parse_the_same_however_they_are_cut(parser, text, content, calls):
    whole_ids = [c.id for c in parse(text, parser=parser)[1]]
    for cut in range(1, len(text)):
        got_content, got = stream(parser, text, [cut])
        assert (got_content, named(got)) == (content, calls), cut
    got_content, got = stream(parser, text, list(range(1, len(text))))  # a character at a time
    assert (got_content, named(got)) == (content, calls)
    if parser == "kimi_k2":  # the model's ids, not made ones: the same however it streamed
        assert [i for i, _, _ in got] == whole_ids
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 12))))
        assert named(stream(parser, text, cuts)[1]) == calls, cuts


@pytest.mark.parametrize("text,content,calls", KIMI_FIXTURES)
def test_kimi_ids_round_trip(text, content, calls):
    """The id the model wrote is the tool_call id a client gets, and sends back as the
    tool message's tool_call_id, streamed or not."""
    _, got = parse(text, parser="kimi_k2")
    assert [(c.id, c.name, c.arguments) for c in got] == calls
    for c in got:
        msg = oai.ChatCompletionMessage.model_validate(
            {"role": "assistant", "content": None, "tool_calls": [c.openai()]}
        )
        assert msg.tool_calls[0].id == c.id
    assert [i for i, _, _ in stream("kimi_k2", text, [])[1]] == [i for i, _, _ in calls]


def test_the_deepseek_formats_make_ids():
    _, (call,) = parse(CALLS_BEGIN + v31("f", "{}") + CALLS_END, parser="deepseek_v31")
    assert call.id.startswith("call_") and len(call.id) == 29


@pytest.mark.parametrize(
    "parser,text",
    [
        ("deepseek_v31", CALLS_BEGIN + v31("get_weather", WEATHER) + v31("get_time", TIME)),
        ("kimi_k2", KIMI_CALLS_BEGIN + kimi("functions.a:0", "{}") + kimi("functions.b:1", "{}")),
    ],
)
def test_parallel_tool_calls_false_keeps_the_first_call(parser, text):
    _, calls = parse(text, parallel=False, parser=parser)
    assert len(calls) == 1 and calls[0].name in ("get_weather", "a")
    s = tool_parser.stream_for(parser, parallel=False)
    assert len(pieces([s.feed(ch) for ch in text] + [s.feed("", final=True)])[1]) == 1


def test_nothing_that_cannot_end_the_arguments_is_held_back():
    s = stream_for("deepseek_v31")
    assert s.feed("Hi <") == {"content": "Hi "}  # "<" might start the calls
    first = s.feed(CALLS_BEGIN + CALL_BEGIN + "f" + SEP + '{"a": 1')
    assert first["tool_calls"][0]["id"] == s.calls[0].id
    assert first["tool_calls"][1] == {"index": 0, "function": {"arguments": '{"a": 1'}}
    assert s.feed("}<｜tool") == {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}
    assert s.feed("▁call▁end｜>" + CALLS_END) == {}
    k = stream_for("kimi_k2")
    k.feed(KIMI_CALLS_BEGIN + KIMI_CALL_BEGIN + "functions.f:0")  # the id is not complete yet
    assert k.calls == []
    got = k.feed(KIMI_ARGS_BEGIN)["tool_calls"]
    assert got == [{"index": 0, "id": "functions.f:0", "type": "function",
                    "function": {"name": "f", "arguments": ""}}]  # fmt: skip


def test_kimi_thinking_then_calls_read_by_both_parsers():
    """Kimi-K2-Thinking may begin its calls before it closes its thinking: the reasoning
    split (--reasoning_parser=kimi_k2) hands the section to the content, where the reader
    finds the calls; streamed a character at a time as whole."""
    section = KIMI_CALLS_BEGIN + kimi("functions.get_weather:0", WEATHER) + KIMI_CALLS_END
    for text, thought in [
        ("<think>I need the weather." + section, "I need the weather."),
        ("<think>I need the weather.</think>" + section, "I need the weather."),
    ]:
        splitter, reader = reasoning.splitter_for("kimi_k2", None), stream_for("kimi_k2")
        r, deltas = "", []
        for i, ch in enumerate(text):
            dr, dc = splitter.feed(ch, final=i == len(text) - 1)
            r += dr
            deltas.append(reader.feed(dc, final=i == len(text) - 1))
        assert r == thought
        assert pieces(deltas) == (None, [("functions.get_weather:0", "get_weather", WEATHER)])


# ---- the grammar of tool_choice "required" and named ------------------------------------------

ARGS_A, ARGS_B = '{"city": "Paris", "unit": "celsius"}', '{"timezone": "CET"}'


def test_the_v31_grammar_admits_exactly_well_formed_calls():
    pytest.importorskip("xgrammar")

    def follows(spec: str, text: str) -> bool:
        return grammar_utils.follows(StructuredOutput("structural_tag", spec), text)

    required = tool_parser.tool_call_grammar(TOOLS, None, True, "deepseek_v31")
    a, b = v31("get_weather", ARGS_A), v31("get_time", ARGS_B)
    assert follows(required, CALLS_BEGIN + a + CALLS_END)
    assert follows(required, CALLS_BEGIN + a + b + CALLS_END)
    assert not follows(required, CALLS_BEGIN + a + "\n" + b + CALLS_END)  # V3's separator
    assert not follows(required, CALLS_BEGIN + CALLS_END)  # at least one
    assert not follows(required, "Sure." + CALLS_BEGIN + a + CALLS_END)
    assert not follows(required, CALLS_BEGIN + v31("rm_rf", "{}") + CALLS_END)
    assert not follows(required, CALLS_BEGIN + v31("get_time", '{"tz": "CET"}') + CALLS_END)
    v3_call = f"{CALL_BEGIN}function{SEP}get_time\n```json\n{ARGS_B}\n```{CALL_END}"
    assert not follows(required, CALLS_BEGIN + v3_call + CALLS_END)
    single = tool_parser.tool_call_grammar(TOOLS, None, False, "deepseek_v31")
    assert follows(single, CALLS_BEGIN + a + CALLS_END)
    assert not follows(single, CALLS_BEGIN + a + b + CALLS_END)
    named_ = tool_parser.tool_call_grammar(TOOLS, "get_time", True, "deepseek_v31")
    assert follows(named_, CALLS_BEGIN + b + CALLS_END)
    assert not follows(named_, CALLS_BEGIN + a + CALLS_END)
    # the markers must be the tokens themselves, not their spelling in pieces
    m = grammar_utils.bundled_matcher(StructuredOutput("structural_tag", required))
    assert not m.accept(grammar_utils.encode("<")[0])


@pytest.fixture(scope="module")
def kimi_tokenizer(tmp_path_factory):
    """The bundled tokenizer with Kimi-K2's tool markers added, one token each."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    path = tmp_path_factory.mktemp("kimi_tokenizer")
    shutil.copy(BUNDLED_MODEL_DIR / "tokenizer_config.json", path)
    tok = HFTokenizer.from_file(str(BUNDLED_MODEL_DIR / "tokenizer.json"))
    markers = [KIMI_CALLS_BEGIN, KIMI_CALLS_END, KIMI_CALL_BEGIN, KIMI_CALL_END, KIMI_ARGS_BEGIN]
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in markers])
    tok.save(str(path / "tokenizer.json"))
    ours = Tokenizer.from_dir(path)
    assert all(len(ours.encode(m, add_special_tokens=False)) == 1 for m in markers)
    return path, ours


def test_the_kimi_grammar_admits_exactly_well_formed_calls(kimi_tokenizer):
    pytest.importorskip("xgrammar")
    from xllm_py.structured import Grammars, Matcher

    path, tok = kimi_tokenizer
    cfg = ModelConfig.from_pretrained(BUNDLED_MODEL_DIR)
    eos = tuple(cfg.eos_token_ids)
    grammars = Grammars(str(path), cfg.vocab_size, eos)

    def follows(spec: str, text: str) -> bool:
        m = Matcher(grammars, StructuredOutput("structural_tag", spec), 8)
        ids = tok.encode(text, add_special_tokens=False)
        return all(m.accept(i) for i in ids) and m.accept(eos[0])

    required = tool_parser.tool_call_grammar(TOOLS, None, True, "kimi_k2")
    a, b = kimi("functions.get_weather:0", ARGS_A), kimi("functions.get_time:12", ARGS_B)
    assert follows(required, KIMI_CALLS_BEGIN + a + KIMI_CALLS_END)
    assert follows(required, KIMI_CALLS_BEGIN + a + b + KIMI_CALLS_END)
    assert not follows(required, KIMI_CALLS_BEGIN + KIMI_CALLS_END)
    assert not follows(required, KIMI_CALLS_BEGIN + kimi("get_weather:0", ARGS_A) + KIMI_CALLS_END)
    assert not follows(required, KIMI_CALLS_BEGIN + kimi("functions.get_time:x", ARGS_B)
                       + KIMI_CALLS_END)  # fmt: skip
    assert not follows(required, KIMI_CALLS_BEGIN + kimi("functions.rm:0", "{}") + KIMI_CALLS_END)
    single = tool_parser.tool_call_grammar(TOOLS, None, False, "kimi_k2")
    assert not follows(single, KIMI_CALLS_BEGIN + a + b + KIMI_CALLS_END)
    named_ = tool_parser.tool_call_grammar(TOOLS, "get_time", True, "kimi_k2")
    assert follows(named_, KIMI_CALLS_BEGIN + b + KIMI_CALLS_END)
    assert not follows(named_, KIMI_CALLS_BEGIN + a + KIMI_CALLS_END)
    # what the grammar admits, the reader reads back, ids included
    _, calls = parse(KIMI_CALLS_BEGIN + a + b + KIMI_CALLS_END, parser="kimi_k2")
    assert [c.id for c in calls] == ["functions.get_weather:0", "functions.get_time:12"]


def test_required_v31_calls_from_the_bundled_model_parse_back():
    pytest.importorskip("xgrammar")
    tok = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": t}], tools=TOOLS)
        for t in ("What is the weather in Paris?", "What time is it in Lima?")
    ]
    spec = tool_parser.tool_call_grammar(TOOLS, None, True, "deepseek_v31")
    llm = LLM(num_speculative_tokens=0, dtype="float32", block_size=16)
    so = StructuredOutput("structural_tag", spec)
    outs = llm.generate(prompts, SamplingParams(max_tokens=96, temperature=0.0, structured=so))
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for out in (o.outputs[0] for o in outs):
        assert out.finish_reason == "stop", out.text
        content, calls = parse(out.text, parser="deepseek_v31")
        assert content is None and calls, out.text
        for c in calls:
            jsonschema.validate(json.loads(c.arguments), schemas[c.name])


# ---- the command line -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag,valid",
    [
        ("--tool_call_parser", ["deepseek_v3", "deepseek_v31", "kimi_k2", "deepseek_v4"]),
        ("--reasoning_parser", ["deepseek_r1", "deepseek_v3", "kimi_k2"]),
    ],
)
def test_parser_names_on_the_command_line(capsys, flag, valid):
    from xllm_py.cli import build_parser

    parser = build_parser()
    for name in valid:
        assert getattr(parser.parse_args([f"{flag}={name}"]), flag[2:]) == name
    with pytest.raises(SystemExit) as e:
        parser.parse_args([f"{flag}=deepseek_v9"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "'deepseek_v9'" in err
    assert all(f"'{name}'" in err for name in valid)
    assert all(name in parser.format_help() for name in valid)


# ---- over HTTP, with the openai client ----------------------------------------------------------


@pytest.fixture(scope="module", params=["deepseek_v31", "kimi_k2"])
def parser_server(request, tmp_path_factory):
    """The daemon with each parser. Kimi's runs a copy of the bundled model with Kimi's five
    markers added as tokens (tools/add_special_tokens.py), as its tokenizer has them."""
    args = ["--dtype=float32", f"--tool_call_parser={request.param}"]
    if request.param == "kimi_k2":
        model = tmp_path_factory.mktemp("kimi-bundled") / "model"
        markers = [KIMI_CALLS_BEGIN, KIMI_CALLS_END, KIMI_CALL_BEGIN, KIMI_CALL_END,
                   KIMI_ARGS_BEGIN]  # fmt: skip
        tokens = [a for m in markers for a in ("--token", m)]
        tool = ROOT / "tools" / "add_special_tokens.py"
        done = subprocess.run(
            [sys.executable, str(tool), "--model", str(BUNDLED_MODEL_DIR), "--output-dir",
             str(model), *tokens], capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        args.append(f"--model={model}")
    with Server(*args) as s:
        yield request.param, openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)


def required_call(client, max_tokens: int):
    """A `tool_choice="required"` request for the weather in Paris, whole and streamed: its
    kwargs, the whole answer's choice and call (a valid call to a declared tool, arguments
    that follow its schema), and the streamed tool-call deltas, whose name and arguments
    are the whole answer's."""
    kw = dict(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=max_tokens,
        temperature=0,
    )
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (tc,) = choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(tc.function.arguments), schemas[tc.function.name])
    chunks = list(client.chat.completions.create(**kw, stream=True))
    parts = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert parts[0].id and parts[0].function.name == tc.function.name
    assert "".join(p.function.arguments or "" for p in parts) == tc.function.arguments
    return kw, choice, tc, parts


def test_a_required_call_under_each_parser_is_valid_streamed_and_not(parser_server):
    parser, client = parser_server
    kw, choice, tc, parts = required_call(client, max_tokens=96)
    if parser == "kimi_k2":  # the model's own id, which a later turn's tool_call_id names
        assert re.fullmatch(rf"functions\.{tc.function.name}:\d+", tc.id), tc.id
    if parser == "kimi_k2":  # the same id whole and streamed (others are drawn per request)
        assert parts[0].id == tc.id
    follow_up = [
        *kw["messages"],
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": tc.id, "content": '{"temperature": 21}'},
    ]
    again = client.chat.completions.create(**dict(kw, messages=follow_up, tool_choice="none"))
    assert again.choices[0].message.content
