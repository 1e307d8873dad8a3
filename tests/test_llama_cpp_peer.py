"""perf/llama_cpp_peer.py: llama.cpp as a peer engine for the serving sweep.

Everything up to the last section runs without llama-cpp-python (CI does not compile
llama.cpp): the config and tokenizer shims on the bundled checkpoint, the converter
bootstrap and the conversion cache driven through stand-in converters, the sdist
extraction, the server command line and the request fields. The last tests convert the
bundled model with the real converter and run it in llama.cpp; they are skipped where
llama_cpp is not importable."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from perf import llama_cpp_peer as peer
from perf.daemon import Daemon, free_port
from xllm_py.assets import BUNDLED_MODEL_DIR

ROOT = Path(__file__).resolve().parent.parent
HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
needs_llama_cpp = pytest.mark.skipif(
    not HAVE_LLAMA_CPP,
    reason="llama-cpp-python is not installed (pip install -e .[llamacpp] compiles llama.cpp)",
)


def bundled_config() -> dict:
    return json.loads((BUNDLED_MODEL_DIR / "config.json").read_text())


def tree_digest(path: Path) -> dict[str, str]:
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(path.iterdir())
        if f.is_file()
    }


# ---- shims --------------------------------------------------------------------------------------


def test_bundled_checkpoint_needs_no_config_change_only_the_pre_tokenizer():
    cfg = bundled_config()
    shimmed, changes = peer.shim_config(cfg)
    assert changes == [] and shimmed == cfg
    tok = json.loads((BUNDLED_MODEL_DIR / "tokenizer.json").read_text())
    assert peer.gguf_pre_tokenizer(tok) == "gpt-2"


@pytest.mark.parametrize(
    "edit, key, want",
    [
        (lambda c: c.pop("num_key_value_heads"), "num_key_value_heads", 4),
        (lambda c: c.update(num_key_value_heads=1), "num_key_value_heads", 4),
        (lambda c: c.pop("scoring_func"), "scoring_func", "sigmoid"),
    ],
)
def test_shim_fixes_what_stops_or_misleads_the_converter(edit, key, want):
    cfg = bundled_config()
    edit(cfg)
    before = json.dumps(cfg, sort_keys=True)
    shimmed, changes = peer.shim_config(cfg)
    assert shimmed[key] == want and len(changes) == 1 and key in changes[0]
    assert json.dumps(cfg, sort_keys=True) == before  # the input is not modified
    again, more = peer.shim_config(shimmed)
    assert again == shimmed and more == []


def test_shim_sets_no_sigmoid_routing_for_other_architectures():
    cfg = {"architectures": ["DeepseekV2ForCausalLM"], "num_attention_heads": 2}
    shimmed, _ = peer.shim_config({**cfg, "num_key_value_heads": 2})
    assert "scoring_func" not in shimmed


def _tok(pre, model="BPE", normalizer=None) -> dict:
    return {"model": {"type": model}, "pre_tokenizer": pre, "normalizer": normalizer}


@pytest.mark.parametrize(
    "tok, want",
    [
        (_tok({"type": "ByteLevel", "use_regex": True}), "gpt-2"),
        (_tok({"type": "Sequence", "pretokenizers": [{"type": "ByteLevel"}]}), "gpt-2"),
        (_tok({"type": "ByteLevel", "use_regex": False}), None),  # no GPT-2 split
        (_tok({"type": "Metaspace"}), None),  # sentencepiece-style
        (_tok({"type": "ByteLevel"}, normalizer={"type": "NFC"}), None),
        (_tok({"type": "ByteLevel"}, model="WordPiece"), None),
        (
            _tok(
                {
                    "type": "Sequence",
                    "pretokenizers": [{"type": "Split"}, {"type": "ByteLevel"}],
                }
            ),
            None,  # its own split regex: not gpt-2's
        ),
    ],
)
def test_gpt2_pre_tokenizer_only_for_the_plain_gpt2_split(tok, want):
    assert peer.gguf_pre_tokenizer(tok) == want


def test_model_copy_links_weights_and_leaves_the_bundled_model_alone(tmp_path):
    before = tree_digest(BUNDLED_MODEL_DIR)
    changes = peer.prepare_model_copy(BUNDLED_MODEL_DIR, tmp_path / "copy")
    assert changes == []
    assert tree_digest(BUNDLED_MODEL_DIR) == before
    copy = tmp_path / "copy"
    assert json.loads((copy / "config.json").read_text()) == bundled_config()
    for f in BUNDLED_MODEL_DIR.glob("*.safetensors"):
        assert (copy / f.name).read_bytes() == f.read_bytes()
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json"):
        assert (copy / name).read_bytes() == (BUNDLED_MODEL_DIR / name).read_bytes()


# ---- the converter bootstrap and cache, with stand-in converters --------------------------------

# A stand-in for convert_hf_to_gguf.py: records the pre-tokenizer its TextModel reports,
# its arguments and the config.json it was given, and counts its runs.
FAKE_SCRIPT = """\
import argparse, json, os, sys
from pathlib import Path
{import_line}

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--outfile")
    ap.add_argument("--outtype")
    a = ap.parse_args()
    runs = Path(__file__).parent / "runs"
    runs.write_text(str(int(runs.read_text()) + 1 if runs.exists() else 1))
    if os.environ.get("FAKE_CONVERTER_FAIL"):
        sys.exit("fake converter failure")
    class Model(TextModel):
        pass
    pre = Model().get_vocab_base_pre(None)
    Path(a.outfile).write_text(json.dumps({{
        "pre": pre, "outtype": a.outtype,
        "config": json.loads((Path(a.model) / "config.json").read_text()),
    }}))

if __name__ == "__main__":
    main()
"""
TEXT_MODEL = """\
class TextModel:
    def get_vocab_base_pre(self, tokenizer):
        if {known}:
            return "llama-bpe"
        raise NotImplementedError("BPE pre-tokenizer was not recognized")
"""


def fake_converter(path: Path, split: bool = True, known: bool = False) -> Path:
    """A converter tree: the llama.cpp layout with a `conversion` package (split) or the
    older single script holding TextModel."""
    path.mkdir(parents=True)
    (path / "gguf-py").mkdir()
    model = TEXT_MODEL.format(known=known)
    if split:
        (path / "conversion").mkdir()
        (path / "conversion" / "__init__.py").write_text("")
        (path / "conversion" / "base.py").write_text(model)
        script = FAKE_SCRIPT.format(import_line="from conversion.base import TextModel")
    else:
        script = FAKE_SCRIPT.format(import_line=model)
    (path / "convert_hf_to_gguf.py").write_text(script)
    return path


def runs(converter: Path) -> int:
    f = converter / "runs"
    return int(f.read_text()) if f.exists() else 0


@pytest.mark.parametrize("split", [True, False])
def test_bootstrap_falls_back_to_the_given_pre_tokenizer(tmp_path, split):
    conv = fake_converter(tmp_path / "conv", split=split)
    out = tmp_path / "out.gguf"
    cmd = peer.conversion_command(conv, BUNDLED_MODEL_DIR, out, "f32", "gpt-2")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    assert got["pre"] == "gpt-2" and got["outtype"] == "f32"
    assert "xllm_py shim: unrecognised BPE pre-tokenizer" in proc.stderr
    # no fallback given: the converter stops as it would on its own
    cmd = peer.conversion_command(conv, BUNDLED_MODEL_DIR, tmp_path / "none.gguf", "f32", "")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode != 0 and "NotImplementedError" in proc.stderr


def test_bootstrap_keeps_a_recognised_pre_tokenizer(tmp_path):
    conv = fake_converter(tmp_path / "conv", known=True)
    out = tmp_path / "out.gguf"
    proc = subprocess.run(
        peer.conversion_command(conv, BUNDLED_MODEL_DIR, out, "f16", "gpt-2"),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["pre"] == "llama-bpe"


def small_model(path: Path, config: dict) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((BUNDLED_MODEL_DIR / name).read_bytes())
    (path / "model.safetensors").write_bytes(b"not really weights")
    return path


def test_convert_shims_a_copy_caches_and_redoes_when_inputs_change(tmp_path):
    cfg = bundled_config()
    del cfg["num_key_value_heads"]
    model = small_model(tmp_path / "m", cfg)
    before = tree_digest(model)
    conv = fake_converter(tmp_path / "conv")
    out_dir = tmp_path / "out"

    gguf = peer.convert(model, out_dir, converter=conv)
    assert gguf == out_dir / "m.f32.gguf" and runs(conv) == 1
    got = json.loads(gguf.read_text())
    assert got["pre"] == "gpt-2" and got["outtype"] == "f32"
    assert got["config"]["num_key_value_heads"] == cfg["num_attention_heads"]
    assert tree_digest(model) == before  # the shim went into a copy
    stamp = json.loads(gguf.with_suffix(".json").read_text())
    assert stamp["config_changes"] == ["num_key_value_heads: None -> 4"]
    assert stamp["pre_tokenizer_fallback_used"] is True
    assert stamp["llama_cpp_python"] == peer.installed_version()

    assert peer.convert(model, out_dir, converter=conv) == gguf and runs(conv) == 1  # cached

    older = (model / "model.safetensors").stat().st_mtime - 10
    os.utime(gguf, (older, older))  # an input newer than the GGUF: convert again
    peer.convert(model, out_dir, converter=conv)
    assert runs(conv) == 2
    peer.convert(model, out_dir, converter=conv)
    assert runs(conv) == 2

    stamp["llama_cpp_python"] = "0.0.0-other"  # another llama.cpp made it: convert again
    gguf.with_suffix(".json").write_text(json.dumps(stamp))
    peer.convert(model, out_dir, converter=conv)
    assert runs(conv) == 3


def test_convert_failure_leaves_no_gguf(tmp_path, monkeypatch):
    model = small_model(tmp_path / "m", bundled_config())
    conv = fake_converter(tmp_path / "conv")
    monkeypatch.setenv("FAKE_CONVERTER_FAIL", "1")
    with pytest.raises(RuntimeError, match="fake converter failure"):
        peer.convert(model, tmp_path / "out", converter=conv)
    assert list((tmp_path / "out").iterdir()) == []


def test_converter_files_are_taken_from_the_sdist_and_nothing_else(tmp_path):
    sdist = tmp_path / "llama_cpp_python-9.9.tar.gz"
    base = "llama_cpp_python-9.9/vendor/llama.cpp/"
    files = {
        base + "convert_hf_to_gguf.py": b"script",
        base + "conversion/base.py": b"base",
        base + "gguf-py/gguf/__init__.py": b"gguf",
        base + "convert_hf_to_gguf_update.py": b"no",
        base + "src/llama.cpp": b"no",
        "llama_cpp_python-9.9/llama_cpp/llama.py": b"no",
        base + "gguf-py/../../../../escape.py": b"no",
    }
    with tarfile.open(sdist, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo(base + "conversion/link.py")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    dest = tmp_path / "dest"
    peer._extract_converter(sdist, dest)
    got = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert got == ["conversion/base.py", "convert_hf_to_gguf.py", "gguf-py/gguf/__init__.py"]
    assert not (tmp_path / "escape.py").exists()
    assert (dest / "convert_hf_to_gguf.py").read_bytes() == b"script"


def test_converter_dir_uses_the_env_override_then_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_CPP_CONVERTER_DIR", str(tmp_path / "checkout"))
    assert peer.converter_dir("1.2.3", tmp_path) == tmp_path / "checkout"
    monkeypatch.delenv("LLAMA_CPP_CONVERTER_DIR")
    cached = tmp_path / "llama.cpp-1.2.3"
    cached.mkdir()
    (cached / "convert_hf_to_gguf.py").write_text("")
    assert peer.converter_dir("1.2.3", tmp_path) == cached  # no download


# ---- serving ------------------------------------------------------------------------------------


def test_server_command_serves_the_gguf_on_localhost():
    cmd = peer.server_command(Path("/m/tiny.f32.gguf"), 8123, 2048, 3, python="py")
    assert cmd[:3] == ["py", "-m", "llama_cpp.server"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert len(cmd[3:]) == 2 * len(flags)
    assert flags == {
        "--model": "/m/tiny.f32.gguf",
        "--model_alias": "tiny.f32",
        "--host": "127.0.0.1",
        "--port": "8123",
        "--n_ctx": "2048",
        "--n_threads": "3",
        "--n_threads_batch": "3",
        "--interrupt_requests": "False",  # else a new request cuts the streaming one short
        "--logits_all": "False",
    }
    assert peer.server_command(Path("x.gguf"), 1, 2, 3)[0] == sys.executable
    assert peer.READY_PATH == "/v1/models"


@needs_llama_cpp
def test_server_command_is_what_llama_cpp_server_parses():
    import argparse

    from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
    from llama_cpp.server.settings import ModelSettings, ServerSettings, Settings

    parser = argparse.ArgumentParser()
    add_args_from_model(parser, Settings)
    args = parser.parse_args(peer.server_command(Path("/m/t.gguf"), 8123, 1024, 3)[3:])
    server = parse_model_from_args(ServerSettings, args)
    model = parse_model_from_args(ModelSettings, args)
    assert (server.host, server.port, server.interrupt_requests) == ("127.0.0.1", 8123, False)
    assert (model.model, model.model_alias, model.n_ctx) == ("/m/t.gguf", "t", 1024)
    assert (model.n_threads, model.n_threads_batch, model.logits_all) == (3, 3, False)


def test_server_env_drops_what_overrides_the_flags():
    base = {"HOST": "0.0.0.0", "port": "1", "CONFIG_FILE": "x", "API_KEY": "k", "PATH": "/bin"}
    assert peer.server_env(base) == {"PATH": "/bin"}
    assert base["HOST"] == "0.0.0.0"


def test_server_threads_leave_a_core_for_the_load_generator():
    assert [peer.server_threads(n) for n in (1, 2, 16)] == [1, 1, 15]


def test_extra_request_body_bans_the_bundled_eos_and_the_repeat_penalty():
    from xllm_py.engine.tokenizer import Tokenizer

    eos = Tokenizer.from_dir(BUNDLED_MODEL_DIR)._tok.token_to_id("<|eos|>")
    body = peer.extra_request_body()
    assert body == {"repeat_penalty": 1.0, "logit_bias": {str(eos): -1e9}}
    json.dumps(body, allow_nan=False)  # plain JSON: no -inf
    assert peer.extra_request_body(ignore_eos=False) == {"repeat_penalty": 1.0}


def test_compare_tokens():
    assert peer.compare_tokens([1, 2, 3, 4], [1, 2, 9, 4]) == {
        "matching_prefix": 2,
        "identical_fraction": 0.75,
        "identical": False,
    }
    assert peer.compare_tokens([5, 6], [5, 6])["identical"]
    assert peer.compare_tokens([5, 6], [5])["identical_fraction"] == 0.5


def test_cli_help():
    proc = subprocess.run(
        [sys.executable, "-m", "perf.llama_cpp_peer", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "--max-tokens" in proc.stdout


# ---- with llama.cpp -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled_gguf(tmp_path_factory):
    return peer.convert(BUNDLED_MODEL_DIR, tmp_path_factory.mktemp("gguf"))


@needs_llama_cpp
def test_llama_cpp_decodes_the_bundled_model_as_we_do(bundled_gguf):
    """Real conversion, real llama.cpp: greedy continuations of held-out prompts agree with
    our engine (measured: identical over 8 prompts x 256 tokens), and llama.cpp tokenizes
    the prompt text to our ids."""
    prompts = peer.sharegpt_prompts(2)
    res = peer.greedy_agreement(bundled_gguf, BUNDLED_MODEL_DIR, prompts, 24, threads=2)
    assert res["prompts_tokenized_same"] == 1.0
    assert res["mean_identical_fraction"] >= 0.9, res["per_prompt"]
    assert res["max_chosen_logprob_diff"] < 0.05


@needs_llama_cpp
def test_llama_cpp_server_runs_to_max_tokens_with_the_extra_body(bundled_gguf, tmp_path):
    import httpx

    port = free_port()
    cmd = peer.server_command(bundled_gguf, port, 512, 1)
    with Daemon(cmd, port, tmp_path / "server.log", peer.READY_PATH, peer.server_env()) as server:
        url = server.url
        assert httpx.get(url + "/health").status_code == 404  # hence READY_PATH
        model = httpx.get(url + peer.READY_PATH).json()["data"][0]["id"]
        assert model == bundled_gguf.stem
        body = {"model": model, "prompt": "Hello", "max_tokens": 12, "temperature": 0}
        forced_eos = {"logit_bias": {str(peer.eos_token_id()): 100.0}}
        r = httpx.post(url + "/v1/completions", json={**body, **forced_eos}, timeout=120)
        assert r.json()["choices"][0]["finish_reason"] == "stop"  # logit_bias is applied
        r = httpx.post(
            url + "/v1/completions", json={**body, **peer.extra_request_body()}, timeout=120
        )
        out = r.json()
        assert out["choices"][0]["finish_reason"] == "length"
        assert out["usage"]["completion_tokens"] == 12
