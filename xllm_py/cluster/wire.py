"""The executor messages on the wire: dataclass <-> protobuf, at the edge only.

    SchedulerOutput   --sched_to_pb-->   ExecuteStepRequest   --sched_from_pb-->   SchedulerOutput
    ModelRunnerOutput --output_to_pb-->  ExecuteStepReply     --output_from_pb-->  ModelRunnerOutput

Round trips are exact: dict orders are kept as lists (the scheduling order is the batch
order; a logprobs dict lists the chosen token first), unset optionals stay None, floats
travel as doubles. Only `finished_req_ids`, a set, loses an order it never had.
"""

from __future__ import annotations

from xllm_py.cluster import cluster_pb2 as pb
from xllm_py.executor.messages import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    SchedulerOutput,
    TokenLogprobs,
)
from xllm_py.sampling_params import SamplingParams, StructuredOutput

_OPTIONAL = ("max_tokens", "seed", "logprobs", "prompt_logprobs")  # None <-> unset
_PLAIN = (
    "n",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def sampling_to_pb(sp: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        stop=sp.stop, stop_token_ids=sp.stop_token_ids, logit_bias=sp.logit_bias or {}
    )
    if sp.structured is not None:
        msg.structured_kind = sp.structured.kind
        msg.structured_spec = sp.structured.spec
        msg.structured_strict = sp.structured.strict
    for name in _PLAIN:
        setattr(msg, name, getattr(sp, name))
    for name in _OPTIONAL:
        if getattr(sp, name) is not None:
            setattr(msg, name, getattr(sp, name))
    return msg


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    kw = {name: getattr(msg, name) for name in _PLAIN}
    kw.update({name: getattr(msg, name) if msg.HasField(name) else None for name in _OPTIONAL})
    return SamplingParams(
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        logit_bias=dict(msg.logit_bias),
        structured=StructuredOutput(msg.structured_kind, msg.structured_spec, msg.structured_strict)
        if msg.structured_kind
        else None,
        **kw,
    )


def sched_to_pb(s: SchedulerOutput) -> pb.ExecuteStepRequest:
    return pb.ExecuteStepRequest(
        new_requests=[
            pb.NewRequest(
                req_id=r.req_id,
                token_ids=r.token_ids,
                num_prompt_tokens=r.num_prompt_tokens,
                sampling=sampling_to_pb(r.sampling),
                block_ids=r.block_ids,
                num_computed_tokens=r.num_computed_tokens,
            )
            for r in s.new_requests
        ],
        cached_requests=[
            pb.CachedRequest(
                req_id=r.req_id,
                new_token_ids=r.new_token_ids,
                new_block_ids=r.new_block_ids,
                num_computed_tokens=r.num_computed_tokens,
            )
            for r in s.cached_requests
        ],
        num_scheduled_tokens=[
            pb.ScheduledTokens(req_id=k, num_tokens=n) for k, n in s.num_scheduled_tokens.items()
        ],
        spec_token_ids=[pb.SpecTokens(req_id=k, token_ids=t) for k, t in s.spec_token_ids.items()],
        finished_req_ids=sorted(s.finished_req_ids),
        num_draft_tokens=s.num_draft_tokens,
    )


def sched_from_pb(msg: pb.ExecuteStepRequest) -> SchedulerOutput:
    return SchedulerOutput(
        new_requests=[
            NewRequestData(
                r.req_id,
                list(r.token_ids),
                r.num_prompt_tokens,
                sampling_from_pb(r.sampling),
                list(r.block_ids),
                r.num_computed_tokens,
            )
            for r in msg.new_requests
        ],
        cached_requests=[
            CachedRequestData(
                r.req_id, list(r.new_token_ids), list(r.new_block_ids), r.num_computed_tokens
            )
            for r in msg.cached_requests
        ],
        num_scheduled_tokens={e.req_id: e.num_tokens for e in msg.num_scheduled_tokens},
        spec_token_ids={e.req_id: list(e.token_ids) for e in msg.spec_token_ids},
        finished_req_ids=set(msg.finished_req_ids),
        num_draft_tokens=msg.num_draft_tokens if msg.HasField("num_draft_tokens") else None,
    )


def _logprobs_to_pb(lps: list[TokenLogprobs]) -> list[pb.TokenLogprobs]:
    return [
        pb.TokenLogprobs(entries=[pb.Logprob(token_id=t, logprob=v) for t, v in d.items()])
        for d in lps
    ]


def output_to_pb(out: ModelRunnerOutput) -> pb.ExecuteStepReply:
    drafts = out.draft_token_ids or [[] for _ in out.req_ids]
    scores = out.draft_scores or [[] for _ in out.req_ids]
    prompt = out.prompt_logprobs or [None for _ in out.req_ids]
    return pb.ExecuteStepReply(
        results=[
            pb.RequestResult(
                req_id=req_id,
                sampled_token_ids=sampled,
                has_logprobs=lps is not None,
                logprobs=_logprobs_to_pb(lps or []),
                draft_token_ids=draft,
                has_prompt_logprobs=pl is not None,
                prompt_logprobs_start=pl.start if pl else 0,
                prompt_logprobs=_logprobs_to_pb(pl.logprobs if pl else []),
                prompt_ranks=pl.ranks if pl else [],
                draft_scores=score,
            )
            for req_id, sampled, lps, draft, score, pl in zip(
                out.req_ids, out.sampled_token_ids, out.logprobs, drafts, scores, prompt
            )
        ],
        has_drafts=bool(out.draft_token_ids),
        has_prompt_logprobs=bool(out.prompt_logprobs),
    )


def _logprobs_from_pb(lps) -> list[TokenLogprobs]:
    return [{e.token_id: e.logprob for e in t.entries} for t in lps]


def output_from_pb(msg: pb.ExecuteStepReply) -> ModelRunnerOutput:
    results = msg.results
    return ModelRunnerOutput(
        req_ids=[r.req_id for r in results],
        sampled_token_ids=[list(r.sampled_token_ids) for r in results],
        logprobs=[_logprobs_from_pb(r.logprobs) if r.has_logprobs else None for r in results],
        draft_token_ids=[list(r.draft_token_ids) for r in results] if msg.has_drafts else [],
        draft_scores=[list(r.draft_scores) for r in results]
        if msg.has_drafts and any(r.draft_scores for r in results)
        else [],
        prompt_logprobs=[
            PromptLogprobs(
                r.prompt_logprobs_start,
                _logprobs_from_pb(r.prompt_logprobs),
                list(r.prompt_ranks),
            )
            if r.has_prompt_logprobs
            else None
            for r in results
        ]
        if msg.has_prompt_logprobs
        else [],
    )
