"""The grammar compile child (structured/compiler.py starts it and says the protocol):
compile each spec read from stdin with the package's `compile_spec`, answer on the
original stdout."""

from __future__ import annotations

import json
import os
import sys

from xllm_py.sampling_params import StructuredOutput
from xllm_py.structured import compile_spec


def _serve() -> None:
    """The child: compile each spec read from stdin, answer on the original stdout."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints go to stderr
    import xgrammar as xgr

    compiler = None
    for line in sys.stdin:
        if not line.endswith("\n"):
            return  # the parent exited mid-message
        msg = json.loads(line)
        if "tokenizer_info" in msg:
            info = xgr.TokenizerInfo.deserialize_json(msg["tokenizer_info"])
            compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            answer = {"ready": True}
        else:
            so = StructuredOutput(msg["kind"], msg["spec"], msg["strict"])
            try:
                answer = {"grammar": compile_spec(compiler, so).serialize_json()}
            except ValueError as e:
                answer = {"error": str(e)}
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    _serve()
