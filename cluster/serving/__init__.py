"""The front end: the Ray Serve app (``app``: FastAPI routes, the gRPC method), the
OpenAI-compatible logic (``openai_serving``: validate, run; ``openai_responses``: every
response shape), the protocol models, the gRPC servicer, API-key checks and API errors.
It talks to an engine only through ``cluster.engine.protocol.EngineClient``.
"""
