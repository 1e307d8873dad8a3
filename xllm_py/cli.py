"""The `xllm` command.

The OpenAI-compatible REST daemon (xLLM-style flags: --model, --devices,
--port, --num_speculative_tokens, ...) is not implemented yet; until it is,
this command says so and exits non-zero. Use the offline API meanwhile:
`from xllm_py import LLM, SamplingParams`.
"""

from __future__ import annotations

import argparse
import sys

NOT_YET = (
    "xllm: the REST serving daemon is not implemented yet (it is the next milestone).\n"
    "Use the offline API meanwhile:\n"
    "    from xllm_py import LLM, SamplingParams\n"
    "    LLM(model=PATH).generate(prompts, SamplingParams(max_tokens=64))"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="xllm",
        description="Serve a DeepSeek-V3-family model with MTP speculative decoding (not yet: "
        "the REST daemon is the next milestone; this command only reports that).",
    )
    parser.add_argument(
        "command",
        nargs="?",
        default="serve",
        choices=["serve"],
        help="what to run (only 'serve', which is not implemented yet)",
    )
    parser.parse_args(argv)
    print(NOT_YET, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
