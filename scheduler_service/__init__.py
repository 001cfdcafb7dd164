"""stepwire scheduler: queues, the unified token-budget scheduler and the paged KV block pool.

Pure Python by design: a scheduler image carries no torch, and the core needs no gRPC.
"""

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.output import (
    CachedRequestData,
    NewRequestData,
    RequestDelta,
    RunnerOutput,
    SchedulerOutput,
    SchedulerStats,
)
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.scheduler import Scheduler

__all__ = ["CachedRequestData", "NewRequestData", "Request", "RequestDelta", "RequestStatus", "RunnerOutput",
           "Scheduler", "SchedulerConfig", "SchedulerOutput", "SchedulerStats"]
