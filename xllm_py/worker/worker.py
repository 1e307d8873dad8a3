"""One worker per device: loads the model, sizes and allocates the KV cache,
runs steps. The in-process executor calls it directly; a remote rank's gRPC
service (cluster/worker_node.py) calls the same methods."""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import mmap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from xllm_py.config import V4_DRAFT_PREFIX, EngineConfig, ModelConfig
from xllm_py.executor.messages import ModelRunnerOutput, SchedulerOutput
from xllm_py.models.attention_layout import RequestLayout, build_context
from xllm_py.models.context import forward_context
from xllm_py.models.deepseek_mtp import (
    DeepseekV3MTP,
    check_shared_copy,
    draft_name_map,
    read_draft_config,
)
from xllm_py.models.deepseek_v3 import DeepseekV3ForCausalLM
from xllm_py.models.deepseek_v4 import DeepseekV4ForCausalLM, V4Config
from xllm_py.models.deepseek_v4_mtp import DeepseekV4MTP
from xllm_py.ops.backends import install as install_kernels
from xllm_py.ops.backends import select_kernels
from xllm_py.ops.fp8_gemm import fp8_gemm_available
from xllm_py.parallel.context import SINGLE, ParallelContext
from xllm_py.speculative.hot_vocab import (
    HotVocabHead,
    draft_vocab_size,
    load_token_map,
    token_map_path,
)
from xllm_py.speculative.mtp_proposer import MTPProposer, graph_q_lens
from xllm_py.weights.fp4 import fp4_resident
from xllm_py.weights.fp8 import Fp8Config, fp8_resident
from xllm_py.weights.int4 import int4_resident
from xllm_py.weights.loader import Checkpoint, layer_index, load_weights
from xllm_py.worker.draft_sampler import DraftSampler
from xllm_py.worker.graph_runner import GraphRunner
from xllm_py.worker.model_runner import ModelRunner
from xllm_py.worker.row_sampling import RowSampling
from xllm_py.worker.sampler import Sampler

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def resident_fp8_block(config: EngineConfig, device: torch.device) -> tuple[int, int] | None:
    """The FP8 block size when this worker keeps the checkpoint's FP8 weights resident
    (--weight_dtype, config.py), None when it dequantises them at load (or has none)."""
    fp8 = Fp8Config.from_quantization_config(config.model.quantization_config)
    choice = config.device.weight_dtype
    if fp8 is not None and config.model.is_v4:  # V4's linears: dequantised (config.py)
        logger.info("FP8 checkpoint: weights dequantised at load")
        return None
    if fp8 is None:
        if choice == "fp8":
            raise ValueError(
                "weight_dtype=fp8: the checkpoint is not FP8-quantised (its config.json has no "
                "quantization_config)"
            )
        return None
    if choice == "auto":
        choice = "fp8" if not config.device.enable_graph and fp8_gemm_available(device) else ""
    logger.info(
        "FP8 checkpoint: weights %s",
        f"kept FP8-resident ({fp8.block[0]}x{fp8.block[1]} block scales)"
        if choice == "fp8"
        else "dequantised at load",
    )
    return fp8.block if choice == "fp8" else None


def resident_int4_group(config: EngineConfig, device: torch.device, ckpt: Checkpoint) -> int | None:
    """The INT4 group size when this worker keeps the checkpoint's INT4 routed experts
    packed (--weight_dtype int4; auto: on CUDA with graph mode off, where the fused MoE
    kernels unpack tile by tile), None when it dequantises them at load (or has none). On
    CPU auto dequantises, as it does FP8: there each matmul would unpack a whole expert
    in torch."""
    choice = config.device.weight_dtype
    if not ckpt.int4:
        if choice == "int4":
            raise ValueError(
                "weight_dtype=int4: the checkpoint has no INT4 pack-quantized tensors "
                "(*.weight_packed; compressed-tensors' format, as Kimi-K2-Thinking ships); "
                "use weight_dtype=auto"
            )
        return None
    if choice == "auto":
        choice = "int4" if not config.device.enable_graph and device.type == "cuda" else ""
    logger.info(
        "INT4 checkpoint: %d tensors %s",
        len(ckpt.int4),
        f"kept packed (group {ckpt.int4_group} scales)"
        if choice == "int4"
        else "dequantised at load",
    )
    return ckpt.int4_group if choice == "int4" else None


def resident_fp4(config: EngineConfig, ckpt: Checkpoint) -> bool:
    """Whether the DeepSeek-V4 checkpoint's FP4 routed experts stay packed (--weight_dtype
    fp4); otherwise, as every other quantised V4 weight, they are dequantised at load. (An
    exported draft holds none: tools/export_deepseek_mtp.py dequantised them.)"""
    packed = config.device.weight_dtype == "fp4" and bool(ckpt.fp4)
    if ckpt.fp4:
        held = "kept packed" if packed else "dequantised at load"
        logger.info("FP4 experts: %d tensors %s", len(ckpt.fp4), held)
    return packed


def load_target_model(
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    parallel: ParallelContext = SINGLE,
):
    """The target model, holding this rank's shard (`parallel`; default: all of it)."""
    mcfg = config.model
    ckpt = Checkpoint(mcfg.path, Fp8Config.from_quantization_config(mcfg.quantization_config))
    block, group = resident_fp8_block(config, device), resident_int4_group(config, device, ckpt)
    with (
        default_dtype(dtype),
        torch.device(device),
        fp8_resident(block),
        int4_resident(group),
        fp4_resident(resident_fp4(config, ckpt)),
    ):
        model = build_target(mcfg, parallel)
    n = mcfg.num_hidden_layers

    def target_only(name: str) -> str | None:  # layers >= num_hidden_layers are the MTP draft's
        if mcfg.is_v4 and name.startswith(V4_DRAFT_PREFIX):  # V4's draft module (config.py)
            return None
        i = layer_index(name)
        return None if i is not None and i >= n else name

    stats = load_weights(model, ckpt, target_only)
    logger.info("target weights: %s", stats)
    model.process_weights_after_loading()
    return model.eval()


def build_target(mcfg: ModelConfig, parallel: ParallelContext = SINGLE):
    """The target model of the config's architecture: DeepSeek-V4 is its own model (its
    architecture read from config.json), V2 / V3 / V3.2 one model configured by `mcfg`."""
    if mcfg.is_v4:
        return DeepseekV4ForCausalLM(V4Config.from_dict(mcfg.raw), parallel)
    return DeepseekV3ForCausalLM(mcfg, parallel)


def load_draft_model(
    config: EngineConfig,
    target: DeepseekV3ForCausalLM,
    draft_path: str | None,
    device: torch.device,
    dtype: torch.dtype,
    parallel: ParallelContext | None = None,
) -> DeepseekV3MTP:
    """The MTP draft from an exported directory, or (draft_path None) from the target's own
    checkpoint. Its copies of the embedding and head are checked equal to the target's and
    dropped: the draft uses the target's in memory. Sharded like the target unless
    `parallel` says otherwise."""
    mcfg = config.model
    if draft_path:
        num_mtp = read_draft_config(draft_path, mcfg)
        ckpt = Checkpoint(draft_path)
    else:
        num_mtp = mcfg.num_nextn_predict_layers
        ckpt = Checkpoint(mcfg.path, Fp8Config.from_quantization_config(mcfg.quantization_config))
    k = config.spec.num_speculative_tokens
    if num_mtp > 1 and k > num_mtp:
        raise ValueError(
            f"num_speculative_tokens={k}: the draft has {num_mtp} MTP layers, and drafting past "
            f"the last one is supported only with a single MTP layer; use at most {num_mtp}"
        )
    if mcfg.is_v4:
        with fp4_resident(resident_fp4(config, ckpt)):
            return load_v4_draft(ckpt, target, num_mtp, device, dtype)
    # An exported draft is dequantised (tools/export_deepseek_mtp.py); the MTP layer in an
    # FP8 or INT4 checkpoint is held like the target's layers.
    block = None if draft_path else resident_fp8_block(config, device)
    group = None if draft_path else resident_int4_group(config, device, ckpt)
    with default_dtype(dtype), torch.device(device), fp8_resident(block), int4_resident(group):
        draft = DeepseekV3MTP(mcfg, target, num_mtp, parallel)
    mapping = draft_name_map(ckpt.names, mcfg.num_hidden_layers, num_mtp, exported=bool(draft_path))
    stats = load_weights(
        draft,
        ckpt,
        lambda name: None if isinstance(mapping[name], tuple) else mapping[name],
        desc="loading the MTP draft",
    )
    logger.info("MTP draft weights: %s", stats)
    target_state = target.state_dict(keep_vars=True)  # with their `shard`: a vocab slice
    shared = [n for n, m in mapping.items() if isinstance(m, tuple)]
    for name, tensor in ckpt.tensors(shared, desc="checking shared tensors"):
        check_shared_copy(name, tensor, target_state[mapping[name][1]])
    draft.process_weights_after_loading()
    return draft.eval()


def load_v4_draft(
    ckpt: Checkpoint, target: DeepseekV4ForCausalLM, num_mtp: int, device: torch.device, dtype
) -> DeepseekV4MTP:
    """DeepSeek-V4's MTP layer(s), the target checkpoint's `mtp.*` tensors (config.py has
    checked that they are MTP layers, not DSpark's drafter)."""
    with default_dtype(dtype), torch.device(device):
        draft = DeepseekV4MTP(target.config, target, num_mtp)
    stats = load_weights(
        draft,
        ckpt,
        lambda name: name if name.startswith(V4_DRAFT_PREFIX) else None,
        desc="loading the MTP draft",
    )
    logger.info("MTP draft weights: %s", stats)
    draft.process_weights_after_loading()
    return draft.eval()


def memory_split(total: int, in_use: int, utilization: float) -> int:
    """KV cache bytes under vLLM's meaning of --max_memory_utilization: this process may use
    `utilization` of the device's `total` memory, and `in_use` bytes of that are taken
    (weights, buffers, the runtime's context)."""
    allowed = int(total * utilization)
    if allowed <= in_use:
        raise ValueError(
            f"--max_memory_utilization={utilization:g}: {utilization:g} x {total / 2**30:.1f} "
            f"GiB = {allowed / 2**30:.1f} GiB, but {in_use / 2**30:.1f} GiB are in use after "
            "loading; nothing is left for the KV cache (raise it, or shard over more devices)"
        )
    return allowed - in_use


def kv_cache_budget(device: torch.device, utilization: float, activations: int = 0) -> int:
    """Bytes for the KV cache. On an accelerator, `memory_split` of its total memory, with
    what is in use on it now plus the `activations` peak of the largest step taken off. On
    CPU, `utilization` of the RAM still available (it is shared with the host)."""
    if device.type == "cpu":
        return int(available_memory(device) * utilization)
    # What an earlier engine of this process freed still sits in torch's caching allocator,
    # which the device counts as in use: a second LLM in one process would find no room.
    gc.collect()
    accelerator(device).empty_cache()
    free, total = device_memory(device)
    return memory_split(total, total - free + activations, utilization)


def accelerator(device: torch.device):
    """torch.cuda or torch.npu (torch_npu registers the latter when imported)."""
    if device.type == "npu":
        import torch_npu  # noqa: F401

        return torch.npu  # type: ignore[attr-defined]
    return torch.cuda


def bind_device(device: torch.device) -> None:
    """Make `device` the calling thread's current accelerator: the current device is per
    thread, and steps arrive on threads other than the one that built the worker."""
    if device.type != "cpu":
        mem = accelerator(device)
        if mem.current_device() != device.index:
            mem.set_device(device)


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a GPU or NPU."""
    return accelerator(device).mem_get_info(device)


def available_memory(device: torch.device) -> int:
    if device.type != "cpu":
        return device_memory(device)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def target_q_lens(spec) -> tuple[int, ...]:
    """The query lengths the target's graphs take: one row per request without MTP, 1 + k
    for the verification of k drafts. Adaptive speculation verifies any number up to k, so
    each of those lengths gets its graphs; the confidence policy and
    speculative_disable_batch_size run steps without drafts (one row). With neither, every
    decode step verifies drafts, and one whose requests have fewer (max_tokens near, a
    grammar refusing a draft) pads into the 1 + k graph: a one-row graph would be compiled
    for steps that almost never come."""
    k = spec.num_speculative_tokens
    if not k:
        return (1,)
    if spec.adaptive:
        return tuple(range(1, k + 2))
    if not spec.confidence_scheduled and not spec.speculative_disable_batch_size:
        return (1 + k,)
    return (1, 1 + k)


class Worker:
    def __init__(self, config: EngineConfig, parallel: ParallelContext = SINGLE) -> None:
        """`parallel`: this rank's place in its replica (tensor/expert parallel); the draft
        is sharded the same way on the same rank."""
        self.config = config
        self.parallel = parallel
        self.device = torch.device(config.device.device)
        self.dtype = config.device.torch_dtype()
        bind_device(self.device)
        self.kernels = select_kernels(config.device)  # before loading: a bad flag fails fast
        self.model = load_target_model(config, self.device, self.dtype, parallel)
        install_kernels(self.model, self.kernels)
        self.draft: DeepseekV3MTP | DeepseekV4MTP | None = None
        if config.spec.num_speculative_tokens:
            self.draft = load_draft_model(
                config, self.model, config.spec.draft_model, self.device, self.dtype
            )
            install_kernels(self.draft, self.kernels)
        self.runner: ModelRunner | None = None
        self._compiler: threading.Thread | None = None  # graph mode's background compile

    @property
    def cache_dims(self) -> list[int]:
        """Numbers cached per token in each cache layer: the target's layers (its
        `cache_dims`), then the draft's MTP layers (a latent cache each)."""
        return list(self.model.cache_dims) + (self.draft.cache_dims if self.draft else [])

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.config.cache.block_size * sum(self.cache_dims) * elem

    def determine_num_blocks(self) -> int:
        """Blocks that fit in --max_cache_size bytes, or in what --max_memory_utilization
        leaves after loading the model and, on an accelerator, after the activation peak of
        the largest step (`profile_activations`; the ranks of a tensor-parallel replica
        must call this together: the profiling forward all-reduces). On CPU, never more
        than running requests can use at once (max_seqs_per_batch full-length sequences):
        RAM is shared with the host."""
        cache = self.config.cache
        if cache.max_cache_size:
            return int(cache.max_cache_size // self.bytes_per_block)
        if self.device.type == "cpu":
            budget = kv_cache_budget(self.device, cache.max_memory_utilization)
            cap = self.config.scheduler.max_seqs_per_batch * self.config.max_blocks_per_seq
            return int(min(budget // self.bytes_per_block, cap))
        peak = self.profile_activations()
        budget = kv_cache_budget(self.device, cache.max_memory_utilization, peak)
        free, total = device_memory(self.device)
        logger.info(
            "memory: %.2f of %.1f GiB for this process: %.1f GiB in use after loading, "
            "%.2f GiB activation peak, %.1f GiB for the KV cache",
            cache.max_memory_utilization,
            total / 2**30,
            (total - free) / 2**30,
            peak / 2**30,
            budget / 2**30,
        )
        return int(budget // self.bytes_per_block)

    def profile_activations(self) -> int:
        """Peak bytes the largest step allocates on top of what is resident: one forward
        (`profile_forward`) measured with the accelerator's allocator statistics."""
        mem = accelerator(self.device)
        tokens = min(self.config.scheduler.max_tokens_per_batch, self.config.max_model_len)
        caches = self._scratch_caches(tokens)  # resident, so not part of the peak
        mem.synchronize(self.device)
        mem.reset_peak_memory_stats(self.device)
        before = mem.memory_allocated(self.device)
        self.profile_forward(tokens, caches)
        mem.synchronize(self.device)
        peak = mem.max_memory_allocated(self.device) - before
        del caches
        mem.empty_cache()
        return peak

    def _scratch_caches(self, tokens: int) -> list[torch.Tensor]:
        bs = self.config.cache.block_size
        blocks = -(-tokens // bs)
        return [
            torch.zeros((blocks, bs, dim), dtype=self.dtype, device=self.device)
            for dim in self.cache_dims
        ]

    @torch.inference_mode()
    def profile_forward(self, tokens: int, caches: list[torch.Tensor] | None = None) -> None:
        """The largest step the scheduler can send: `tokens` rows as one prefill through the
        target, then logits and their softmax (the sampler's largest temporaries) at the
        rows a full decode batch samples, over throw-away caches. The MTP pass over the same
        rows is left out: its one layer peaks no higher than a target layer does."""
        caches = caches if caches is not None else self._scratch_caches(tokens)
        bs = self.config.cache.block_size
        layout = [RequestLayout(0, tokens, tokens, list(range(-(-tokens // bs))))]
        pos = torch.arange(tokens, device=self.device)
        ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
        with forward_context(build_context(layout, pos, caches, bs)):
            hidden = self.model(ids, pos)
        k = self.config.spec.num_speculative_tokens
        rows = min(tokens, self.config.scheduler.max_seqs_per_batch * (1 + k))
        torch.softmax(self.model.compute_logits(hidden[-rows:]), dim=-1)

    @property
    def graph_mode(self) -> bool:
        """--enable_graph (every rank of a replica: its collectives are in the graphs)."""
        return self.config.device.enable_graph

    def init_cache(self, num_blocks: int, seed: int = 0) -> None:
        # Graph mode writes its padding rows into one scratch block past the managed ones.
        scratch = 1 if self.graph_mode else 0
        bs = self.config.cache.block_size
        # Zeroed: padded context positions are masked, but 0 * NaN would still poison the output.
        caches = [
            zeroed_cache((num_blocks + scratch, bs, dim), self.dtype, self.device)
            for dim in self.cache_dims
        ]
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB)",
            num_blocks,
            self.config.cache.block_size,
            num_blocks * self.bytes_per_block / 2**20,
        )
        self.runner = self._build_runner(caches, num_blocks, seed)
        if self.graph_mode and self.parallel.dp_attention:
            # every rank compiles now, all at once (each dummy step's MoE layers exchange
            # with the other ranks, which are in their start-up too); never in the
            # background, whose exchanges would interleave with the steps'
            self.warm_up_graphs()
        elif self.graph_mode and self.parallel.tp_size == 1:
            if self.config.device.graph_warm_up == "background":
                self._compiler = threading.Thread(
                    target=self.warm_up_graphs, name="xllm-graph-compile", daemon=True
                )
                self._compiler.start()
            else:
                self.warm_up_graphs()
        elif self.graph_mode:
            logger.info("graph mode: the replica's ranks compile together at its first step")
        freeze_start_up_objects()

    def _build_runner(self, caches: list[torch.Tensor], num_blocks: int, seed: int):
        """The model runner with every part it runs, built before it: the sampler and row
        builder, and with MTP on the proposer (hot-vocabulary head, draft sampler, the
        draft passes' graphs); the target's graphs in graph mode."""
        cfg, spec = self.config, self.config.spec
        sampler = Sampler(torch.Generator(device=self.device).manual_seed(seed))
        rows = RowSampling(cfg.model.vocab_size, list(cfg.model.eos_token_ids), self.device)
        graphs = proposer = draft_sampler = None
        k = spec.num_speculative_tokens
        if self.graph_mode:
            graphs = self._graph_runner(self.model.forward, caches, num_blocks, target_q_lens(spec))
        if self.draft is not None:
            if spec.draft_sampling == "sampled":
                draft_sampler = DraftSampler(sampler, rows)
            draft_graphs = {}
            if self.graph_mode:
                for layer, lens in graph_q_lens(k, len(self.draft.layers)).items():
                    draft_graphs[layer] = self._graph_runner(
                        _draft_pass(self.draft, layer),
                        caches,
                        num_blocks,
                        lens,
                        extras=((cfg.model.hidden_size,),),
                        name=f"MTP layer {layer}",
                    )
            proposer = MTPProposer(
                self.draft, k, caches, cfg.cache.block_size, self.device, self.dtype,
                cfg.max_model_len, hot=self._hot_vocab_head(), graphs=draft_graphs,
                choose=draft_sampler.choose if draft_sampler is not None else None,
            )  # fmt: skip
        return ModelRunner(
            self.model, caches, cfg.cache.block_size, cfg.model.eos_token_ids, self.device,
            self.dtype, cfg.model.path, sampler=sampler, rows=rows, proposer=proposer,
            draft_sampler=draft_sampler, graphs=graphs,
        )  # fmt: skip

    def _hot_vocab_head(self) -> HotVocabHead | None:
        """--speculative_draft_vocab_size: the draft's head over the hot tokens only (None:
        the whole vocabulary); "auto" sizes it from the token map, when there is one."""
        spec, model = self.config.spec, self.config.model
        path = token_map_path(spec.token_map, spec.draft_model, model.path)
        size = draft_vocab_size(spec.draft_vocab_size, path, model.vocab_size, model.is_v4)
        if spec.draft_vocab_size is None:  # auto: each node read its own map
            self._check_ranks_agree(size, path)
        if not size:
            return None
        ids = load_token_map(path, size, model.vocab_size)
        logger.info("MTP drafts from the %d most frequent target tokens (%s)", len(ids), path)
        return HotVocabHead(self.model.lm_head, ids, self.parallel)

    def _check_ranks_agree(self, size: int, path: Path) -> None:
        """With "auto" each node sizes the hot head from its own copy of the token map: a
        replica whose ranks found different maps (or none on some) would build the head on
        some ranks only and pair its all-reduce with another collective. So the ranks check
        together that their sizes are equal (n x the sum of squares = the square of the
        sum), and all of them refuse if not."""
        x = torch.tensor([size, size * size], dtype=torch.float64, device=self.device)
        total, squares = self.parallel.all_reduce(x).tolist()
        if total * total != self.parallel.tp_size * squares:
            raise ValueError(
                f"speculative_draft_vocab_size=auto: this replica's ranks found different "
                f"token maps (this rank: {size} hot tokens from {path}); give every node the "
                "same token map, or set speculative_draft_vocab_size"
            )

    def _graph_runner(self, fn, caches, num_blocks: int, q_lens, **kw) -> GraphRunner:
        """Graphs of `fn`'s passes over this worker's cache; the scratch block for padding
        rows is the one past the managed `num_blocks`."""
        return GraphRunner(
            fn,
            caches,
            self.config.cache.block_size,
            scratch_block=num_blocks,
            batch_sizes=self.config.device.graph_batch_sizes,
            q_lens=q_lens,
            device=self.device,
            dtype=self.dtype,
            **kw,
        )

    def warm_up_graphs(self) -> None:
        """Compile every graph now. The ranks of a tensor-parallel replica must do this
        together (the dummy steps all-reduce), which `execute` does at the replica's first
        step: the master sends an empty one at start-up."""
        bind_device(self.device)  # (on the background thread too)
        t0 = time.perf_counter()
        runners = [self.runner.graphs]
        if self.runner.proposer is not None:
            runners += self.runner.proposer.graphs.values()
        background = self._compiler is not None
        try:
            # Smallest batches first, every pass of a step at each size: steps of few
            # requests (concurrency 1 included) run compiled soonest.
            for b in self.config.device.graph_batch_sizes:
                for graphs in runners:
                    graphs.warm_up(b, progress=not background)
        except Exception:  # noqa: BLE001 - steps go on eager; the error is the log's
            if not background:
                raise
            logger.exception("graph mode: compiling failed; steps keep running eager")
            return
        for graphs in runners:
            graphs.fast_guards = True
        if background:
            logger.info(
                "graph mode: every graph compiled in %.1f s in the background; decode steps "
                "now run compiled",
                time.perf_counter() - t0,
            )

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        bind_device(self.device)
        if self.graph_mode and self._compiler is None and not self.runner.graphs.warm:
            self.warm_up_graphs()
        return self.runner.execute(sched)


def _draft_pass(draft, layer: int):
    """The MTP pass of `layer` as a function of the graph's inputs (ids, positions, hidden)."""

    def run(next_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor):
        return draft(next_ids, positions, hidden, layer)

    return run


def freeze_start_up_objects() -> None:
    """Move every object alive once the engine is built (modules, parameters, the
    tokenizer, the caches' wrappers) out of the garbage collector's generations. Steps make
    many short-lived objects, and each full collection would walk the ~200k start-up
    objects again: about a tenth of a sampled 512-row step's time on CPU, measured."""
    gc.collect()
    gc.freeze()


def zeroed_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache tensor. On CPU it lies in an anonymous memory map: the kernel's zero
    pages, each faulted in at its first write, so the KV cache sized for max_seqs_per_batch
    full-length requests (1.5 GiB for the bundled model) costs neither a second of memset
    at start-up nor resident memory until requests fill it."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    memory = mmap.mmap(-1, max(1, count * dtype.itemsize))  # the tensor keeps it alive
    return torch.frombuffer(memory, dtype=dtype, count=count).view(shape)
