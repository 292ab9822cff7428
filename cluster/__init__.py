"""Control plane: SchedulerActor, EngineLoop, Router, Serve app, CLI.

Filled in by the Ray cluster and Serve issues; nothing here yet.
"""
