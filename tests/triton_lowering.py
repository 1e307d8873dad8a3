"""Lower Triton kernels to Triton IR for a Hopper target on a machine without a GPU.

The interpreter (TRITON_INTERPRET=1) runs a kernel's arithmetic but skips the compiler's
type checks, so a kernel can pass every CPU test and still fail to build on a GPU. This
runs the compiler's front end (Python AST to TTIR, where those checks live) for sm_90 with
the argument types a launcher would pass: what the engine's launches pass, and what
Inductor passes when a kernel runs inside a compiled graph (a Python float as fp64).

The front end needs Triton's compiled (not interpreted) language functions, which a
process with TRITON_INTERPRET=1 does not have: `lower_in_subprocess` runs the cases in
a fresh process with the interpreter off (`python -m tests.triton_lowering`, JSON on
stdin and stdout).
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys

# A lowering case: (module, kernel name, {arg: Triton type, 'i32' where not named},
# {constexpr: value}).
Case = tuple[str, str, dict[str, str], dict]


def lower_in_subprocess(cases: dict[str, Case]) -> dict[str, str]:
    """Each case's TTIR text, or 'CompilationError: ...' where the front end rejects it."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run(
        [sys.executable, "-m", "tests.triton_lowering"],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    return json.loads(done.stdout)


def lower_for_hopper(kernel, types: dict[str, str], constexprs: dict) -> str:
    """TTIR text of `kernel` (a triton.jit function) for sm_90."""
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.code_generator import ast_to_ttir

    names = list(inspect.signature(kernel.fn).parameters)
    unknown = (set(types) | set(constexprs)) - set(names)
    assert not unknown, f"{kernel.fn.__name__} has no argument(s) {sorted(unknown)}"
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    src = ASTSource(
        kernel, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()}
    )
    backend = triton.compiler.make_backend(GPUTarget("cuda", 90, 32))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    options = backend.parse_options({})
    module = ast_to_ttir(
        kernel,
        src,
        context=context,
        options=options,
        codegen_fns=backend.get_codegen_implementation(options),
        module_map=backend.get_module_map(),
    )
    return str(module)


def main() -> None:
    from triton.compiler.errors import CompilationError

    out = {}
    for name, (module, kernel, types, constexprs) in json.load(sys.stdin).items():
        fn = getattr(importlib.import_module(module), kernel)
        try:
            out[name] = lower_for_hopper(fn, types, constexprs)
        except CompilationError as e:
            out[name] = f"CompilationError: {e}"
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()


# Lowers fused-MoE's two kernels with packed weights (ops/fused_moe.py) for sm_90, in bf16
# and fp32, and prints, per kernel and dtype, whether the IR holds each marker (e.g.
# "tt.reshape": the tile unpacked; "tt.dot": multiplied). The DOT constexpr is a Triton
# dtype, which the JSON cases above cannot carry, hence a script.
_PACKED_MOE = """
import json
import triton.language as tl
from tests.triton_lowering import lower_for_hopper
from xllm_py.ops import fused_moe
out = {}
for name, block_n in (("_gate_up_kernel", 64), ("_down_kernel", 128)):
    kernel = getattr(fused_moe, name)
    for dtype, dot in (("bf16", tl.bfloat16), ("fp32", tl.float32)):
        types = {n: "*" + dtype for n in kernel.arg_names if n.endswith("_ptr")}
        types |= {"w_ptr": W_TYPE, "ws_ptr": WS_TYPE, "rows_ptr": "*i32",
                  "sorted_ptr": "*i32", "expert_ptr": "*i32"}
        constexprs = dict(FP8=False, INT4=INT4, DOT=dot, GROUP_K=32, BLOCK_M=16,
                          BLOCK_N=block_n, BLOCK_K=64,
                          PRECISION="ieee" if dtype == "fp32" else None)
        if "LIMIT" in kernel.arg_names:  # gate/up: with DeepSeek-V4's swiglu clamp
            constexprs["LIMIT"] = 10.0
        ir = lower_for_hopper(kernel, types, constexprs)
        out[name + "-" + dtype] = [m in ir for m in MARKERS]
print(json.dumps(out))
"""


def lower_packed_moe(w_type: str, ws_type: str, int4: bool, markers: list[str]) -> dict:
    """{kernel-dtype: [whether its IR holds each marker]} for fused-MoE's kernels with
    weights of Triton type `w_type` and scales of `ws_type`, in a process without the
    interpreter."""
    script = (
        f"W_TYPE, WS_TYPE, INT4, MARKERS = {w_type!r}, {ws_type!r}, {int4!r}, {markers!r}"
        + _PACKED_MOE
    )
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, cwd=root, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
