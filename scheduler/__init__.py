"""Plain-Python scheduling for jaxserve: requests, a paged KV block pool with prefix caching, and a
continuous-batching scheduler with chunked prefill and preemption. Stdlib only (DESIGN.md section 1).

The walkthrough of one step is at the top of `scheduler/scheduler.py`.
"""

from scheduler.block_pool import BlockPool
from scheduler.config import SchedulerConfig
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.outputs import (
    KVWaste,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
    StepResult,
    TokenLogprobs,
)
from scheduler.request import FinishReason, Request, RequestStatus
from scheduler.scheduler import Scheduler

__all__ = [
    "BlockPool",
    "FinishReason",
    "KVCacheManager",
    "KVWaste",
    "NewRequestData",
    "Request",
    "RequestStatus",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "StepResult",
    "TokenLogprobs",
]
