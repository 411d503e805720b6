"""An OpenAI-compatible HTTP server with speculative decoding and continuous batching.

- :mod:`.protocol`: request parsing and validation, response and error JSON.
- :mod:`.scheduler`: the engine thread: continuous batching and the batch-aware draft-length policy.
- :mod:`.metrics`: Prometheus metrics, named like vLLM's.
- :mod:`.api_server`: the FastAPI app and the ``verispec serve`` command.
"""
