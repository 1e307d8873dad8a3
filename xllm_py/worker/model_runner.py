"""Runs one scheduled step on the model: SchedulerOutput -> ModelRunnerOutput.

Keeps a copy of each request's tokens and block table (updated from the
step's diffs), lays the step's tokens out as one flat batch

    input_ids / positions / slot_mapping  [T]
    attention groups                      (see models.context)
    sample rows                           [R'] last row of each request whose
                                          prompt is complete after this step

runs the model once, computes logits only at the sample rows and samples. Requests
that asked for prompt logprobs also get logits at their prompt rows, PROMPT_LOGPROBS_ROWS
rows at a time (never a whole prompt x vocab tensor). The grammar bitmask of structured
outputs depends only on the step's rows and drafts, so on an accelerator it is filled in
a helper thread while the model runs (`overlap_grammar`) and waited for only before
sampling. On CPU the forward already keeps every core busy and the thread only competes
with it (perf/structured_cost.py measured no gain), so there it is filled in line.
"""

from __future__ import annotations

import concurrent.futures
import time

import torch

from xllm_py.executor.messages import (
    ModelRunnerOutput,
    PromptLogprobs,
    SchedulerOutput,
    TokenLogprobs,
)
from xllm_py.models.attention_layout import RequestLayout, build_context
from xllm_py.models.context import forward_context
from xllm_py.models.layers.moe import idle_forward
from xllm_py.speculative.mtp_proposer import MTPProposer, ProposeInput
from xllm_py.structured import Matcher, allocate_bitmask, grammars_for
from xllm_py.worker.draft_sampler import DraftSampler
from xllm_py.worker.graph_runner import GraphRunner
from xllm_py.worker.rejection_sampler import verify
from xllm_py.worker.row_sampling import RowSampling
from xllm_py.worker.runner_request import RunnerRequest
from xllm_py.worker.sampler import (
    Sampler,
    logprob_details,
)

# Prompt rows whose logits (rows x vocab floats) exist at once while prompt logprobs are
# computed: 256 x DeepSeek-V3's 129,280 x 4 bytes = 132 MB, twice with the log-softmax.
PROMPT_LOGPROBS_ROWS = 256
# One thread fills grammar bitmasks during the forward; xgrammar releases the GIL.
_GRAMMAR_THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="xllm-bitmask")


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        eos_token_ids: tuple[int, ...],
        device: torch.device,
        dtype: torch.dtype,
        model_path: str | None = None,
        *,
        sampler: Sampler,
        rows: RowSampling,
        proposer: MTPProposer | None = None,
        draft_sampler: DraftSampler | None = None,
        graphs: GraphRunner | None = None,
    ) -> None:
        """Built whole (worker.py's `build_runner`): `sampler` and `rows` sample the
        target's rows; `proposer` drafts (MTP on), drawing sampled requests' drafts through
        `draft_sampler`; `graphs` runs the decode steps in graph mode."""
        self.model = model
        self.model_path = model_path  # its tokenizer compiles structured-output grammars
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = device
        self.dtype = dtype
        self.vocab_size = model.config.vocab_size
        self.sampler = sampler
        self.rows = rows
        self.requests: dict[str, RunnerRequest] = {}
        self.proposer = proposer
        self.draft_sampler = draft_sampler
        self.graphs = graphs
        # fill grammar bitmasks while the forward runs (False: after it, in this thread)
        self.overlap_grammar = device.type != "cpu"

    def _apply_diffs(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in sched.new_requests:
            req = self.requests[new.req_id] = RunnerRequest(
                list(new.token_ids),
                new.num_prompt_tokens,
                new.sampling,
                list(new.block_ids),
                new.num_computed_tokens,
            )
            if new.sampling.structured is not None:
                req.matcher = self._matcher(req)
        for diff in sched.cached_requests:
            req = self.requests[diff.req_id]
            req.token_ids.extend(diff.new_token_ids)
            req.block_ids.extend(diff.new_block_ids)
            req.num_computed_tokens = diff.num_computed_tokens

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_diffs(sched)
        req_ids = list(sched.num_scheduled_tokens)
        if not req_ids:
            if self.model.parallel.dp_attention:  # the other ranks' step needs this one
                idle_forward(self.model, self.dtype, self.device)
                if self.proposer is not None:
                    self.proposer.propose([], None, sched.num_draft_tokens)
            return ModelRunnerOutput([], [], [], [])
        input_ids: list[int] = []
        positions: list[int] = []
        layouts: list[RequestLayout] = []
        sample_rows: list[int] = []
        sample_reqs: list[tuple[int, int]] = []  # (request index, output offset) per sample row
        for i, req_id in enumerate(req_ids):
            req = self.requests[req_id]
            n, s = sched.num_scheduled_tokens[req_id], req.num_computed_tokens
            drafts = sched.spec_token_ids.get(req_id, [])
            known = n - len(drafts)  # scheduled tokens that are already verified
            start = len(input_ids)
            input_ids.extend(req.token_ids[s : s + known])
            input_ids.extend(drafts)
            positions.extend(range(s, s + n))
            layouts.append(RequestLayout(start, n, s + n, req.block_ids))
            if s + known == len(req.token_ids):  # every row from the last verified token on
                for j in range(len(drafts) + 1):  # samples the token after it
                    sample_rows.append(start + known - 1 + j)
                    sample_reqs.append((i, j))
        grammar = self._start_grammar(req_ids, sample_reqs, sched.spec_token_ids)
        bucket = None
        if self.graphs is not None and len(sample_rows) == len(input_ids):
            bucket = self.graphs.bucket_for(layouts)  # uniform decode / verification
        if bucket is not None:
            hidden = self.graphs.run(bucket, input_ids, positions, layouts)
        else:
            hidden = self._forward(input_ids, positions, layouts)
        if len(sample_rows) == len(input_ids):
            logits = self.model.compute_logits(hidden)
        else:
            logits = self.model.compute_logits(
                hidden[torch.tensor(sample_rows, dtype=torch.long, device=self.device)]
            )
        out = self._sample(req_ids, sample_reqs, logits, sched.spec_token_ids, grammar)
        out.prompt_logprobs = self._prompt_logprobs(req_ids, layouts, hidden)
        if self.proposer is not None:
            out.draft_token_ids, out.draft_scores = self._propose(
                req_ids, sched, layouts, out, hidden
            )
        return out

    def _forward(self, input_ids, positions, layouts) -> torch.Tensor:
        pos = torch.tensor(positions, device=self.device)
        ctx = build_context(layouts, pos, self.kv_caches, self.block_size)
        with forward_context(ctx):
            return self.model(torch.tensor(input_ids, device=self.device), pos)

    def _sample(
        self,
        req_ids: list[str],
        sample_reqs: list[tuple[int, int]],
        logits: torch.Tensor,
        spec: dict[str, list[int]],
        grammar: concurrent.futures.Future | None = None,
    ) -> ModelRunnerOutput:
        """One token per request, or with drafts, the verified run (rejection_sampler);
        `grammar`: the bitmask `_start_grammar` began filling."""
        rows = [(self.requests[req_ids[i]], j) for i, j in sample_reqs]
        batch = self.rows.batch(rows)
        batch.adjust = self.rows.adjust(
            rows, [spec.get(req_ids[i], [])[:j] for i, j in sample_reqs]
        )
        batch.grammar = None if grammar is None else grammar.result()
        out_tokens: list[list[int]] = [[] for _ in req_ids]
        if not spec:
            tokens, chosen, top = self.sampler(logits, batch)
            emitted_rows = list(range(len(sample_reqs)))
            token_list = tokens.tolist()
            for row, (i, _) in enumerate(sample_reqs):
                out_tokens[i] = [token_list[row]]
        else:
            raw = None if batch.max_logprobs is None else torch.log_softmax(logits, dim=-1)
            firsts = [row for row, (_, j) in enumerate(sample_reqs) if j == 0]
            owners = [sample_reqs[row][0] for row in firsts]
            drafts = [spec.get(req_ids[i], []) for i in owners]
            qs = None
            if self.draft_sampler is not None:
                qs = [self.draft_sampler.q_for(req_ids[i], d) for i, d in zip(owners, drafts)]
            emitted = verify(self.sampler, logits, batch, [len(d) + 1 for d in drafts], drafts, qs)
            emitted_rows, token_list = [], []
            for i, first, em in zip(owners, firsts, emitted):
                out_tokens[i] = em
                emitted_rows += range(first, first + len(em))
                token_list += em
            idx = torch.tensor(emitted_rows, dtype=torch.long, device=logits.device)
            chosen, top = logprob_details(
                None if raw is None else raw[idx],
                torch.tensor(token_list, device=logits.device),
                batch.max_logprobs,
            )
        logprobs = self._logprobs(req_ids, sample_reqs, emitted_rows, token_list, chosen, top)
        for req_id, tokens in zip(req_ids, out_tokens):
            matcher = self.requests[req_id].matcher
            for t in tokens if matcher is not None else ():
                if matcher.terminated or not matcher.accept(t):
                    break  # (a stop token ended the request: later tokens are dropped)
        return ModelRunnerOutput(req_ids, out_tokens, logprobs)

    def _matcher(self, req: RunnerRequest) -> Matcher:
        """The grammar state after the request's outputs so far (a request resumed after
        preemption has some). Drafts are followed and rolled back: up to k at a time."""
        vocab = self.vocab_size
        grammars = grammars_for(self.model_path, vocab, tuple(self.eos_token_ids))
        k = self.proposer.k if self.proposer is not None else 0
        matcher = Matcher(grammars, req.sampling.structured, max_rollback=k)
        for t in req.token_ids[req.num_prompt_tokens :]:
            if matcher.terminated or not matcher.accept(t):
                break
        return matcher

    def _start_grammar(
        self, req_ids: list[str], sample_reqs: list[tuple[int, int]], spec: dict[str, list[int]]
    ) -> concurrent.futures.Future | None:
        """The step's grammar bitmask, being filled (in the helper thread with
        overlap_grammar, while the forward runs: nothing else touches the matchers until
        sampling waits for it); None when no sampled request follows a grammar."""
        rows = [(self.requests[req_ids[i]], j) for i, j in sample_reqs]
        if not any(r.matcher is not None for r, _ in rows):
            return None
        drafts = [spec.get(req_ids[i], []) for i, _ in sample_reqs]
        if self.overlap_grammar:
            return _GRAMMAR_THREAD.submit(self._grammar_bitmask, rows, drafts)
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(self._grammar_bitmask(rows, drafts))
        return done

    def _grammar_bitmask(
        self, rows: list[tuple[RunnerRequest, int]], drafts: list[list[int]]
    ) -> tuple[torch.Tensor, list[int]]:
        """The bitmask of the rows whose requests follow a grammar (`_start_grammar` calls
        it when at least one does): row (request, j) allows what may follow the request's
        outputs and its drafts d_1..d_j. A draft the grammar refuses ends the request's
        masks there: verification rejects it (the row before gives it probability 0), so
        the rows after it are never used."""
        picked = [row for row, (r, _) in enumerate(rows) if r.matcher is not None]
        bitmask = allocate_bitmask(len(picked), self.vocab_size)  # all allowed
        followed: dict[int, int] = {}  # id(request) -> drafts its matcher took (to undo)
        refused: set[int] = set()
        for n, row in enumerate(picked):
            r, j = rows[row]
            key = id(r)
            if j > 0 and key not in refused:
                if not r.matcher.terminated and r.matcher.accept(drafts[row][j - 1]):
                    followed[key] = followed.get(key, 0) + 1
                else:
                    refused.add(key)
            if key not in refused and not r.matcher.terminated:
                r.matcher.fill(bitmask, n)
        for row in picked:
            r = rows[row][0]
            r.matcher.rollback(followed.pop(id(r), 0))
        return bitmask, picked

    def _prompt_logprobs(
        self, req_ids: list[str], layouts: list[RequestLayout], hidden: torch.Tensor
    ) -> list[PromptLogprobs | None]:
        """Row p of a prompt (position p < prompt length - 1) scores prompt token p + 1.
        [] when no scheduled request asked for prompt logprobs. Under tensor parallelism
        every rank computes the same chunks (compute_logits is a collective)."""
        rows: list[int] = []
        targets: list[int] = []
        spans: list[tuple[int, int, int] | None] = []  # (first row index, count, start)
        for req_id, lay in zip(req_ids, layouts):
            req = self.requests[req_id]
            s = lay.ctx_len - lay.q_len
            end = min(lay.ctx_len, req.num_prompt_tokens - 1)
            if req.sampling.prompt_logprobs is None or end <= s:
                spans.append(None)
                continue
            spans.append((len(rows), end - s, s + 1))
            rows.extend(range(lay.start, lay.start + end - s))
            targets.extend(req.token_ids[s + 1 : end + 1])
        if not rows:
            return []
        top_n = max(self.requests[r].sampling.prompt_logprobs or 0 for r in req_ids)
        chosen: list[float] = []
        ranks: list[int] = []
        top_vals: list[list[float]] = []
        top_ids: list[list[int]] = []
        for c in range(0, len(rows), PROMPT_LOGPROBS_ROWS):
            idx = torch.tensor(rows[c : c + PROMPT_LOGPROBS_ROWS], device=self.device)
            tgt = torch.tensor(targets[c : c + PROMPT_LOGPROBS_ROWS], device=self.device)
            lp = torch.log_softmax(self.model.compute_logits(hidden[idx]), dim=-1)
            mine = lp.gather(1, tgt.unsqueeze(1))
            chosen += mine.squeeze(1).tolist()
            ranks += ((lp > mine).sum(dim=1) + 1).tolist()
            if top_n:
                top = lp.topk(top_n, dim=-1)
                top_vals += top.values.tolist()
                top_ids += top.indices.tolist()
        out: list[PromptLogprobs | None] = []
        for req_id, span in zip(req_ids, spans):
            if span is None:
                out.append(None)
                continue
            first, count, start = span
            n = self.requests[req_id].sampling.prompt_logprobs
            entries = []
            for k in range(first, first + count):
                entry = {targets[k]: chosen[k]}
                for tid, val in zip(top_ids[k][:n], top_vals[k][:n]) if n else ():
                    entry.setdefault(tid, val)
                entries.append(entry)
            out.append(PromptLogprobs(start, entries, ranks[first : first + count]))
        return out

    def _logprobs(self, req_ids, sample_reqs, emitted_rows, token_list, chosen, top):
        """{token: logprob} for each emitted token of the requests that asked (chosen first)."""
        out: list[list[TokenLogprobs] | None] = [None] * len(req_ids)
        if chosen is None:
            return out
        chosen_list = chosen.tolist()
        top_vals, top_ids = (
            (top.values.tolist(), top.indices.tolist()) if top is not None else ([], [])
        )
        for k, row in enumerate(emitted_rows):
            i = sample_reqs[row][0]
            n = self.requests[req_ids[i]].sampling.logprobs
            if n is None:
                continue
            entry = {token_list[k]: chosen_list[k]}
            for tid, val in zip(top_ids[k][:n], top_vals[k][:n]) if n else ():
                entry.setdefault(tid, val)
            out[i] = (out[i] or []) + [entry]
        return out

    def _propose(self, req_ids, sched, layouts, out: ModelRunnerOutput, hidden):
        """Run the MTP layer over every request's newly verified positions; drafts (and
        their scores) for the requests that sampled this step (greedy or not: verification
        is exact for both). A step that does not draft (`sched.num_draft_tokens` = 0:
        adaptive k = 0, or "auto"'s gate) runs no MTP pass at all, prompt chunks included:
        their positions stay out of the MTP cache (lossless; those requests draft worse
        later). Sets out.mtp_prompt_seconds."""
        items, context = [], {}
        k = sched.num_draft_tokens
        if k == 0:
            if self.model.parallel.dp_attention:  # the other ranks' passes may need this one
                self.proposer.propose([], None, 0)
            return [[] for _ in req_ids], [[] for _ in req_ids]
        prompt_rows = 0
        for i, req_id in enumerate(req_ids):
            req, lay = self.requests[req_id], layouts[i]
            drafts = sched.spec_token_ids.get(req_id, [])
            new = out.sampled_token_ids[i]
            verified = lay.q_len - len(drafts) + max(len(new) - 1, 0)  # rows now verified
            seq = req.token_ids + new  # t_{i+1} of every verified position i
            s = lay.ctx_len - lay.q_len
            prompt_rows += max(min(req.num_prompt_tokens - s, verified), 0)
            items.append(
                ProposeInput(
                    req_id=req_id,
                    rows=list(range(lay.start, lay.start + verified)),
                    start=s,
                    next_ids=seq[s + 1 : s + 1 + verified],
                    block_ids=req.block_ids,
                    wants_drafts=bool(new),
                    matcher=req.matcher,
                    sampled=self.draft_sampler is not None and not req.sampling.greedy,
                )
            )
            context[req_id] = (req, new)
        if self.draft_sampler is not None:
            self.draft_sampler.begin(context)
        started = time.perf_counter()
        drafts, scores = self.proposer.propose(items, hidden, k)
        if prompt_rows:
            rows = sum(len(it.rows) for it in items)
            out.mtp_prompt_seconds = (time.perf_counter() - started) * prompt_rows / rows
        return drafts, scores
