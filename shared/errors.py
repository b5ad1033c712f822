"""Errors that travel: a code, a message, and the HTTP status the gateway answers with."""

from __future__ import annotations

from shared.messages import ErrorCode

HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.MODEL_NOT_FOUND: 404,
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: 400,
    ErrorCode.OVERLOADED: 429,
    ErrorCode.NO_CAPACITY: 503,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.ENGINE_FAILED: 503,
    ErrorCode.INSTANCE_NOT_LOADED: 503,
    ErrorCode.IMPORT_FAILED: 400,
    ErrorCode.TIMEOUT: 504,
    ErrorCode.PREEMPTED: 503,
    ErrorCode.MODEL_STARTING: 503,
}


class TesseraError(Exception):
    """Raised anywhere a request must end with an error the client can read."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s

    @property
    def status(self) -> int:
        return HTTP_STATUS[self.code]
