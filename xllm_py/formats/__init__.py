"""The model families' output and prompt formats, below the HTTP layer and usable offline:

    tool_parser.py     tool calls read whole or streamed, one incremental reader per
                       `--tool_call_parser` format, and the grammars that force them
    dsml.py            DeepSeek-V3.2's and V4's DSML tool calls (the reader and grammar)
    reasoning.py       the reasoning split (`--reasoning_parser`)
    encodings.py       the prompt rules that have no Jinja template (`--chat_template`):
    encoding_dsv32.py    DeepSeek-V3.2's
    encoding_dsv4.py     DeepSeek-V4's

They import nothing of the engine: only text in, text (or calls) out, and the grammars
structured/ compiles.
"""
