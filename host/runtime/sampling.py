"""Token choice on the host, so logits never cross into the guest for a plain decode step.

The Sampler draws with the epilogue's own sampling rule and uniforms (host/epilogue/ops/
sampling.py `sample_logits`, keyed by seed and position), so a seeded guest-driven decode
draws the same tokens as a device loop running `p.sample(...)`.
"""

from __future__ import annotations

import torch

from ..epilogue.tensors import Stream, argmax as _argmax, uniforms
from ..epilogue.ops.layout import scatter_add
from ..epilogue.ops.sampling import Penalties, penalize, sample_logits
from ..errors import InvalidArgument


def argmax(logits: torch.Tensor) -> list[int]:
    """One id per row; ties go to the lowest id, as in HF greedy generation."""
    return _argmax(logits, -1).tolist()


def greedy(logits: torch.Tensor, position: int) -> list[int]:
    """argmax as a pass's `choose`."""
    return argmax(logits)


class Context:
    """What a pass's penalties count: row r counts tokens[:ends[r]] (the working set's tokens
    before the pass, then the window's)."""

    def __init__(self, tokens: list[int], ends: list[int]):
        self.tokens, self.ends = tokens, ends


class Sampler:
    """The one sampling rule (the logit bias, the penalties, temperature, top-k, min-p, the
    top-p nucleus); a pass's draws are keyed by the sampler's seed and the position of the pass's
    last readout row (tensors.draw_seed), as a `sample` op's and, for that row, verify_sample's."""

    def __init__(self, temperature: float, top_p: float, seed: int, top_k: int = 0, min_p: float = 0.0,
                 bias: dict[int, float] | None = None, penalties: Penalties | None = None):
        if not temperature >= 0:
            raise InvalidArgument(f"temperature {temperature} must be >= 0")
        if not 0 < top_p <= 1:
            raise InvalidArgument(f"top-p {top_p} must be in (0, 1]")
        if not 0 <= min_p <= 1:
            raise InvalidArgument(f"min-p {min_p} must be in [0, 1]")
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.top_k = int(top_k)
        self.min_p = float(min_p)
        self.seed = int(seed)
        self.bias = dict(sorted((bias or {}).items()))  # token id -> added to its logit, first
        why = penalties.problem() if penalties is not None else None
        if why:
            raise InvalidArgument(why)
        self.penalties = penalties if penalties is not None and penalties.active else None

    def sample(self, logits: torch.Tensor, position: int, context: Context | None = None) -> list[int]:
        """One id per row of `logits` [rows, V], the readout rows of a pass whose last readout row is
        at `position` (Pass.draw_position); `context` is what the penalties count (needed when
        there are any)."""
        if self.bias:
            rows = logits.shape[0]
            idx = torch.tensor(list(self.bias), dtype=torch.int64, device=logits.device).expand(rows, -1)
            val = torch.tensor(list(self.bias.values()), dtype=torch.float32, device=logits.device).expand(rows, -1)
            logits = scatter_add(logits.float(), idx, val)
        if self.penalties is not None:
            ctx = torch.tensor(context.tokens, dtype=torch.int64, device=logits.device)
            ends = torch.tensor(context.ends, dtype=torch.int64, device=logits.device)
            logits = penalize(logits.float()[None], ctx[None], ends[None], self.penalties)[0]
        if self.temperature == 0:
            return argmax(logits)
        u = uniforms(self.seed, position, Stream.SAMPLE, 0, list(logits.shape), logits.device)
        return sample_logits(logits.float(), self.temperature, self.top_p, u, self.top_k, self.min_p).tolist()
