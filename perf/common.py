"""What every perf script shares: its command line (one table of flags), the command string
and machine a result records, its JSON file, its tables, held-out chat prompts and closing
an in-process engine."""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "perf" / "results"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every flag's default after its help."""


def parser(doc: str, flags: list[tuple]) -> argparse.ArgumentParser:
    """A parser described by `doc` with one option per row of `flags`: (flag, type, default,
    help[, more add_argument keywords]). Type bool: a switch; a tuple of strings: the
    choices; a list default: one or more values."""
    p = argparse.ArgumentParser(description=doc, formatter_class=_HelpFormatter)
    for flag, kind, default, text, *more in flags:
        kw: dict = {"default": default, "help": text}
        if kind is bool:
            kw["action"] = "store_true"
        elif isinstance(kind, tuple):
            kw["choices"] = kind
        else:
            kw["type"] = kind
        if isinstance(default, list):
            kw["nargs"] = "+"
        p.add_argument(flag, **(kw | (more[0] if more else {})))
    return p


def command(name: str, argv: list[str] | None) -> str:
    """The command line of `python -m perf.<name>` run with `argv` (None: sys.argv's)."""
    return shlex.join(["python", "-m", f"perf.{name}", *(sys.argv[1:] if argv is None else argv)])


def machine() -> dict:
    """The machine and software a result was measured on, for the result JSON."""
    import torch

    info, mem = Path("/proc/cpuinfo"), Path("/proc/meminfo")
    lines = info.read_text().splitlines() if info.is_file() else []
    cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return {
        "cpu": cpu or platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "memory": f"{int(mem.read_text().split()[1]) / 2**20:.0f} GiB" if mem.is_file() else "",
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "git_commit": commit,
    }  # fmt: skip


def settings(args) -> dict:
    """The parsed flags, as JSON."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def http_client(timeout_s: float, **kw):
    """An httpx client with no connection cap whose idle connections expire after 3 s, before
    any server closes them (uvicorn's default keep-alive is 5 s): a request sent on a
    connection the server is closing at that moment fails with ReadError."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None,
                          keepalive_expiry=3.0)  # fmt: skip
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=60.0), **kw)


def write_json(path: Path | str, result: dict, announce: bool = True) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")  # a run killed mid-write keeps the last one
    partial.write_text(json.dumps(result, indent=1) + "\n")
    partial.replace(path)
    if announce:
        print(f"wrote {path}")


def md_table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def write_results(folder: Path, title: str, cmd: str, where: dict, note: str, table: str) -> str:
    """A sweep's results.md in `folder` (title, command, machine, what was run, the table),
    printed too; returns its text."""
    md = f"# {title}\n\n`{cmd}`\n\nMachine: {json.dumps(where)}\n\n{note}\n\n{table}\n"
    (folder / "results.md").write_text(md)
    print(md)
    return md


def print_block(title: str, rows: list[tuple], width: int = 72) -> None:
    """A summary as vLLM prints one: `label value` lines (floats to 2 decimals) under a
    title; a row (heading,) starts a section."""
    print(f" {title} ".center(width, "="))
    for label, *value in rows:
        if not value:
            print(f" {label} ".center(width, "-"))
        else:
            v = value[0]
            print(f"{label:<44} {f'{v:.2f}' if isinstance(v, float) else v}")
    print("=" * width)


def chat_prompts(tokenizer, n: int, min_chars: int, max_chars: int) -> list[str]:
    """n held-out ShareGPT first user turns (never trained on), in the chat template."""
    from xllm_py.sharegpt import held_out_user_turns

    return [
        tokenizer.apply_chat_template([{"role": "user", "content": t}])
        for t in held_out_user_turns(n, min_chars, max_chars)
    ]


def close(llm) -> None:
    """Shut an in-process engine down and give its memory back now."""
    import torch

    llm.engine.core.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
