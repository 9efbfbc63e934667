"""Token choice on the host, so logits never cross into the guest for a plain decode step."""

from __future__ import annotations

import torch

from ..epilogue.kernels import argmax as _argmax
from ..errors import InvalidArgument


def argmax(logits: torch.Tensor) -> list[int]:
    """One id per row; ties go to the lowest id, as in HF greedy generation."""
    return _argmax(logits, -1).tolist()


class Sampler:
    """softmax(logits / temperature) cut to the top-p nucleus, drawn with its own seeded generator.

    The generator belongs to the sampler, so a run's draws do not depend on other runs.
    """

    def __init__(self, temperature: float, top_p: float, seed: int):
        if not temperature >= 0:
            raise InvalidArgument(f"temperature {temperature} must be >= 0")
        if not 0 < top_p <= 1:
            raise InvalidArgument(f"top-p {top_p} must be in (0, 1]")
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.seed = int(seed)
        self._gen: torch.Generator | None = None

    def sample(self, logits: torch.Tensor) -> list[int]:
        if self.temperature == 0:
            return argmax(logits)
        if self._gen is None:
            self._gen = torch.Generator(device=logits.device)
            self._gen.manual_seed(self.seed)
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p < 1:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # keep a token while the mass before it is below top-p: the first always stays
            keep = (sorted_p.cumsum(-1) - sorted_p) < self.top_p
            sorted_p = sorted_p * keep
            choice = torch.multinomial(sorted_p, 1, generator=self._gen)
            return order.gather(-1, choice).squeeze(-1).tolist()
        return torch.multinomial(probs, 1, generator=self._gen).squeeze(-1).tolist()
