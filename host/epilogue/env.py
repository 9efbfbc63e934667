"""What the executor reads per pass (Env) and hands back (Result), and the channel contract.

DeviceChannel is the one protocol every channel implements: the runtime's channels
(host/runtime/channels.py), SimpleChannel below (stand-alone use and tests), and what a device
loop reads and writes each round (host/engine/loop.py). The executor writes a channel's cells in
place and reports the new length in its Result; the loop, after its readback, gives the channel
that length (`set_length`) or hands the new cells to the channel's consumer (`stream`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol

import numpy as np
import torch


class DeviceChannel(Protocol):
    """A small typed buffer on the model's device.

    buf: [capacity] cells (int32/int64/float32/bool storage); host: the same memory as a numpy
    array where it is host memory, else None; capacity: len(buf) as a host int; length: the cells
    in use (a host int, or a 0-d int64 tensor for a channel used stand-alone with the executor).

    lock: held by a device loop for a whole round (its epilogue writes the cells, its bookkeeping
    the length). Lock order: a loop takes the locks of all its channels at once, sorted by id()
    (DeviceLoop.locks), so loops sharing channels cannot deadlock; anything else holds one
    channel's lock at a time and calls no loop while holding it.
    sink: None, or the consumer of the cells a loop appends (they are streamed, not kept)."""

    buf: torch.Tensor
    host: np.ndarray | None
    capacity: int
    length: int | torch.Tensor
    lock: threading.Condition
    sink: Callable[[list], None] | None

    def set_length(self, n: int | torch.Tensor) -> None:
        """After a round (lock held): `n` cells are in use; wakes a waiting reader when cells arrive."""

    def stream(self, cells: list) -> None:
        """After a round (lock held): hand the round's new cells to the sink; none stay in the channel."""


class GrammarMatcher(Protocol):
    """A sequence's place in a grammar, as the grammar ops use it (host/grammar's Matcher; the
    executor never imports a grammar engine). Its calls run on the host."""

    def window_masks(self, window: list[int]) -> np.ndarray:
        """bool [W, V]: row 0 the tokens allowed now, row j those allowed after window[1..j];
        all false from the first draft the grammar forbids on. The state is unchanged."""

    def commit(self, tokens: list[int], at: int) -> None:
        """Consume tokens (raising InvalidArgument for one the grammar forbids); a second commit
        for the same window position `at` changes nothing (a retried run)."""

    def forced_tokens(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next."""


# draws(bs, j): [len(bs), draft_vocab_size] uniforms for draft j of passes bs (made on demand)
DraftDraws = Callable[[list[int], int], torch.Tensor]


class DraftRunner(Protocol):
    """A draft head attached to the model, run by the host over its own KV rows (the engine's
    HeadRunner); the executor never imports its model code. `state` objects are its per-working-set
    bindings (DraftBinding.state)."""

    vocab_size: int  # the target's vocabulary: drafts and probabilities index it
    draft_vocab_size: int  # the ids the head drafts from (its uniforms per draft)
    draft_ids: torch.Tensor | None  # head output index -> target id (None: the identity)

    def propose(self, states: list, hidden: torch.Tensor, tokens: torch.Tensor, counts: list[int], k: int,
                temperature: float, uniforms: DraftDraws | None,
                limits: list[int] | None = None, min_prob: float = 0.0) -> tuple[torch.Tensor, list[int]]:
        """For each pass b: the head's KV rows for its window rows [0, counts[b]) (hidden[b, r]
        paired with tokens[b, r], the token that follows row r), then its chain to k drafts: argmax
        (temperature <= 0) or drawn from the tempered head distribution with uniforms([b], j); pass b's
        chain stops at limits[b] drafts, and before a draft whose probability under the head's
        softmax (temperature 1) is below min_prob. With limits[b] == 0 the rows may wait (their inputs kept)
        to be written with those of the pass's next drafting round, before the head reads them.
        Returns drafts [B, k] (padded with -1) and their numbers; keeps each pass's
        draft distributions for `probs`. Running the same pass again gives the same result."""

    def probs(self, state, drafts: list[int]) -> torch.Tensor:
        """f32 [k, V]: the distributions the head drew `drafts` (its last proposal) from."""


class DraftBinding(Protocol):
    """A draft head bound to one pass's working set (Env.drafters, by the head's name)."""

    runner: DraftRunner
    state: object


class SuffixSource(Protocol):
    """The suffix index of a pass's namespace (the engine's SuffixIndex), for `suffix_draft`; the
    executor never imports it. Its lookups run on the host."""

    def draft(self, context: list[int], k: int, *, max_match: int, factor: float, min_prob: float,
              min_match: int):
        """An object with `tokens` (at most k drafts for what follows context) and `score` (their
        expected accepted tokens by the index's counts)."""


@dataclass
class SimpleChannel:
    """The minimal DeviceChannel: a buffer and a length (stand-alone executor use, tests)."""

    buf: torch.Tensor
    length: int | torch.Tensor
    host: np.ndarray | None = None
    sink: Callable[[list], None] | None = None

    @property
    def capacity(self) -> int:
        return self.buf.shape[0]

    @property
    def lock(self) -> threading.Condition:  # made on first use: a copied channel gets its own
        lk = self.__dict__.get("_lock")
        if lk is None:
            lk = self.__dict__["_lock"] = threading.Condition()
        return lk

    def set_length(self, n: int | torch.Tensor) -> None:
        self.length = n

    def stream(self, cells: list) -> None:
        self.sink(cells)
        self.length = 0

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
    matchers: Mapping[str, GrammarMatcher] = field(default_factory=dict)
    drafters: Mapping[str, DraftBinding] = field(default_factory=dict)
    suffix: SuffixSource | None = None  # the namespace's suffix index; None: suffix_draft drafts nothing
    seed: int = 0
    round: int = 0
    window_len: int | None = None
    vocab: int | None = None  # the model's vocabulary: binds V for a program that reads no logits
    position: int = 0  # the absolute position of the window's first row: verify_sample keys row r by position + r
    # the absolute position of the pass's last readout row: `sample` and `rand` key their draws by
    # it, as verify_sample keys that row's (None: position)
    draw_position: int | None = None


@dataclass
class ChannelWrite:
    buf: torch.Tensor  # the channel's buffer, already written in place
    length: int | torch.Tensor  # the new length: a host int where the host can know it, else 0-d int64
    overflow: bool | torch.Tensor  # cells were dropped because the channel was full


@dataclass
class Result:
    """Host values where the host knows them, else device tensors; reading those on the host
    is the one sync per batch."""

    fold: int | torch.Tensor | None = None  # clamped to [0, W]; None: the program has no fold
    stop: bool | torch.Tensor | None = None  # None: the program has no stop
    channels: dict[str, ChannelWrite] = field(default_factory=dict)
    values: list[torch.Tensor] | None = None  # every SSA value, when run(keep_values=True)


def host_length(ch: DeviceChannel) -> int:
    """A channel's length as a host int. The device loop always passes host lengths; a 0-d
    tensor length (stand-alone use of the executor) is read here, which syncs."""
    n = ch.length
    return n if isinstance(n, int) else int(n)


def apply_writes(result: Result, channels: Mapping[str, DeviceChannel]) -> None:
    """Give the channels their new lengths (the cells were written in place by the run)."""
    for name, w in result.channels.items():
        channels[name].set_length(w.length)
