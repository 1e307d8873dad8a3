"""DeepSeek-V3 (and V2 layout) causal LM.

    h_0 = embed(input_ids)
    for each layer i:
        h = h + MLA(norm(h))                  # attention over the paged latent cache
        h = h + (MoE if i >= first_k_dense_replace else MLP)(norm(h))
    hidden = norm(h)                          # returned: the MTP draft needs it
    logits = lm_head(hidden[rows to sample])  # only where a token is sampled; float32

Each `h = h + ...` and the norm after it run as one fused add + RMSNorm kernel with
--attention_backend=triton (ops/rms_norm.py), so a layer hands the next one its output
un-added (`DecoderLayer.forward`).

Parameter names mirror the checkpoint, so loading is a name-for-name copy;
`process_weights_after_loading` then fuses and re-lays weights for speed.
The model knows nothing of requests or blocks: the batch layout arrives
through `models.context`.

Tensor/expert parallelism (`parallel`, parallel/context.py) lives in the
layers' sharded linears and the MoE; the embedding and lm_head are split along
the vocabulary (models/layers/vocab_parallel.py: an all-reduced lookup, gathered
logits) and the final norm is replicated, so every rank returns the same hidden
states and the same full logits.
"""

from __future__ import annotations

import torch
from torch import nn

from xllm_py.config import ModelConfig
from xllm_py.models.layers.mla import MLAttention
from xllm_py.models.layers.mlp import MLP
from xllm_py.models.layers.moe import MoE
from xllm_py.models.layers.norm import RMSNorm
from xllm_py.models.layers.rope import RotaryEmbedding, llama_4_query_scale
from xllm_py.models.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from xllm_py.parallel.context import SINGLE, ParallelContext


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        cache_index: int | None = None,
        parallel: ParallelContext = SINGLE,
    ) -> None:
        super().__init__()
        cache_index = layer_idx if cache_index is None else cache_index
        self.self_attn = MLAttention(cfg, cache_index, parallel)
        self.mlp = (
            MoE(cfg, parallel)
            if cfg.is_moe_layer(layer_idx)
            else MLP(cfg.hidden_size, cfg.intermediate_size, parallel)
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        rope: torch.Tensor,
        delta: torch.Tensor | None = None,
        q_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, hidden]: the residual stream; delta: the previous layer's output, not yet
        added to h (None for the first layer); q_scale [T]: the queries' position-dependent
        scale (Llama-4 scaling, Mistral Large 3), None without. Returns (h, delta)
        likewise, this layer's MLP output left for whichever norm comes next to add: every
        add is then followed by a norm (`add_and_norm`: one kernel with the Triton kernels;
        with the torch ones the same adds and norms, in the same order, as the picture at the
        top of this file)."""
        if delta is None:
            x = self.input_layernorm(h)
        else:
            x, h = self.input_layernorm.add_and_norm(delta, h)
        x, h = self.post_attention_layernorm.add_and_norm(self.self_attn(x, rope, q_scale), h)
        return h, self.mlp(x)


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        # This rank's vocabulary rows; lookups are all-reduced (vocab_parallel.py).
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, parallel=parallel) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV3ForCausalLM(nn.Module):
    """`parallel`: this process's place in its tensor/expert-parallel replica (default: one
    process, nothing split). The embedding and lm_head hold vocab_size / tp_size rows each;
    `compute_logits` gathers the ranks' slices, so every rank gets the same full logits."""

    def __init__(self, cfg: ModelConfig, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.parallel = parallel
        self.model = DeepseekV3Model(cfg, parallel)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, parallel)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim, cfg.max_position_embeddings)

    @property
    def num_cache_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def cache_dims(self) -> list[int]:
        """Numbers per token of each layer's cache row: the latent (and V3.2's indexer key)."""
        return [self.config.kv_cache_dim] * self.num_cache_layers

    def process_weights_after_loading(self) -> None:
        process_tree(self)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states after the final norm [T, hidden]."""
        rope, q_scale = self.rotary(positions), self.query_scale(positions)
        h, delta = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            h, delta = layer(h, rope, delta, q_scale)
        return self.model.norm.add_and_norm(delta, h)[0]

    def query_scale(self, positions: torch.Tensor) -> torch.Tensor | None:
        """[T] float32: Llama-4's query scale per position, or None when the config has none."""
        l4 = self.config.llama_4_scaling
        return None if l4 is None else llama_4_query_scale(positions, *l4)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab], the same on every rank (under
        tensor parallelism a collective: every rank of the replica calls it)."""
        return self.lm_head(hidden, torch.float32)


def process_tree(module: nn.Module) -> None:
    """Parents first, then whatever children they kept: a parent that fuses its children's
    weights deletes them, and deleted modules are not visited."""
    for child in list(module.children()):
        if hasattr(child, "process_weights_after_loading"):
            child.process_weights_after_loading()
        process_tree(child)
