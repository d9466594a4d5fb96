"""The OpenAI-compatible HTTP server (`python -m entrypoints.openai.serve`).

- `serve`: the command line (every EngineConfig field is a flag) and `main`.
- `api_server`: the aiohttp app: routes, middleware, streaming, draining on SIGTERM.
- `protocol`: request parsing and validation (JSON body -> request dataclass with SamplingParams).
- `responses`: response bodies and stream chunks.
"""
