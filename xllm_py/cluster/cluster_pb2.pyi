from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelFingerprint(_message.Message):
    __slots__ = ("config_sha256", "dtype", "num_speculative_tokens", "block_size", "digest")
    CONFIG_SHA256_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    config_sha256: str
    dtype: str
    num_speculative_tokens: int
    block_size: int
    digest: str
    def __init__(self, config_sha256: _Optional[str] = ..., dtype: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class Layout(_message.Message):
    __slots__ = ("nnodes", "dp_size", "ep_size", "dp_attention")
    NNODES_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    EP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DP_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    nnodes: int
    dp_size: int
    ep_size: int
    dp_attention: bool
    def __init__(self, nnodes: _Optional[int] = ..., dp_size: _Optional[int] = ..., ep_size: _Optional[int] = ..., dp_attention: _Optional[bool] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("node_rank", "device", "address", "fingerprint", "layout")
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    node_rank: int
    device: str
    address: str
    fingerprint: ModelFingerprint
    layout: Layout
    def __init__(self, node_rank: _Optional[int] = ..., device: _Optional[str] = ..., address: _Optional[str] = ..., fingerprint: _Optional[_Union[ModelFingerprint, _Mapping]] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("world_size", "session")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    session: str
    def __init__(self, world_size: _Optional[int] = ..., session: _Optional[str] = ...) -> None: ...

class InitModelRequest(_message.Message):
    __slots__ = ("rank", "world_size", "dp_size", "tp_size", "ep_size", "replica", "init_method", "dp_attention")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    EP_SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    INIT_METHOD_FIELD_NUMBER: _ClassVar[int]
    DP_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    dp_size: int
    tp_size: int
    ep_size: int
    replica: int
    init_method: str
    dp_attention: bool
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., dp_size: _Optional[int] = ..., tp_size: _Optional[int] = ..., ep_size: _Optional[int] = ..., replica: _Optional[int] = ..., init_method: _Optional[str] = ..., dp_attention: _Optional[bool] = ...) -> None: ...

class InitModelReply(_message.Message):
    __slots__ = ("backend", "capacity")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    backend: str
    capacity: int
    def __init__(self, backend: _Optional[str] = ..., capacity: _Optional[int] = ...) -> None: ...

class AllocateCacheRequest(_message.Message):
    __slots__ = ("num_blocks", "seed")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    seed: int
    def __init__(self, num_blocks: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class AllocateCacheReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("ready", "steps", "draining")
    READY_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    steps: int
    draining: bool
    def __init__(self, ready: _Optional[bool] = ..., steps: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "include_stop_str_in_output", "skip_special_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "prompt_logprobs", "structured_kind", "structured_spec", "structured_strict")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    N_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_KIND_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_SPEC_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_STRICT_FIELD_NUMBER: _ClassVar[int]
    n: int
    max_tokens: int
    min_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    prompt_logprobs: int
    structured_kind: str
    structured_spec: str
    structured_strict: bool
    def __init__(self, n: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., prompt_logprobs: _Optional[int] = ..., structured_kind: _Optional[str] = ..., structured_spec: _Optional[str] = ..., structured_strict: _Optional[bool] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("req_id", "token_ids", "num_prompt_tokens", "sampling", "block_ids", "num_computed_tokens")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    def __init__(self, req_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ...) -> None: ...

class CachedRequest(_message.Message):
    __slots__ = ("req_id", "new_token_ids", "new_block_ids", "num_computed_tokens")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    def __init__(self, req_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ...) -> None: ...

class ScheduledTokens(_message.Message):
    __slots__ = ("req_id", "num_tokens")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    num_tokens: int
    def __init__(self, req_id: _Optional[str] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class SpecTokens(_message.Message):
    __slots__ = ("req_id", "token_ids")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, req_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ExecuteStepRequest(_message.Message):
    __slots__ = ("new_requests", "cached_requests", "num_scheduled_tokens", "spec_token_ids", "finished_req_ids", "num_draft_tokens")
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    cached_requests: _containers.RepeatedCompositeFieldContainer[CachedRequest]
    num_scheduled_tokens: _containers.RepeatedCompositeFieldContainer[ScheduledTokens]
    spec_token_ids: _containers.RepeatedCompositeFieldContainer[SpecTokens]
    finished_req_ids: _containers.RepeatedScalarFieldContainer[str]
    num_draft_tokens: int
    def __init__(self, new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., cached_requests: _Optional[_Iterable[_Union[CachedRequest, _Mapping]]] = ..., num_scheduled_tokens: _Optional[_Iterable[_Union[ScheduledTokens, _Mapping]]] = ..., spec_token_ids: _Optional[_Iterable[_Union[SpecTokens, _Mapping]]] = ..., finished_req_ids: _Optional[_Iterable[str]] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class Logprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[Logprob]
    def __init__(self, entries: _Optional[_Iterable[_Union[Logprob, _Mapping]]] = ...) -> None: ...

class RequestResult(_message.Message):
    __slots__ = ("req_id", "sampled_token_ids", "has_logprobs", "logprobs", "draft_token_ids", "has_prompt_logprobs", "prompt_logprobs_start", "prompt_logprobs", "prompt_ranks", "draft_scores")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_START_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_RANKS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SCORES_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_logprobs: bool
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_prompt_logprobs: bool
    prompt_logprobs_start: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_ranks: _containers.RepeatedScalarFieldContainer[int]
    draft_scores: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, req_id: _Optional[str] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ..., has_logprobs: _Optional[bool] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., has_prompt_logprobs: _Optional[bool] = ..., prompt_logprobs_start: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_ranks: _Optional[_Iterable[int]] = ..., draft_scores: _Optional[_Iterable[float]] = ...) -> None: ...

class ExecuteStepReply(_message.Message):
    __slots__ = ("results", "has_drafts", "has_prompt_logprobs")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    HAS_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    HAS_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[RequestResult]
    has_drafts: bool
    has_prompt_logprobs: bool
    def __init__(self, results: _Optional[_Iterable[_Union[RequestResult, _Mapping]]] = ..., has_drafts: _Optional[bool] = ..., has_prompt_logprobs: _Optional[bool] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ("reason", "failure")
    REASON_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    reason: str
    failure: bool
    def __init__(self, reason: _Optional[str] = ..., failure: _Optional[bool] = ...) -> None: ...

class ShutdownReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
