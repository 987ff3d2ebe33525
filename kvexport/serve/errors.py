# SPDX-License-Identifier: Apache-2.0
"""OpenAI-style API errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

The types follow OpenAI's: ``invalid_request_error`` (400 bad request, 404 unknown model or route, 405 method),
``server_overloaded`` (503: the queue is full or the server is draining), ``server_error`` (500).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class APIError(Exception):
    """A request the server refuses: ``status`` (HTTP), ``message`` (one line), OpenAI ``type``/``param``/``code``."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400 invalid_request_error."""
    return APIError(400, message, "invalid_request_error", param, code)


__all__ = ["APIError", "bad_request"]
