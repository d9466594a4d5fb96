"""ProtocolError: an error the server answers in OpenAI's format.

It carries the HTTP status, OpenAI's error `type` and `code`, and the `param` (the field) at
fault, so the server answers `{"error": {message, type, param, code}}`. Its own module, below the
parsers that raise it (protocol.py, constraints.py, tools.py) and the server that answers it
(api_server.py, response_writers.py).
"""

from __future__ import annotations

from engine.errors import ParamError


class ProtocolError(Exception):
    """An error answered in OpenAI's format."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.headers = headers or {}
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.code = code

    @classmethod
    def from_param_error(cls, exc: ParamError) -> ProtocolError:
        return cls(str(exc), param=exc.param)

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
