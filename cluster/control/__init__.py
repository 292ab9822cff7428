"""The Ray control plane: the ``SchedulerActor`` (routing, P/D hand-off, moves on failure,
pools resized at run time), one ``EngineLoop`` per instance, executors, the ``Router``, the
batched client streams (``clients``), worker placement, recovery, LoRA adapters by name,
launch helpers, and ``ClusterClient`` (the ``EngineClient`` of a cluster).
"""
