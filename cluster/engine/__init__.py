"""The in-process engine: ``LLMEngine`` (one scheduler and one worker, vLLM's
``add_request`` / ``step``), ``LLM`` (batch and streaming on top), the input side
(``frontend``: tokenize, validate, ``n`` fan-out), the output side (``outputs``:
detokenize, stop strings), and ``protocol.EngineClient``, the contract serving code calls.
"""
