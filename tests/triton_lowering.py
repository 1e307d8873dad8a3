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
