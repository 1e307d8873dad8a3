"""tools/add_special_tokens.py on a tiny random checkpoint (HF-written, sharded as HF
writes it): the tokens become single added ids that decoding keeps, the vocabulary
tensors grow to a padded size with mean rows, the engine loads the result, and its greedy
output for prompts without the new tokens is what it was. A second run adds nothing."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors import safe_open

from tools.add_special_tokens import DEEPSEEK_TOOL_TOKENS, add_tokens
from xllm_py import LLM, SamplingParams
from xllm_py.engine.tokenizer import Tokenizer


def tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out |= {n: st.get_tensor(n) for n in st.keys()}
    return out


def greedy(path, prompts):
    llm = LLM(str(path), dtype="float32")
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
    )
    return [o.outputs[0].token_ids for o in outs]


def test_tokens_are_added_and_the_model_is_unchanged_without_them(tiny_model_dir, tmp_path):
    before = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    old = tensors(tiny_model_dir)
    out = tmp_path / "grown"
    result = add_tokens(tiny_model_dir, [*DEEPSEEK_TOOL_TOKENS, "<x>"], out, pad_to=16)
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    assert vocab == result["vocab_size"] and vocab % 16 == 0
    assert vocab >= len(Tokenizer.from_dir(tiny_model_dir)._tok.get_vocab()) + 10 > before
    assert sorted(result["added"]) == sorted([*DEEPSEEK_TOOL_TOKENS, "<x>"])

    tok = Tokenizer.from_dir(out)
    for text, tid in result["added"].items():
        assert tok.encode("a" + text + "b", add_special_tokens=False)[1] == tid
        assert tok.decode([tid]) == text
    new = tensors(out)
    assert result["tensors"] and set(result["tensors"]) <= set(new)
    for name, t in new.items():
        if name in result["tensors"]:
            assert t.shape[0] == vocab and torch.equal(t[:before], old[name])
            assert torch.allclose(
                t[before:].float(), old[name].float().mean(0).expand_as(t[before:]), atol=1e-2
            )
        else:
            assert torch.equal(t, old[name]), name

    prompts = [[5, 9, 17, 3], [40, 41, 42, 43, 44, 45], [7]]
    assert greedy(out, prompts) == greedy(tiny_model_dir, prompts)

    again = add_tokens(out, list(DEEPSEEK_TOOL_TOKENS), pad_to=16)  # in place
    assert again["added"] == {} and again["vocab_size"] == vocab and again["tensors"] == []


def test_the_command_line_says_what_is_missing(tmp_path, tiny_model_dir, capsys):
    import pytest

    from tools.add_special_tokens import main

    with pytest.raises(SystemExit):
        main(["--model", str(tiny_model_dir)])
    assert "nothing to add" in capsys.readouterr().err
    copy = tmp_path / "m"
    shutil.copytree(tiny_model_dir, copy)
    main(["--model", str(copy), "--token", "<y>"])
    assert json.loads(capsys.readouterr().out)["added"] == {
        "<y>": Tokenizer.from_dir(copy).encode("<y>", add_special_tokens=False)[0]
    }
