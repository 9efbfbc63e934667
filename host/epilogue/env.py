"""What the executor reads per pass (Env) and what it hands back (Result).

Channels are duck-typed (DeviceChannel): any object with `.buf`, a 1-D device
tensor whose length is the channel's capacity, and `.length`, a 0-d int64
device tensor. The runtime's guest-facing channels adapt to this.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol

import torch


class DeviceChannel(Protocol):
    buf: torch.Tensor  # [capacity], any of int32/int64/float32/bool
    length: torch.Tensor  # 0-d int64


@dataclass
class SimpleChannel:
    """A minimal DeviceChannel (tests, and a reference for adapters)."""

    buf: torch.Tensor
    length: torch.Tensor

    @staticmethod
    def empty(capacity: int, dtype=torch.int64, device="cpu") -> "SimpleChannel":
        return SimpleChannel(torch.zeros(capacity, dtype=dtype, device=device),
                             torch.zeros((), dtype=torch.int64, device=device))


@dataclass
class Env:
    """One pass's inputs; tensors live on the model's device, seed and round are host ints.

    logits: [R, V] f32 for the readout rows; hidden: [R, H]; draft_logits: [R, K, V].
    window: [W] token ids of this round's window (or give window_len when the program
    does not read the window but must bound its fold). history: [N] committed tokens.
    """

    logits: torch.Tensor | None = None
    window: torch.Tensor | None = None
    history: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    draft_logits: torch.Tensor | None = None
    channels: Mapping[str, DeviceChannel] = field(default_factory=dict)
    seed: int = 0
    round: int = 0
    window_len: int | None = None


@dataclass
class ChannelWrite:
    buf: torch.Tensor  # [capacity] in the channel buffer's dtype: the full new contents
    length: torch.Tensor  # 0-d int64: the new length
    overflow: torch.Tensor  # 0-d bool: cells were dropped because the channel was full


@dataclass
class Result:
    """Device tensors only; reading any of them on the host is the one sync per batch."""

    fold: torch.Tensor | None = None  # 0-d int64, clamped to [0, W]
    stop: torch.Tensor | None = None  # 0-d bool
    channels: dict[str, ChannelWrite] = field(default_factory=dict)
    values: list[torch.Tensor] | None = None  # every SSA value, when run(keep_values=True)


def apply_writes(result: Result, channels: Mapping[str, DeviceChannel]) -> None:
    """Copy a result's channel writes into the channels, in place, on the device (no sync)."""
    for name, w in result.channels.items():
        ch = channels[name]
        ch.buf.copy_(w.buf)
        ch.length.copy_(w.length)
