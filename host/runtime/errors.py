"""Errors of the runtime's own primitives, beside the engine's in host.errors."""

from ..errors import InvalidArgument, PieError


class Unsupported(PieError):
    code = "unsupported"


class ChannelFull(PieError):
    code = "channel-full"


class ChannelClosed(PieError):
    code = "channel-closed"


class InferletError(PieError):
    """An inferlet could not be loaded or ended with an error (trap, limit, guest error)."""

    code = "inferlet-failed"


class GuestError(InferletError):
    """The error the inferlet's `run` returned: its own words (the SDK's inferlets return one
    only for arguments they refuse), not the host's."""


class BudgetExceeded(InvalidArgument):
    """A request past one of the instance's budgets (host/runtime/limits.py): the guest may
    release something and retry, so it is the WIT's invalid-argument, naming the flag."""

    limit = True


class Cancelled(PieError):
    """The run was cancelled (Runtime.cancel, its wall-time or log limit): it ends at once."""

    code = "cancelled"
