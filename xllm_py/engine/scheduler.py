"""Continuous batching, phase-agnostic, FCFS.

Each step: every running request asks for `num_tokens - num_computed_tokens`
tokens (1 when decoding, the rest of the prompt while prefilling), then
waiting requests are admitted in arrival order while the token budget
(`max_tokens_per_batch`), the sequence budget (`max_seqs_per_batch`) and free
blocks allow. A prompt larger than the remaining budget is split over steps
when chunked prefill is on. When a running request cannot get a block, the
most recently admitted request is preempted: its blocks are freed and it
rejoins the front of the queue, to be recomputed (prompt + outputs so far).

    schedule() -> SchedulerOutput --executor--> ModelRunnerOutput -> update()
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from xllm_py.cache.block_manager import BlockManager
from xllm_py.config import SchedulerConfig
from xllm_py.engine.request import Request, RequestStatus
from xllm_py.executor.messages import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    SchedulerOutput,
    TokenLogprobs,
)
from xllm_py.pd.compat import PDStats
from xllm_py.speculative.adaptive import AdaptiveSpeculation
from xllm_py.speculative.confidence import ConfidencePolicy
from xllm_py.speculative.metrics import SpecDecodeStats


@dataclass
class EngineCoreOutput:
    """What one step produced for one request."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (why: stop_reason)
    stop_reason: int | str | None = None
    # with the request's first output, when it asked for prompt logprobs: one entry per
    # prompt token, the first None (nothing comes before it), and the ranks of the rest
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_ranks: list[int] | None = None
    # the request's totals so far: draft tokens verified, and how many were accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0  # total since start
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec: SpecDecodeStats | None = None
    pd: PDStats | None = None  # a PD prefill or decode instance's transfers


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        num_lookahead_tokens: int = 0,
        spec_disable_batch_size: int = 0,
        adaptive: AdaptiveSpeculation | None = None,
        confidence: ConfidencePolicy | None = None,
    ) -> None:
        self.config = config
        self.confidence = confidence  # drafts verified per request (speculative/confidence.py)
        self.spec_disable_batch_size = spec_disable_batch_size
        self.adaptive = adaptive  # chooses the drafts per step (speculative/adaptive.py), when on
        self.blocks = block_manager
        self.num_lookahead = num_lookahead_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._forget: set[str] = set()  # ids the worker must drop at the next step
        self.num_preemptions = 0
        self.spec_stats = SpecDecodeStats()
        # a step, and the tokens it emitted (the confidence policy's gate rates steps by them)
        self._emitted: tuple[SchedulerOutput, int] | None = None
        self._drafted_before: bool | None = None  # whether the last timed step drafted

    # ---- request lifecycle --------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def finish_request(self, req_id: str, reason: str = "abort") -> Request | None:
        """Abort (or stop, e.g. on a stop string) a request wherever it is; frees its blocks."""
        req = self.requests.get(req_id)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.finish_reason = req.finish_reason or reason
        self._release(req)
        return req

    def _release(self, req: Request) -> None:
        self._drop_hold(req)
        req.status = RequestStatus.FINISHED
        self.spec_stats.record_request(req.num_draft_tokens, req.num_accepted_tokens)
        self.blocks.free(req)
        del self.requests[req.req_id]
        if req.num_tokens_sent:
            self._forget.add(req.req_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- scheduling ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._forget)
        self._forget = set()
        budget = self.config.max_tokens_per_batch
        preempted = False
        limit = self.spec_disable_batch_size
        max_drafts = 0 if limit and len(self.running) > limit else None  # None: all of them
        if self.adaptive is not None:
            max_drafts = out.num_draft_tokens = self.adaptive.choose(len(self.running))
        plan = self._confidence_plan(out) if max_drafts != 0 else {}
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            remaining = req.num_tokens - req.num_computed_tokens
            # Drafts past the request's last possible token (max_tokens, context) are waste.
            room = max(req.max_output - len(req.output_token_ids) - 1, 0)
            drafts = req.spec_token_ids[: room if max_drafts is None else min(room, max_drafts)]
            kept = plan.get(req.req_id, len(drafts))
            self.spec_stats.cut_draft_tokens += max(len(drafts) - kept, 0)
            drafts = drafts[:kept]
            n = min(remaining + len(drafts), budget)
            while not self.blocks.allocate(req, n, self.num_lookahead):
                victim = self.running.pop()
                self._preempt(victim, out)
                preempted = True
                if victim is req:
                    break
            else:
                self._emit_cached(req, n, out)
                drafts = drafts[: max(n - remaining, 0)]
                if drafts:
                    out.spec_token_ids[req.req_id] = drafts
                budget -= n
                i += 1
        if not preempted:
            self._admit_waiting(budget, out)
        return out

    def _confidence_plan(self, out: SchedulerOutput) -> dict[str, int]:
        """req_id -> drafts to verify, from the confidence policy (when on); and whether
        the step should propose drafts at all (out.num_draft_tokens = 0 when none pays)."""
        if self.confidence is None:
            return {}
        reqs = [r for r in self.running if r.spec_token_ids]
        counts = self.confidence.plan([r.spec_scores[: len(r.spec_token_ids)] for r in reqs])
        # A step with nothing running only prefills what it admits: it takes the decision
        # for the batch those requests will form (drafting, its MTP pass over their prompts)
        batch = len(self.running) or min(len(self.waiting), self.config.max_seqs_per_batch)
        if not self.confidence.drafting(batch):
            out.num_draft_tokens = 0
            self.spec_stats.undrafted_steps += 1
        return {r.req_id: n for r, n in zip(reqs, counts)}

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_seqs_per_batch:
            req = self.waiting[0]
            hits = [] if req.scoring_prompt else self.blocks.find_cached_prefix(req)
            n = req.num_tokens - len(hits) * self.blocks.block_size
            if n > budget:
                # Recomputation after preemption may always be chunked: its length grew while
                # it ran, so it need not fit the budget its prompt was admitted under.
                if not (self.config.enable_chunked_prefill or req.num_preemptions):
                    break
                n = budget
            if not self.blocks.allocate(req, n, self.num_lookahead, hits):
                if not self.running and self._drop_holds():
                    continue  # other requests' held blocks left no room: evictable now
                break
            self._drop_hold(req)  # its moved blocks are its own now
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = len(hits) * self.blocks.block_size
            self.running.append(req)
            out.new_requests.append(
                NewRequestData(
                    req.req_id,
                    list(req.all_token_ids),
                    req.num_prompt_tokens,
                    req.sampling,
                    list(req.block_ids),
                    req.num_computed_tokens,
                )
            )
            req.num_tokens_sent = req.num_tokens
            req.num_blocks_sent = len(req.block_ids)
            out.num_scheduled_tokens[req.req_id] = n
            budget -= n

    def _drop_hold(self, req: Request) -> None:
        """PD decode: let the blocks moved for `req` go (it owns them now, or it is gone)."""
        if req.prefix_hold is not None:
            self.blocks.abort_prefix(req.prefix_hold)
            req.prefix_hold = None

    def _drop_holds(self) -> bool:
        """Let every waiting request's moved blocks go (they stay cached until evicted):
        with nothing running, held blocks must not keep the queue from moving. Whether any
        were held."""
        held = [r for r in self.waiting if r.prefix_hold is not None]
        for r in held:
            self._drop_hold(r)
        return bool(held)

    def _emit_cached(self, req: Request, n: int, out: SchedulerOutput) -> None:
        out.cached_requests.append(
            CachedRequestData(
                req.req_id,
                req.all_token_ids[req.num_tokens_sent :],
                req.block_ids[req.num_blocks_sent :],
                req.num_computed_tokens,
            )
        )
        req.num_tokens_sent = req.num_tokens
        req.num_blocks_sent = len(req.block_ids)
        out.num_scheduled_tokens[req.req_id] = n

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.blocks.free(req)
        req.spec_token_ids = []
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_tokens_sent = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.finished_req_ids.add(req.req_id)

    # ---- results ------------------------------------------------------------------------------

    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = []
        judged: list[tuple[int, int]] = []  # (drafts, accepted) per request, for adaptive k
        scored: list[tuple[list[float], int]] = []  # (their scores, accepted): confidence
        for row, req_id in enumerate(result.req_ids):
            req = self.requests.get(req_id)
            if req is None:  # aborted while the step ran
                continue
            if result.prompt_logprobs and result.prompt_logprobs[row] is not None:
                self._collect_prompt_logprobs(req, result.prompt_logprobs[row])
            sampled = result.sampled_token_ids[row]
            if sampled and req.max_output == 0:  # max_tokens 0: the prompt was all it wanted
                sampled, req.finish_reason = [], "length"
            drafts = sched.spec_token_ids.get(req_id, [])
            accepted = max(len(sampled) - 1, 0)  # drafts the target agreed with
            self.spec_stats.record(drafts, accepted)
            req.num_draft_tokens += len(drafts)
            req.num_accepted_tokens += accepted
            judged.append((len(drafts), accepted))
            if drafts:
                scored.append((req.spec_scores[: len(drafts)], accepted))
            # Verified: every scheduled token except the rejected drafts.
            req.num_computed_tokens += sched.num_scheduled_tokens[req_id] - (len(drafts) - accepted)
            new_tokens: list[int] = []
            for tok in sampled:
                new_tokens.append(tok)
                if req.append_output(tok):  # a stop inside an accepted run drops the rest
                    break
            # A stop inside an accepted run drops tokens that were counted as computed.
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            req.spec_token_ids = result.draft_token_ids[row] if result.draft_token_ids else []
            req.spec_scores = result.draft_scores[row] if result.draft_scores else []
            self.blocks.cache_full_blocks(req, req.num_computed_tokens)
            logprobs = result.logprobs[row]
            if logprobs is not None:
                logprobs = logprobs[: len(new_tokens)]
            if req.finish_reason is not None:
                self.running.remove(req)
                self._release(req)
            if new_tokens or req.finish_reason:
                out = EngineCoreOutput(
                    req_id,
                    new_tokens,
                    logprobs,
                    req.finish_reason,
                    req.stop_reason,
                    num_draft_tokens=req.num_draft_tokens,
                    num_accepted_tokens=req.num_accepted_tokens,
                )
                if req.prompt_logprobs is not None:  # complete: the prompt's last row sampled
                    out.prompt_logprobs = [None, *req.prompt_logprobs]
                    out.prompt_ranks = req.prompt_ranks
                    req.prompt_logprobs = None
                outputs.append(out)
        if self.adaptive is not None:
            self.adaptive.observe_acceptance(judged)
        if self.confidence is not None:
            self._emitted = (sched, sum(1 + accepted for _, accepted in judged))
            self.confidence.observe_acceptance(scored)
            self.confidence.observe_prompt_passes(
                sched.num_draft_tokens != 0, self._emitted[1], result.mtp_prompt_seconds
            )
        return outputs

    @staticmethod
    def _collect_prompt_logprobs(req: Request, got: PromptLogprobs) -> None:
        """Append the positions not collected yet (a recomputation after preemption scores
        positions again; they are the same and are dropped)."""
        if req.prompt_logprobs is None:
            return
        skip = 1 + len(req.prompt_logprobs) - got.start
        if skip < 0:
            raise RuntimeError(
                f"request {req.req_id}: prompt logprobs from position {got.start}, but only "
                f"{1 + len(req.prompt_logprobs)} were collected"
            )
        req.prompt_logprobs += got.logprobs[skip:]
        req.prompt_ranks += got.ranks[skip:]

    def record_step_time(self, sched: SchedulerOutput, seconds: float) -> None:
        """Feed the confidence policy the cost of every decode step (no prompt chunk), with
        the tokens the step emitted and whether it and the step before ran the MTP passes,
        and adaptive speculation the cost of a clean step: every request decoding
        and verifying exactly the drafts the step also asked for (no change of k between
        this step and the one before)."""
        drafted = sched.num_draft_tokens != 0
        steady, self._drafted_before = self._drafted_before == drafted, drafted
        known = self._emitted is not None and self._emitted[0] is sched
        tokens = self._emitted[1] if known else 0
        if self.confidence is not None and sched.num_scheduled_tokens and not sched.new_requests:
            spec = sched.spec_token_ids
            if all(n == 1 + len(spec.get(r, ())) for r, n in sched.num_scheduled_tokens.items()):
                rows = sum(sched.num_scheduled_tokens.values())
                self.confidence.observe_step(
                    len(sched.num_scheduled_tokens), rows, seconds, tokens, drafted,
                    steady and known,
                )  # fmt: skip
        k = sched.num_draft_tokens
        if self.adaptive is None or k is None or sched.new_requests:
            return
        for req_id, n in sched.num_scheduled_tokens.items():
            if n != 1 + k or len(sched.spec_token_ids.get(req_id, ())) != k:
                return
        if sched.num_scheduled_tokens:
            self.adaptive.observe_step(len(sched.num_scheduled_tokens), k, seconds)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.blocks.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.blocks.prefix_queries,
            prefix_cache_hits=self.blocks.prefix_hits,
            spec=self.spec_stats.snapshot(self.adaptive),
        )
