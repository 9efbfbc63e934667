"""Errors the host reports to users and inferlets. Each carries a one-line message that says what to do."""


class PieError(Exception):
    """Base class: a clear, user-facing error (never a crash)."""

    code = "error"


class InvalidArgument(PieError):
    code = "invalid-argument"


class BadHandle(PieError):
    code = "bad-handle"


class PoolExhausted(PieError):
    code = "out-of-pages"


class ContextOverflow(PieError):
    code = "context-overflow"


class ModelNotFound(PieError):
    code = "model-not-found"


class ImportFailed(PieError):
    code = "import-failed"
