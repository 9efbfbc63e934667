"""Channels: small typed buffers on the model's device, shared by an inferlet, its passes and epilogues.

A channel holds up to `capacity` cells in order. `put` appends, `read` copies without
consuming, `take` consumes everything. A device loop registers itself as a producer with
`attach_producer`; while one is attached, `take` on an empty open channel waits for cells.
Channel implements the device loop's contract, DeviceChannel (host/epilogue/env.py): its
lock, lock order, `set_length` and `stream`.
"""

from __future__ import annotations

import threading

import torch

from ..epilogue.ir import MAX_CHANNEL_CAPACITY
from ..errors import InvalidArgument
from .errors import ChannelClosed, ChannelFull


# WIT element-type name -> (torch storage dtype, Python cell type). u32 is stored as int64:
# token ids index embeddings directly and torch's uint32 supports few ops.
ELEMENTS = {
    "uint32": (torch.int64, int),
    "int32": (torch.int32, int),
    "float32": (torch.float32, float),
    "boolean": (torch.bool, bool),
}


class Channel:
    def __init__(self, element: str, capacity: int, device: torch.device):
        if element not in ELEMENTS:
            raise InvalidArgument(f"unknown channel element type {element!r}")
        if not 0 < capacity <= MAX_CHANNEL_CAPACITY:
            raise InvalidArgument(f"channel capacity {capacity} must be in 1..{MAX_CHANNEL_CAPACITY}")
        self.element = element
        self.capacity = capacity
        self.buf = torch.zeros(capacity, dtype=ELEMENTS[element][0], device=device)
        # the same memory as a numpy array where it is host memory: the device loop reads and
        # writes a few cells a round, and numpy's indexing costs a fraction of torch's
        self.host = self.buf.numpy() if self.buf.device.type == "cpu" else None
        self.length = 0  # cells in use
        self.closed = False
        self.producers = 0
        self.error: BaseException | None = None  # a failed producer's error, reported by take
        self.sink = None  # callable(cells): the host consumes what a device loop appends (runtime.emit-channel)
        self._cv = threading.Condition()

    @property
    def lock(self) -> threading.Condition:
        """Held by a device loop for a round, and by every method here (see DeviceChannel)."""
        return self._cv

    def set_length(self, n: int) -> None:
        """The device loop's: after a round, `n` cells are in use (lock held)."""
        if n and not self.length:  # only a take on an empty channel waits: wake it when cells arrive
            self._cv.notify_all()
        self.length = n

    def stream(self, cells: list) -> None:
        """The device loop's: the round's new cells go to the sink, none stay (lock held)."""
        self.length = 0
        self.sink(cells)

    def _check_values(self, values: list) -> None:
        if self.element == "uint32" and any(v < 0 or v >= 1 << 32 for v in values):
            raise InvalidArgument("u32 channel cells must be in 0..2^32-1")

    def put(self, values: list) -> None:
        self._check_values(values)
        self.put_tensor(torch.tensor(values, dtype=self.buf.dtype))

    def put_tensor(self, values: torch.Tensor) -> None:
        """Append a 1-D tensor of cells (host or device)."""
        n = values.numel()
        with self._cv:
            if self.closed:
                raise ChannelClosed("the channel is closed")
            if self.length + n > self.capacity:
                raise ChannelFull(f"{n} cells do not fit: {self.length} of {self.capacity} are in use")
            self.buf[self.length:self.length + n] = values.to(self.buf.device, self.buf.dtype)
            self.length += n
            self._cv.notify_all()

    def read(self, start: int, count: int) -> list:
        with self._cv:
            if start < 0 or count < 0 or start + count > self.length:
                raise InvalidArgument(f"read [{start}, {start + count}) is past the {self.length} cells in the channel")
            return self.buf[start:start + count].tolist()

    def take(self, timeout: float | None = None) -> list:
        """All cells now in the channel; waits while it is empty and a producer is attached.
        Once empty, a failed producer's error is raised (after its cells were taken)."""
        with self._cv:
            while self.length == 0 and not self.closed and self.producers > 0:
                if not self._cv.wait(timeout):
                    break
            if self.length == 0 and self.error is not None:
                raise self.error
            values = self.buf[:self.length].tolist()
            self.length = 0
            return values

    def __len__(self) -> int:
        return self.length

    def close(self) -> None:
        with self._cv:
            self.closed = True
            self._cv.notify_all()

    def attach_producer(self) -> None:
        with self._cv:
            self.producers += 1

    def detach_producer(self, error: BaseException | None = None) -> None:
        with self._cv:
            self.producers -= 1
            if error is not None:
                self.error = error
            self._cv.notify_all()
