"""The Ray control plane: the ``SchedulerActor`` (routing, P/D hand-off, moves on failure),
one ``EngineLoop`` per instance, executors, the ``Router``, worker placement, recovery, LoRA
adapters by name, launch helpers, and ``ClusterClient`` (the ``EngineClient`` of a cluster).
"""
