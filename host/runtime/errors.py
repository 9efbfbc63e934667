"""Errors of the runtime's own primitives, beside the engine's in host.errors."""

from ..errors import PieError


class Unsupported(PieError):
    code = "unsupported"


class ChannelFull(PieError):
    code = "channel-full"


class ChannelClosed(PieError):
    code = "channel-closed"


class InferletError(PieError):
    """An inferlet could not be loaded or ended with an error (trap, limit, guest error)."""

    code = "inferlet-failed"
