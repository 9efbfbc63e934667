"""Errors the host reports to users and inferlets. Each carries a one-line message that says what to do."""


class PieError(Exception):
    """Base class: a clear, user-facing error (never a crash)."""

    code = "error"
    limit = False  # a budget of the instance's was reached (not a fault): its output so far stands


class InvalidArgument(PieError):
    code = "invalid-argument"


class BadHandle(PieError):
    code = "bad-handle"


class PoolExhausted(PieError):
    code = "out-of-pages"


class QuotaExhausted(PoolExhausted):
    """The pool has pages, but not within the instance's (or its key's) share of it."""

    limit = True


class ContextOverflow(PieError):
    code = "context-overflow"


class ModelNotFound(PieError):
    code = "model-not-found"


class ImportFailed(PieError):
    code = "import-failed"


class Internal(PieError):
    """A failure no check foresaw (a host bug, or an input that slipped past validation):
    it ends the one instance it happened in, never the process."""

    code = "internal"


def unexpected(what: str, e: BaseException) -> PieError:
    """`e` as the error of one instance: PieErrors as they are, anything else as Internal naming `what`."""
    return e if isinstance(e, PieError) else Internal(f"{what} failed: {type(e).__name__}: {e}")


def detached(e: BaseException) -> BaseException:
    """`e` without its traceback and chained exceptions, for an error that is kept (a future's):
    their frames would keep the objects of whoever raised it alive, other instances' included."""
    e.__traceback__ = e.__cause__ = e.__context__ = None
    return e
