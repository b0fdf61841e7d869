from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RolloutRequest(_message.Message):
    __slots__ = ("job_id", "environment", "num_prompts", "group_size", "effort", "weight_version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    EFFORT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    environment: str
    num_prompts: int
    group_size: int
    effort: str
    weight_version: int
    def __init__(self, job_id: _Optional[str] = ..., environment: _Optional[str] = ..., num_prompts: _Optional[int] = ..., group_size: _Optional[int] = ..., effort: _Optional[str] = ..., weight_version: _Optional[int] = ...) -> None: ...

class RolloutAck(_message.Message):
    __slots__ = ("accepted", "worker_id")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    worker_id: str
    def __init__(self, accepted: _Optional[int] = ..., worker_id: _Optional[str] = ...) -> None: ...

class RolloutStatusRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class RolloutStatusResponse(_message.Message):
    __slots__ = ("running", "paused", "finished", "weight_version", "published", "admitted_limit", "state", "message")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_LIMIT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    running: int
    paused: int
    finished: int
    weight_version: int
    published: int
    admitted_limit: int
    state: str
    message: str
    def __init__(self, running: _Optional[int] = ..., paused: _Optional[int] = ..., finished: _Optional[int] = ..., weight_version: _Optional[int] = ..., published: _Optional[int] = ..., admitted_limit: _Optional[int] = ..., state: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("id", "job_id", "group_id", "prompt_ids", "output_ids", "behaviour_logprobs", "versions", "reward", "environment", "effort", "loss_mask", "problem_id", "group_size", "verifier_score", "penalty", "reward_reason", "domain", "finish_reason", "worker_id", "pauses", "token_budget")
    ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOUR_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    EFFORT_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_SCORE_FIELD_NUMBER: _ClassVar[int]
    PENALTY_FIELD_NUMBER: _ClassVar[int]
    REWARD_REASON_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PAUSES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    id: str
    job_id: str
    group_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    behaviour_logprobs: _containers.RepeatedScalarFieldContainer[float]
    versions: _containers.RepeatedScalarFieldContainer[int]
    reward: float
    environment: str
    effort: str
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    problem_id: str
    group_size: int
    verifier_score: float
    penalty: float
    reward_reason: str
    domain: str
    finish_reason: str
    worker_id: str
    pauses: int
    token_budget: int
    def __init__(self, id: _Optional[str] = ..., job_id: _Optional[str] = ..., group_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., output_ids: _Optional[_Iterable[int]] = ..., behaviour_logprobs: _Optional[_Iterable[float]] = ..., versions: _Optional[_Iterable[int]] = ..., reward: _Optional[float] = ..., environment: _Optional[str] = ..., effort: _Optional[str] = ..., loss_mask: _Optional[_Iterable[int]] = ..., problem_id: _Optional[str] = ..., group_size: _Optional[int] = ..., verifier_score: _Optional[float] = ..., penalty: _Optional[float] = ..., reward_reason: _Optional[str] = ..., domain: _Optional[str] = ..., finish_reason: _Optional[str] = ..., worker_id: _Optional[str] = ..., pauses: _Optional[int] = ..., token_budget: _Optional[int] = ...) -> None: ...

class WeightVersion(_message.Message):
    __slots__ = ("job_id", "version", "path", "accepted", "final")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    version: int
    path: str
    accepted: int
    final: bool
    def __init__(self, job_id: _Optional[str] = ..., version: _Optional[int] = ..., path: _Optional[str] = ..., accepted: _Optional[int] = ..., final: _Optional[bool] = ...) -> None: ...

class DeadLetter(_message.Message):
    __slots__ = ("topic", "partition", "offset", "value", "reason")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    offset: int
    value: bytes
    reason: str
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., offset: _Optional[int] = ..., value: _Optional[bytes] = ..., reason: _Optional[str] = ...) -> None: ...
