#!/usr/bin/env python3
"""llama.cpp (through llama-cpp-python) as a peer engine for the serving sweep: the bundled
(or any DeepSeek-V3) checkpoint converted to an f32 GGUF by llama.cpp's own converter, served
by llama_cpp.server, and the greedy agreement of its tokens with ours.

    pip install -e .[llamacpp]            # compiles llama.cpp (about 20 min on 2 cores)
    python -m perf.llama_cpp_peer         # convert the bundled model, greedy agreement
    python -m perf.mtp_sweep --peer llama.cpp    # serve it and benchmark it beside ours

f32: bf16 weights convert exactly and our CPU engine runs float32, so both run the same
weights at the same precision. The converter drops the MTP layer (no speculation there).
llama_cpp.server runs one request at a time (concurrency > 1 measures queueing), ignores
`ignore_eos` and stream_options (bench_serving then re-tokenizes the text), and applies a
repeat penalty at temperature 0: hence `extra_request_body()`. ggml's threads spin, so it
gets all cores but one (`server_threads()`) and is timed on an otherwise idle machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from perf.common import RESULTS, chat_prompts, command, machine, parser, write_json

DIST = "llama-cpp-python"  # the PyPI distribution (module: llama_cpp)
READY_PATH = "/v1/models"  # llama_cpp.server has no /health
GGUF_OUTTYPE = "f32"
CACHE_DIR = Path(
    os.environ.get("XLLM_LLAMA_CPP_CACHE", Path.home() / ".cache" / "xllm_py" / "llama_cpp")
)
# What convert() needs from the llama.cpp source tree (paths under vendor/llama.cpp/ in
# the sdist): the script, the `conversion` package it imports (newer llama.cpp keeps the
# model classes there) and the matching gguf-py.
CONVERTER_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
# Environment variables llama_cpp.server reads over its command line (uvicorn's host and
# port, a config file replacing all flags) or that would make it demand a key.
SERVER_ENV_DROP = ("HOST", "PORT", "CONFIG_FILE", "API_KEY")


def shim_config(config: dict) -> tuple[dict, list[str]]:
    """`config` as llama.cpp's DeepSeek converter needs it, and what was changed
    (checked against llama-cpp-python 0.3.36's converter): num_key_value_heads must equal
    num_attention_heads (it splits kv_b_proj with it, and asserts); without scoring_func it
    routes DeepseekV3 by softmax instead of sigmoid. The bundled config needs neither."""
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
            try:
                target.symlink_to(f.resolve())
                continue
            except OSError:
                pass
        shutil.copyfile(f, target)
    cfg, changes = shim_config(json.loads((Path(model_dir) / "config.json").read_text()))
    (dest / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return changes


def installed_version() -> str | None:
    """llama-cpp-python's installed version, None when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(DIST)
    except metadata.PackageNotFoundError:
        return None


def _converter_member(name: str) -> str | None:
    """The path under vendor/llama.cpp/ of an sdist member convert() needs, else None."""
    parts = name.split("/", 1)  # <dist>-<version>/vendor/llama.cpp/...
    if len(parts) < 2 or not parts[1].startswith("vendor/llama.cpp/"):
        return None
    rel = parts[1][len("vendor/llama.cpp/") :]
    if ".." in Path(rel).parts or Path(rel).is_absolute():
        return None
    for want in CONVERTER_MEMBERS:
        if rel == want or (want.endswith("/") and rel.startswith(want)):
            return rel
    return None


def _extract_converter(sdist: Path, dest: Path) -> None:
    """The CONVERTER_MEMBERS of a llama-cpp-python sdist (plain files only) into dest."""
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            rel = _converter_member(m.name)
            if rel is None or not m.isfile():
                continue
            out = dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(m)
            assert src is not None
            with src, open(out, "wb") as f:
                shutil.copyfileobj(src, f)


def converter_dir(version: str | None = None, cache_dir: Path = CACHE_DIR) -> Path:
    """A folder with the convert_hf_to_gguf.py (and what it imports) of the installed
    llama-cpp-python's llama.cpp: $LLAMA_CPP_CONVERTER_DIR, else taken from its sdist
    (`pip download --no-binary`) into cache_dir/llama.cpp-<version>/."""
    if env := os.environ.get("LLAMA_CPP_CONVERTER_DIR"):
        return Path(env)
    version = version or installed_version()
    if version is None:
        raise RuntimeError(f"{DIST} is not installed: pip install -e .[llamacpp]")
    out = Path(cache_dir) / f"llama.cpp-{version}"
    if (out / "convert_hf_to_gguf.py").is_file():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"{DIST}=={version}", "-d", tmp, "--quiet"],
            check=True,
        )  # fmt: skip
        sdist = next(Path(tmp).glob("*.tar.gz"))
        partial = Path(cache_dir) / f".llama.cpp-{version}.{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        _extract_converter(sdist, partial)
        if not (partial / "convert_hf_to_gguf.py").is_file():
            raise RuntimeError(f"{sdist.name}: no vendor/llama.cpp/convert_hf_to_gguf.py")
        shutil.rmtree(out, ignore_errors=True)
        partial.rename(out)
    return out


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
    converter: Path, model_copy: Path, outfile: Path, outtype: str = GGUF_OUTTYPE, pre: str = ""
) -> list[str]:
    """The command converting `model_copy` to `outfile`; `pre`: the pre-tokenizer for an
    unrecognised tokenizer ("": none, the converter stops on one)."""
    path = os.pathsep.join(
        [str(converter), f"{converter}/gguf-py", os.environ.get("PYTHONPATH", "")]
    )
    return [
        "env", f"PYTHONPATH={path.rstrip(os.pathsep)}", sys.executable, "-c", _BOOTSTRAP,
        str(converter), pre, str(model_copy), "--outfile", str(outfile), "--outtype", outtype,
    ]  # fmt: skip


def _inputs(model_dir: Path) -> list[Path]:
    return [
        f
        for f in Path(model_dir).iterdir()
        if f.is_file() and (f.suffix == ".safetensors" or f.suffix == ".json")
    ]


def gguf_path(model_dir: Path, out_dir: Path, outtype: str = GGUF_OUTTYPE) -> Path:
    return Path(out_dir) / f"{Path(model_dir).resolve().name}.{outtype}.gguf"


def is_fresh(gguf: Path, model_dir: Path, version: str | None) -> bool:
    """The GGUF exists, is newer than every input file and was made by `version`."""
    stamp = gguf.with_suffix(".json")
    if not gguf.is_file() or not stamp.is_file():
        return False
    with contextlib.suppress(ValueError, OSError):
        if json.loads(stamp.read_text()).get("llama_cpp_python") != version:
            return False
        newest = max(f.stat().st_mtime for f in _inputs(model_dir))
        return gguf.stat().st_mtime > newest
    return False


def convert(
    model_dir: Path, out_dir: Path, outtype: str = GGUF_OUTTYPE, converter: Path | None = None
) -> Path:
    """`model_dir` as `out_dir`/<name>.<outtype>.gguf, converted from a shimmed temporary
    copy; cached (redone when an input is newer or llama-cpp-python's version changed). The
    <name>.<outtype>.json beside it records the converter version and the shims."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    version = installed_version()
    out = gguf_path(model_dir, out_dir, outtype)
    if is_fresh(out, model_dir, version):
        return out
    converter = converter or converter_dir(version)
    tok_file = model_dir / "tokenizer.json"
    pre = gguf_pre_tokenizer(json.loads(tok_file.read_text())) if tok_file.is_file() else None
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_name(out.name + ".tmp")
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / model_dir.resolve().name
        changes = prepare_model_copy(model_dir, copy)
        cmd = conversion_command(converter, copy, tmp_out, outtype, pre or "")
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not tmp_out.is_file():
        tmp_out.unlink(missing_ok=True)
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({proc.returncode}):\n{tail}")
    tmp_out.replace(out)
    used = "xllm_py shim: unrecognised" in proc.stderr
    stamp = {"model_dir": str(model_dir.resolve()), "outtype": outtype,
             "llama_cpp_python": version, "converter": str(converter),
             "config_changes": changes, "pre_tokenizer_fallback": pre,
             "pre_tokenizer_fallback_used": used}  # fmt: skip
    out.with_suffix(".json").write_text(json.dumps(stamp, indent=1) + "\n")
    return out


def server_command(
    gguf: Path, port: int, n_ctx: int, threads: int, python: str | None = None
) -> list[str]:
    """llama_cpp.server for `gguf` on 127.0.0.1:`port`, n_ctx tokens per sequence, model id
    the file's stem. interrupt_requests off: else a new request ends the streaming one with
    [DONE]; logits_all off: else it computes logits at every prompt position."""
    return [
        python or sys.executable, "-m", "llama_cpp.server",
        "--model", str(gguf),
        "--model_alias", Path(gguf).stem,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--n_ctx", str(n_ctx),
        "--n_threads", str(threads),
        "--n_threads_batch", str(threads),
        "--interrupt_requests", "False",
        "--logits_all", "False",
    ]  # fmt: skip


def server_threads(cpus: int | None = None) -> int:
    """All cores but one: ggml's threads spin, so every core backfires once anything else
    runs (2 cores, beside bench_serving: 8-9 ms per token with 2 threads, 3.3 ms with 1)."""
    cpus = cpus or os.cpu_count() or 1
    return max(1, cpus - 1)


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default os.environ) without what llama_cpp.server reads over its flags (HOST,
    PORT, CONFIG_FILE) or what makes it demand a key (API_KEY)."""
    env = dict(os.environ if base is None else base)
    for name in list(env):
        if name.upper() in SERVER_ENV_DROP:
            del env[name]
    return env


def eos_token_id(model_dir: Path | None = None) -> int:
    """The checkpoint's EOS id (config.json, else generation_config.json); the GGUF keeps
    the HF vocabulary's ids."""
    from xllm_py.assets import bundled_model

    d = Path(model_dir or bundled_model())
    for name in ("config.json", "generation_config.json"):
        f = d / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if isinstance(eos, list):
                eos = eos[0] if eos else None
            if eos is not None:
                return int(eos)
    raise ValueError(f"{d}: no eos_token_id in config.json or generation_config.json")


def extra_request_body(model_dir: Path | None = None, ignore_eos: bool = True) -> dict[str, Any]:
    """Fields for every request to llama_cpp.server: repeat_penalty 1.0 (its default 1.1
    applies before the greedy pick), and with ignore_eos (which it ignores) a logit_bias
    that never lets EOS be picked, so every request runs to max_tokens."""
    body: dict[str, Any] = {"repeat_penalty": 1.0}
    if ignore_eos:
        body["logit_bias"] = {str(eos_token_id(model_dir)): -1e9}
    return body


def sharegpt_prompts(n: int, model_dir: Path | None = None) -> list[str]:
    """n held-out ShareGPT turns (20-600 characters) in the checkpoint's chat template."""
    from xllm_py.assets import bundled_model
    from xllm_py.engine.tokenizer import Tokenizer

    return chat_prompts(Tokenizer.from_dir(model_dir or bundled_model()), n, 20, 600)


def compare_tokens(ours: list[int], theirs: list[int]) -> dict[str, Any]:
    """Matching prefix and fraction of positions with the same token (of the longer)."""
    prefix = 0
    for a, b in zip(ours, theirs):
        if a != b:
            break
        prefix += 1
    n = max(len(ours), len(theirs))
    same = sum(a == b for a, b in zip(ours, theirs))
    return {
        "matching_prefix": prefix, "identical_fraction": same / n if n else 1.0,
        "identical": ours == theirs,
    }  # fmt: skip


def _log_softmax(x):
    import numpy as np

    x = np.asarray(x, dtype=np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def _last_logits(llm):
    import llama_cpp
    import numpy as np

    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)  # Llama.scores stays 0 without logits_all
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).astype(np.float32)


def llama_greedy(llm, ids: list[int], max_tokens: int) -> tuple[list[int], list, float, float]:
    """Greedy continuation (argmax, EOS not special) of `ids` by a llama_cpp.Llama:
    (tokens, per-step logits, prefill seconds, decode seconds after the first token)."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    out, logits = [], []
    for i in range(max_tokens):
        row = _last_logits(llm)
        tok = int(row.argmax())
        out.append(tok)
        logits.append(row)
        if i + 1 < max_tokens:
            llm.eval([tok])
    return out, logits, t1 - t0, time.perf_counter() - t1


def greedy_agreement(
    gguf: Path,
    model_dir: Path,
    prompts: list[str],
    max_tokens: int,
    threads: int | None = None,
    max_cache_size: int = 64 << 20,
) -> dict[str, Any]:
    """Greedy continuations (EOS ignored) of `prompts` by llama.cpp on `gguf` (in-process)
    and by our engine on `model_dir` from the same token ids, compared: per prompt the
    matching prefix, identical fraction, the largest gap between the two engines' logprobs
    of the tokens both chose, and whether llama.cpp tokenizes the text to the same ids;
    overall means and both engines' single-stream tokens/s."""
    import llama_cpp
    import numpy as np

    from xllm_py.entrypoints.llm import LLM
    from xllm_py.sampling_params import SamplingParams

    threads = threads or server_threads()
    ours_llm = LLM(str(model_dir), dtype="float32", max_cache_size=max_cache_size)
    tok = ours_llm.get_tokenizer()
    prompt_ids = [tok.encode(p) for p in prompts]
    n_ctx = max(len(ids) for ids in prompt_ids) + max_tokens + 8
    llm = llama_cpp.Llama(
        model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
        logits_all=False, verbose=False,
    )  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    rows = []
    ours_s = theirs_s = 0.0
    for text, ids in zip(prompts, prompt_ids):
        t0 = time.perf_counter()
        res = ours_llm.generate({"prompt_token_ids": ids}, sp)[0].outputs[0]
        ours_s += time.perf_counter() - t0
        theirs, logits, _, decode_s = llama_greedy(llm, ids, max_tokens)
        theirs_s += decode_s
        row = {"prompt_tokens": len(ids), **compare_tokens(res.token_ids, theirs)}
        row["llama_tokenizes_prompt_same"] = (
            llm.tokenize(text.encode(), add_bos=False, special=True) == ids
        )
        k = row["matching_prefix"]
        if res.logprobs:  # the chosen tokens' logprobs, ours vs llama.cpp's, where both agree
            diffs = [
                abs(res.logprobs[i][t] - float(_log_softmax(logits[i])[t]))
                for i, t in enumerate(res.token_ids[:k])
            ]
            row["max_chosen_logprob_diff"] = max(diffs, default=0.0)
        row["ours_text"] = tok.decode(res.token_ids)
        row["llama_cpp_text"] = tok.decode(theirs)
        rows.append(row)
    with contextlib.suppress(AttributeError):
        llm.close()  # frees the model and its context now, not at garbage collection
    total = max_tokens * len(rows)
    return {
        "num_prompts": len(rows),
        "max_tokens": max_tokens,
        "mean_identical_fraction": float(np.mean([r["identical_fraction"] for r in rows])),
        "prompts_identical": sum(r["identical"] for r in rows) / len(rows),
        "prefix_agreement": sum(r["matching_prefix"] for r in rows) / total,
        "prompts_tokenized_same": sum(r["llama_tokenizes_prompt_same"] for r in rows) / len(rows),
        "max_chosen_logprob_diff": max(r.get("max_chosen_logprob_diff", 0.0) for r in rows),
        # single stream, in-process; llama.cpp: decode only (prefill excluded); ours: the
        # whole generate call (prefill included, logprobs on), so a lower bound
        "llama_cpp_decode_tok_s": (max_tokens - 1) * len(rows) / theirs_s,
        "ours_tok_s_incl_prefill": total / ours_s,
        "threads": threads,
        "per_prompt": rows,
    }


FLAGS = [  # (flag, type, default, help)
    ("--model-dir", Path, None, "checkpoint (None: the bundled model)"),
    ("--out-dir", Path, CACHE_DIR / "gguf", "GGUF cache"),
    ("--num-prompts", int, 8, "held-out prompts"),
    ("--max-tokens", int, 128, "greedy tokens per prompt"),
    ("--threads", int, server_threads(), "llama.cpp's threads"),
    ("--output", Path, RESULTS / "llama_cpp_peer.json", "result JSON"),
]  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Convert a checkpoint to GGUF and measure its greedy agreement with our engine."""
    from xllm_py.assets import bundled_model

    args = parser(__doc__, FLAGS).parse_args(argv)
    model_dir = args.model_dir or Path(bundled_model())
    load_at_start = os.getloadavg()[0]  # ggml's spinning threads need an idle machine
    gguf = convert(model_dir, args.out_dir)
    stamp = json.loads(gguf.with_suffix(".json").read_text())
    print(f"GGUF: {gguf} ({gguf.stat().st_size / 2**20:.1f} MiB)")
    prompts = sharegpt_prompts(args.num_prompts, model_dir)
    agree = greedy_agreement(gguf, model_dir, prompts, args.max_tokens, args.threads)
    for i, r in enumerate(agree["per_prompt"]):
        print(
            f"  prompt {i}: {r['prompt_tokens']:4d} prompt tokens, matching prefix "
            f"{r['matching_prefix']:3d}, identical {100 * r['identical_fraction']:5.1f}%"
        )
    print(f"mean identical tokens {100 * agree['mean_identical_fraction']:.1f}%, prompts "
          f"identical {100 * agree['prompts_identical']:.0f}%, prefix agreement "
          f"{100 * agree['prefix_agreement']:.1f}%, prompts tokenized the same "
          f"{100 * agree['prompts_tokenized_same']:.0f}%; single stream: llama.cpp decode "
          f"{agree['llama_cpp_decode_tok_s']:.0f} tok/s, ours "
          f"{agree['ours_tok_s_incl_prefill']:.0f} tok/s incl. prefill")  # fmt: skip
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": command("llama_cpp_peer", argv), "machine": machine(),
              "loadavg_1min_at_start": load_at_start,
              "gguf": {**stamp, "file": gguf.name, "bytes": gguf.stat().st_size},
              "agreement": agree}  # fmt: skip
    write_json(args.output, result)
    return result


if __name__ == "__main__":
    main()
