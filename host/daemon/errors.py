"""The API's errors: each is one HTTP status and OpenAI's error body."""

from __future__ import annotations



class APIError(Exception):
    """Rendered as {"error": {"message", "type", "param", "code"}} with `status`."""

    status = 500
    type = "server_error"
    code: str | None = "internal_error"
    headers: dict[str, str] = {}

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class BadRequest(APIError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_value"


class Unauthorized(APIError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class UnknownModel(APIError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class NotFound(APIError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class Busy(APIError):
    """The server cannot take the request now: it is shutting down, or the page pool is full."""

    status = 503
    type = "server_error"
    code = "server_busy"


class TooManyRequests(APIError):
    """Every instance slot and queue place is taken, or the key has its most instances: try again
    after Retry-After seconds (OpenAI's clients do, by themselves). Named as OpenAI names its own."""

    status = 429
    type = "requests"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: int = 1, code: str | None = None):
        super().__init__(message, code=code)
        self.headers = {"Retry-After": str(retry_after)}


class QuotaExceeded(APIError):
    """A key holds its most uploads: not transient, so no Retry-After (unlike TooManyRequests)."""

    status = 429
    type = "requests"
    code = "upload_quota_exceeded"


class ClientGone(APIError):
    """The client closed its connection while its request waited: nobody reads the answer
    (499, as nginx logs it)."""

    status = 499
    type = "invalid_request_error"
    code = "client_closed_request"


class InstanceFailed(APIError):
    """The inferlet instance serving the request ended with an error."""

    status = 500
    type = "server_error"
    code = "inferlet_failed"


MESSAGE_CHARS = 2000  # of a failed run's message, in its API error


def from_instance_error(error: str, returned: bool = False) -> APIError:
    """A failed run's `code: message` as the API error a client should see: its own request's
    faults as 400, a full page pool or a shutdown as 503, anything else as 500. An error the
    inferlet returned itself (RunResult.returned) is 400: the SDK's inferlets return one only for
    arguments they refuse (UsageError), the client's mistake. The inferlet wrote the message: it is
    cut to MESSAGE_CHARS (a refused 1 MB argument must not come back whole)."""
    if len(error) > MESSAGE_CHARS:
        error = f"{error[:MESSAGE_CHARS]}... ({len(error) - MESSAGE_CHARS} more characters)"
    code, _, _ = error.partition(":")
    if code in ("context-overflow", "invalid-argument"):
        return BadRequest(error, code=code)
    if code in ("out-of-pages", "cancelled"):
        return Busy(error, code=code)
    if returned:
        return BadRequest(error, code="inferlet_usage")
    return InstanceFailed(error)


class TooLarge(APIError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class HeadersTooLarge(APIError):
    status = 431
    type = "invalid_request_error"
    code = "request_header_fields_too_large"


class RequestTimeout(APIError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"
