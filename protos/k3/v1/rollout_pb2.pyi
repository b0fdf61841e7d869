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
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    def __init__(self, accepted: _Optional[int] = ...) -> None: ...

class RolloutStatusRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class RolloutStatusResponse(_message.Message):
    __slots__ = ("running", "paused", "finished", "weight_version")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    running: int
    paused: int
    finished: int
    weight_version: int
    def __init__(self, running: _Optional[int] = ..., paused: _Optional[int] = ..., finished: _Optional[int] = ..., weight_version: _Optional[int] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("id", "job_id", "group_id", "prompt_ids", "output_ids", "behaviour_logprobs", "versions", "reward", "environment", "effort")
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
    def __init__(self, id: _Optional[str] = ..., job_id: _Optional[str] = ..., group_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., output_ids: _Optional[_Iterable[int]] = ..., behaviour_logprobs: _Optional[_Iterable[float]] = ..., versions: _Optional[_Iterable[int]] = ..., reward: _Optional[float] = ..., environment: _Optional[str] = ..., effort: _Optional[str] = ...) -> None: ...
