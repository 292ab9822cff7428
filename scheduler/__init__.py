"""Tandem's scheduler: vLLM-v1 scheduling over a paged, prefix-cached KV cache.

Pure Python (standard library + pydantic): importable, testable and simulatable in
milliseconds, with no torch and no ray.
"""

from scheduler.block_pool import BlockPool, KVCacheBlock
from scheduler.config import CacheConfig, LoRAConfig, SchedulerConfig
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.kv_cache_utils import KVCacheBlocks, PrefixCacheStats
from scheduler.kv_connector import SchedulerConnector
from scheduler.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from scheduler.queues import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    RequestQueue,
    create_request_queue,
)
from scheduler.request import (
    FinishReason,
    LoRARequest,
    Request,
    RequestStatus,
    SamplingParams,
    StructuredOutputsParams,
)
from scheduler.scheduler import Scheduler

__all__ = [
    "BlockPool",
    "CacheConfig",
    "CachedRequestData",
    "EngineCoreOutput",
    "FCFSRequestQueue",
    "FinishReason",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheManager",
    "LoRAConfig",
    "LoRARequest",
    "ModelRunnerOutput",
    "NewRequestData",
    "PrefixCacheStats",
    "PriorityRequestQueue",
    "Request",
    "RequestQueue",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerConnector",
    "SchedulerOutput",
    "SchedulerStats",
    "StructuredOutputsParams",
    "create_request_queue",
]
