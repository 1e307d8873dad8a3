"""Structured outputs (xllm_py/structured/, xgrammar) stay lossless under MTP: for 20 JSON
schemas and 16 held-out ShareGPT prompts each, greedy output is identical for k = 0, 1
and 3, and every output parses and validates against its schema (`jsonschema`, not
xgrammar). Sampled at temperature 0.8 under a schema, speculative and plain outputs have
the same distribution. Over HTTP: OpenAI's `response_format`, vLLM's guided_* and
`structured_outputs`, and a 400 naming the field for each kind of bad constraint."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import jsonschema
import openai
import pytest

from tests.chisquare import ALPHA, homogeneity
from tests.grammar_utils import bundled, bundled_matcher, follows
from tests.server_utils import HTTP, Server
from tests.test_bundled_model import held_out_user_turns
from xllm_py import LLM, SamplingParams
from xllm_py.entrypoints.openai_protocol import _structural_tag
from xllm_py.sampling_params import StructuredOutput
from xllm_py.structured import after_reasoning, allocate_bitmask, unpack_bitmask

pytest.importorskip("xgrammar")

INT = {"type": "integer", "minimum": 0, "maximum": 99}
WORD = {"type": "string", "minLength": 1, "maxLength": 6}


def obj(required: bool = True, **props) -> dict:
    out = {"type": "object", "properties": props}
    if required:
        out["required"] = list(props)
    return out


SCHEMAS = [
    obj(answer={"enum": ["yes", "no", "maybe"]}),
    obj(n=INT),
    obj(user=obj(name=WORD, age={"type": "integer", "minimum": 0, "maximum": 120})),
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none", "all"]}]},
    obj(ok={"type": "boolean"}),
    obj(score={"type": "number", "minimum": 0, "maximum": 1}),
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    {"const": "fixed"},
    {
        "type": "array",
        "items": obj(id={"type": "integer", "minimum": 1, "maximum": 5}),
        "minItems": 1,
        "maxItems": 2,
    },
    {"type": "string", "pattern": "^[a-z]{1,6}$"},
    {
        **obj(required=False, a={"type": "integer", "minimum": 0, "maximum": 5}, b={"enum": ["x"]}),
        "required": ["a"],
    },
    {"anyOf": [obj(kind={"const": "a"}), obj(kind={"const": "b"}, v=INT)]},
    obj(nothing={"type": "null"}, word=WORD),
    obj(word=WORD),
    {"enum": [1, 2, 3]},
    obj(a=obj(b=obj(c={"type": "boolean"}))),
    obj(x={"type": "integer", "minimum": -5, "maximum": 5}, y=INT, tag={"enum": ["p", "q"]}),
    {
        "type": "array",
        "items": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
        "minItems": 1,
        "maxItems": 3,
    },
    obj(items={"type": "array", "items": WORD, "maxItems": 2}, count=INT),
]
MAX_TOKENS = 96
OPTIONS = dict(dtype="float32", block_size=16)


@pytest.fixture(scope="module")
def prompts():
    llm = LLM(**OPTIONS)
    tok = llm.get_tokenizer()
    return [
        tok.apply_chat_template([{"role": "user", "content": t}]) for t in held_out_user_turns(16)
    ]


def params(schema: dict, **kw) -> SamplingParams:
    so = StructuredOutput("json", json.dumps(schema))
    return SamplingParams(structured=so, **({"max_tokens": MAX_TOKENS, "temperature": 0.0} | kw))


def generate(prompts, k: int) -> tuple[list[str], LLM]:
    llm = LLM(num_speculative_tokens=k, **OPTIONS)
    reqs = [(p, params(s)) for s in SCHEMAS for p in prompts]
    outs = llm.generate([p for p, _ in reqs], [sp for _, sp in reqs], use_tqdm=False)
    blocks = llm.engine.core.blocks
    assert blocks.num_free_blocks == blocks.num_blocks
    return [o.outputs[0] for o in outs], llm


@pytest.fixture(scope="module")
def plain(prompts):
    return generate(prompts, 0)[0]


def test_every_output_is_valid_json_of_its_schema(prompts, plain):
    for n, out in enumerate(plain):
        schema = SCHEMAS[n // len(prompts)]
        assert out.finish_reason == "stop", (schema, out.text)  # the grammar ended it
        jsonschema.validate(json.loads(out.text), schema)
    assert len({o.text for o in plain}) > len(SCHEMAS)  # not one answer per schema


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_is_identical_under_mtp(prompts, plain, k):
    spec, llm = generate(prompts, k)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    m = llm.get_metrics()
    assert 0 < m.accepted_tokens < m.draft_tokens


def test_a_bitmask_filled_during_the_forward_gives_the_same_tokens(prompts, plain):
    """overlap_grammar (the default on accelerators) forced on here, on CPU."""
    llm = LLM(num_speculative_tokens=1, **OPTIONS)
    llm.engine.core.executor.worker.runner.overlap_grammar = True
    reqs = [(p, params(s)) for s in SCHEMAS[:5] for p in prompts]
    outs = llm.generate([p for p, _ in reqs], [sp for _, sp in reqs], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.token_ids for o in plain[: len(reqs)]]


def test_free_and_constrained_requests_share_a_batch(prompts, plain):
    """Free requests batched before and between constrained ones (so a grammar's rows are
    not the batch's first; with MTP drafts, k = 1): each constrained request gives the
    tokens it gives in a batch of its own kind, each free one the tokens it gives alone."""
    llm = LLM(num_speculative_tokens=1, **OPTIONS)
    free = SamplingParams(max_tokens=16, temperature=0.0)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts[:4], free)]
    schema_of = [1, 4, 7, 9]
    reqs = [
        r
        for i, s in enumerate(schema_of)
        for r in ((prompts[i], free), (prompts[i], params(SCHEMAS[s])))
    ]
    outs = [
        o.outputs[0].token_ids for o in llm.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    ]
    assert outs[0::2] == alone
    assert outs[1::2] == [plain[s * len(prompts) + i].token_ids for i, s in enumerate(schema_of)]


SAMPLED_SCHEMA = obj(word=WORD, n={"type": "integer", "minimum": 0, "maximum": 9})
SAMPLES = 1500


def sample(prompt: str, k: int, seed: int) -> list[list[int]]:
    llm = LLM(num_speculative_tokens=k, seed=seed, max_seqs_per_batch=512, **OPTIONS)
    sp = params(SAMPLED_SCHEMA, temperature=0.8, max_tokens=8, ignore_eos=True)
    outs = llm.generate([prompt] * SAMPLES, sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_sampled_output_under_a_schema_keeps_its_distribution(prompts):
    plain, spec = sample(prompts[0], 0, 1), sample(prompts[0], 2, 2)
    assert plain != spec
    for i in range(8):
        v = homogeneity([t[i] for t in plain], [t[i] for t in spec])
        assert v.p_value > ALPHA, f"position {i}: {v}"


def test_under_a_reasoning_parser_the_grammar_starts_after_the_reasoning():
    """after_reasoning: any text up to </think>, unconstrained (the bitmask allows every
    token), then the constraint."""
    tok, cfg = bundled()
    schema = obj(n=INT)

    def follows_after(so: StructuredOutput, text: str) -> bool:
        return follows(after_reasoning(so, "</think>"), text)

    js = StructuredOutput("json", json.dumps(schema))
    assert follows_after(js, '<think>\nno {"n": x} yet</think>{"n": 7}')
    assert not follows_after(js, 'ok</think>{"n": "seven"}')
    assert not follows_after(js, '{"n": 7}')  # the reasoning has to end first
    assert not follows_after(js, 'x</think>{"n": 7, "m": 1}')
    assert follows_after(
        StructuredOutput("json", json.dumps(schema), strict=False), 'x</think>{"n": 7, "m": 1}'
    )
    assert follows_after(StructuredOutput("choice", '["yes", "no"]'), "hmm</think>no")
    assert not follows_after(StructuredOutput("regex", "[0-9]+"), "hmm</think>12a")
    m = bundled_matcher(after_reasoning(js, "</think>"))
    bitmask = allocate_bitmask(1, cfg.vocab_size)
    m.fill(bitmask, 0)
    allowed = unpack_bitmask(bitmask, cfg.vocab_size)[0]
    assert allowed[:8192].sum() > 8000  # inside the reasoning nearly every token may come
    for t in tok.encode("think about it</think>", add_special_tokens=False):
        assert m.accept(t)
    m.fill(bitmask, 0)
    allowed = unpack_bitmask(bitmask, cfg.vocab_size)[0]
    assert 0 < allowed.sum() < 50  # then only what starts {"n": ...


def test_vllms_first_structural_tag_form_is_free_text_then_tags():
    """vLLM's `structures` + `triggers` structural tag, as the API turns it into xgrammar's."""
    spec = {"type": "structural_tag", "triggers": ["<n"],
            "structures": [{"begin": "<n>", "schema": SCHEMAS[1], "end": "</n>"}]}  # fmt: skip
    so = _structural_tag("structural_tag", json.dumps(spec))
    assert follows(so, 'free text <n>{"n": 5}</n> more text')
    assert follows(so, "no tag at all")
    assert not follows(so, 'free text <n>{"n": "five"}</n>')


# ---- over HTTP --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    with Server("--dtype=float32", "--num_speculative_tokens=1") as s:
        yield s


def post(server, path: str, **body) -> httpx.Response:
    return HTTP.post(server.url + path, json=body, timeout=120)


def test_the_request_forms_all_constrain(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    schema = SCHEMAS[2]
    messages = [{"role": "user", "content": "Who are you?"}]
    chat = client.chat.completions.create(
        model="tiny-deepseek-v3-mtp", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "user", "schema": schema, "strict": True}},
    )  # fmt: skip
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    obj_only = client.chat.completions.create(
        model="tiny-deepseek-v3-mtp", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert isinstance(json.loads(obj_only.choices[0].message.content), dict)
    base = {"prompt": "The colour is", "max_tokens": 16, "temperature": 0}
    forms = {
        "guided_choice": ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
        "guided_regex": ({"guided_regex": "[0-9]{3}"}, lambda t: len(t) == 3 and t.isdigit()),
        "guided_grammar": ({"guided_grammar": 'root ::= "a" "b"*'}, lambda t: t.startswith("a")),
        "structured_outputs": ({"structured_outputs": {"json": SCHEMAS[1]}},
                               lambda t: jsonschema.validate(json.loads(t), SCHEMAS[1]) is None),
        "guided_json": ({"guided_json": json.dumps(SCHEMAS[0])},
                        lambda t: json.loads(t)["answer"] in ("yes", "no", "maybe")),
        "structural_tag": ({"structural_tag": json.dumps({"type": "structural_tag", "format": {
                               "type": "sequence", "elements": [
                                   {"type": "const_string", "value": "<n>"},
                                   {"type": "json_schema", "json_schema": SCHEMAS[1],
                                    "max_whitespace_cnt": 1}]}}), "max_tokens": 48},
                           lambda t: t.startswith("<n>") and json.loads(t[3:])["n"] >= 0),
    }  # fmt: skip
    for name, (field, ok) in forms.items():
        r = post(server, "/v1/completions", **(base | field))
        assert r.status_code == 200, (name, r.text)
        assert ok(r.json()["choices"][0]["text"]), (name, r.json()["choices"][0]["text"])
    streamed = post(server, "/v1/completions", **base, stream=True, guided_choice=["red", "green"])
    text = "".join(
        json.loads(line[6:])["choices"][0]["text"]
        for line in streamed.text.splitlines()
        if line.startswith("data: {")
    )
    assert text in ("red", "green")


@pytest.mark.parametrize(
    "field, body",
    [
        ("response_format", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "nonsense"}}}}),  # an invalid schema
        ("guided_json", {"guided_json": "{not json"}),
        ("guided_grammar", {"guided_grammar": "root ::= undefined_rule"}),  # does not compile
        ("guided_regex", {"guided_regex": "(unclosed"}),
        ("guided_choice", {"guided_choice": []}),
        ("guided_choice", {"guided_choice": ["a"], "guided_regex": "a"}),  # two at once
        ("structured_outputs", {"structured_outputs": {"json": {}, "regex": "a"}}),
        ("response_format", {"response_format": {"type": "xml"}}),
    ],
)  # fmt: skip
def test_bad_constraints_are_400s_naming_the_field(server, field, body):
    r = post(server, "/v1/completions", prompt="Hi", max_tokens=4, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text


def test_tools_on_a_server_without_a_tool_call_parser_are_a_400(server):
    """This server has no --tool_call_parser: tools are refused unless tool_choice is none
    (then they are only rendered)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "tools": [tool]}
    for choice in (None, "auto", "required"):
        r = post(server, "/v1/chat/completions", **body, tool_choice=choice)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert post(server, "/v1/chat/completions", **body, tool_choice="none").status_code == 200


def test_a_schema_that_compiles_too_long_is_refused_and_holds_nobody_up():
    """200 pattern-constrained string properties take about 1.6 s to compile here; with
    --grammar_compile_timeout=0.2 the request is a 400 naming the field, while a plain
    request sent alongside it is answered."""
    slow = {
        "type": "object",
        "properties": {
            f"p{i}": {
                "type": "string",
                "pattern": f"^[a-z]{{{i % 7 + 1},{i % 11 + 8}}}[0-9]{{2,5}}$",
            }
            for i in range(200)
        },
    }
    body = {"prompt": "Hi", "max_tokens": 4, "temperature": 0}
    with Server("--dtype=float32", "--grammar_compile_timeout=0.2") as s:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            refused = pool.submit(post, s, "/v1/completions", **body, guided_json=slow)
            plain = pool.submit(post, s, "/v1/completions", **body)
            r, p = refused.result(), plain.result()
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json"
        assert "--grammar_compile_timeout" in r.json()["error"]["message"]
        assert p.status_code == 200 and p.json()["choices"][0]["finish_reason"] == "length"
