"""xllm-py: a serving daemon for DeepSeek-V3-family models with MTP speculative decoding."""

from xllm_py.engine.outputs import CompletionOutput, RequestOutput
from xllm_py.entrypoints.llm import LLM
from xllm_py.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
