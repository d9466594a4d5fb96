"""The OpenAI-compatible HTTP server (`python -m entrypoints.openai.serve`).

- `serve`: the command line (every EngineConfig field is a flag) and `main`.
- `api_server`: the aiohttp app: routes, middleware, reading bodies, draining on SIGTERM.
- `server_config`: `ServerConfig` (the server's flags) and the default body limit.
- `response_writers`: a request's answer from its engine outputs: one JSON body, or an SSE stream.
- `http_guard`: per-connection guards: the request-head timeout, parser errors as OpenAI JSON.
- `prepare`: body -> Job on worker threads: parse, validate, tokenize, admission checks.
- `protocol`: request parsing and validation (JSON body -> request dataclass with SamplingParams).
- `responses`: response bodies and stream chunks.
"""
