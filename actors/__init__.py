"""The data plane: ``ModelWorker`` and its pipeline stages (``worker``, ``pipeline``), the
sampler, multi-LoRA, and the torch model they run (``actors.model``: a Llama-family decoder
over a paged KV cache, GGUF and safetensors loading, the tokenizer, the CPU attention kernel).

Plain classes: ``cluster.control.placement`` wraps the worker in a Ray actor.
"""
