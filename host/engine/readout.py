"""The output projection (lm_head) for the readout rows of a pass, fast on CPU.

A decode or verify pass reads out 1 to ~16 rows, and the projection onto a large vocabulary
(49152 x 576 for SmolLM2, a third of its weights) is then a skinny matrix product that MKL's
default `linear` handles badly: measured here (`python -m bench.readout`, the weight evicted
from cache between calls as in a real pass), 8.7 ms for one row and ~21 ms for 2 to 16 rows,
against 5.8 ms for one row and 7.3 ms for eight through oneDNN with the weight prepacked (see
`linear.py`). The result is the same product up to float summation order. Elsewhere (CUDA,
other dtypes) the module runs as is.
"""

from __future__ import annotations

import torch

from .linear import pack, packed_linear


class Readout:
    def __init__(self, head: torch.nn.Module):
        self.head = head
        self.packed = pack(head)  # one extra copy of the weight, in oneDNN's layout

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return self.head(hidden)
        return packed_linear(hidden, self.packed, self.head.bias)
