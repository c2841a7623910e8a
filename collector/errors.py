"""The collector's HTTP error answer, raised by the receiver (server.py) and the query API (api.py)."""

from __future__ import annotations


class HTTPProblem(Exception):
    """An error answer: status, message, optional headers."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}
