"""Data plane: ModelWorker / pipeline-stage actors and the torch model they run.

Filled in by the model-execution issue; nothing here yet.
"""
