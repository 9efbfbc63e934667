"""The output projection (lm_head) for the readout rows of a pass, fast on CPU.

A decode or verify pass reads out 1 to ~16 rows, and the projection onto a large vocabulary
(49152 x 576 for SmolLM2, a third of its weights) is then a skinny matrix product that MKL's
default `linear` handles badly (`python -m bench.readout` measures both, the weight evicted
from cache between calls as in a real pass). The packed product (linear.py) reads the weight
once for all rows. It keeps one packed copy: a readout of more than SKINNY_ROWS rows (rare:
a distribution test's whole window) reads the module's own weight. The result is the same
product up to float summation order. Elsewhere (CUDA, other dtypes) the module runs as is.
"""

from __future__ import annotations

import torch

from .linear import pack, packed_linear


class Readout:
    def __init__(self, head: torch.nn.Module, blocked: bool = False):
        """blocked: keep a oneDNN copy too, for more than SKINNY_ROWS rows (a benchmark's baseline)."""
        self.head = head
        self.packed = pack(head, blocked)  # one extra copy of the weight (two if blocked)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return self.head(hidden)
        return packed_linear(hidden, self.packed)
