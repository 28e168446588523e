"""Errors the coordinator answers itself, in OpenAI's JSON error shape as vLLM writes it."""

from __future__ import annotations

import json
from http import HTTPStatus

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """An error for an HTTP client: status code, message and the offending parameter, if any."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | int | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = status if code is None else code

    def __reduce__(self):
        # Raised in decision worker processes too: rebuilt whole on the other side.
        return (OpenAIError, (self.status, self.message, self.param, self.code))

    @property
    def type(self) -> str:
        """vLLM's error type name for the status."""
        return _TYPES.get(self.status) or HTTPStatus(self.status).phrase.replace(" ", "") + "Error"

    def body(self) -> bytes:
        """`{"error": {"message", "type", "param", "code"}}` as JSON bytes."""
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return json.dumps({"error": error}).encode()
