"""The output projection (lm_head) for the readout rows of a pass, fast on CPU.

A decode or verify pass reads out 1 to ~16 rows, and the projection onto a large vocabulary
(49152 x 576 for SmolLM2, a third of its weights) is then a skinny matrix product that MKL's
default `linear` handles badly (`python -m bench.readout` measures both, the weight evicted
from cache between calls as in a real pass). The packed product (linear.py) reads the weight
once for all rows, with one packed copy (none for a tied embedding in its file's blocks: the
readout streams those). The result is the same product up to float summation order. Elsewhere (CUDA, other dtypes) the module runs as is.
"""

from __future__ import annotations

import torch

from .linear import pack, packed_linear


class Readout:
    def __init__(self, head: torch.nn.Module):
        self.head = head
        self.packed = pack(head)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return self.head(hidden)
        return packed_linear(hidden, self.packed)
