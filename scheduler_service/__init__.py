"""stepwire scheduler: queues, the unified token-budget scheduler and the paged KV block pool.

Pure Python by design: a scheduler image carries no torch.
"""

from scheduler_service.config import SchedulerConfig
from scheduler_service.errors import InvalidRequestError
from scheduler_service.output import (
    CachedRequestData,
    NewRequestData,
    RequestDelta,
    RunnerOutput,
    SchedulerOutput,
)
from scheduler_service.request import Request, RequestStatus, SamplingParams
from scheduler_service.scheduler import Scheduler, SchedulerStats

__all__ = [
    "CachedRequestData", "InvalidRequestError", "NewRequestData", "Request", "RequestDelta", "RequestStatus",
    "RunnerOutput", "SamplingParams", "Scheduler", "SchedulerConfig", "SchedulerOutput", "SchedulerStats",
]
