"""The one error type of the HTTP API: a refused or failed request as OpenAI's error object."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A refused request: HTTP status and OpenAI's ``{"error": {message, type, param, code}}``."""

    TYPES = {
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        408: "timeout_error",
        429: "rate_limit_error",
        503: "service_unavailable",
        504: "timeout_error",
    }

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
