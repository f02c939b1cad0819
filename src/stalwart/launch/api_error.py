"""The master API's one error: an HTTP status and a message the caller can act on."""

from __future__ import annotations

from http import HTTPStatus


class ApiError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
