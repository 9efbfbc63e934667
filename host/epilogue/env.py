"""What the executor reads per pass (Env) and what it hands back (Result).

Channels are duck-typed (DeviceChannel): any object with `.buf`, a 1-D device
tensor whose length is the channel's capacity, and `.length`, the number of cells
in use: a host int (what the device loop passes: it knows every length after its
readback) or a 0-d int64 tensor (read on the host, a sync). The executor writes
channel buffers in place; a Result carries the new lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol

import numpy as np
import torch


class DeviceChannel(Protocol):
    buf: torch.Tensor  # [capacity], any of int32/int64/float32/bool
    length: int | torch.Tensor  # a host int, or a 0-d int64 tensor
    host: np.ndarray | None  # optional: buf's memory as a numpy array, where it is host memory
    capacity: int  # optional: len(buf), as a host int


@dataclass
class SimpleChannel:
    """A minimal DeviceChannel (tests, and a reference for adapters)."""

    buf: torch.Tensor
    length: int | torch.Tensor
    host: np.ndarray | None = None

    @staticmethod
    def empty(capacity: int, dtype=torch.int64, device="cpu") -> "SimpleChannel":
        return SimpleChannel(torch.zeros(capacity, dtype=dtype, device=device), 0)


@dataclass
class Env:
    """One pass's inputs; tensors live on the model's device, seed and round are host ints.
    In host memory, logits, hidden and draft_logits may be given as float32 numpy arrays.

    logits: [R, V] f32 for the readout rows; hidden: [R, H]; draft_logits: [R, K, V].
    window: [W] token ids of this round's window (or give window_len when the program
    does not read the window but must bound its fold). history: [N] committed tokens.
    """

    logits: torch.Tensor | np.ndarray | None = None
    window: torch.Tensor | None = None
    history: torch.Tensor | None = None
    hidden: torch.Tensor | np.ndarray | None = None
    draft_logits: torch.Tensor | np.ndarray | None = None
    channels: Mapping[str, DeviceChannel] = field(default_factory=dict)
    seed: int = 0
    round: int = 0
    window_len: int | None = None


@dataclass
class ChannelWrite:
    buf: torch.Tensor  # the channel's buffer, already written in place
    length: int | torch.Tensor  # the new length: a host int where the host can know it, else 0-d int64
    overflow: bool | torch.Tensor  # cells were dropped because the channel was full


@dataclass
class Result:
    """Host values where the program fixes them (a constant fold), else device tensors;
    reading those on the host is the one sync per batch."""

    fold: int | torch.Tensor | None = None  # clamped to [0, W]
    stop: torch.Tensor | None = None  # 0-d bool
    channels: dict[str, ChannelWrite] = field(default_factory=dict)
    values: list[torch.Tensor] | None = None  # every SSA value, when run(keep_values=True)


def host_length(ch: DeviceChannel) -> int:
    """A channel's length as a host int. The device loop always passes host counts; a 0-d
    tensor length (stand-alone use of the executor) is read here, which syncs."""
    n = ch.length
    return n if isinstance(n, int) else int(n)


def apply_writes(result: Result, channels: Mapping[str, DeviceChannel]) -> None:
    """Give the channels their new lengths (the cells were written in place by the run)."""
    for name, w in result.channels.items():
        channels[name].length = w.length
