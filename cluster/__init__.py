"""Control plane: the in-process engine and CLI today; the SchedulerActor, EngineLoops, Router,
Serve app and ClusterConfig come with the cluster issues.
"""

from cluster.engine import LLMEngine
from cluster.llm import LLM
from cluster.outputs import CompletionOutput, RequestOutput
from scheduler import LoRARequest, SamplingParams

__all__ = ["LLM", "CompletionOutput", "LLMEngine", "LoRARequest", "RequestOutput", "SamplingParams"]
