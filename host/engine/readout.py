"""The output projection (lm_head) for the few readout rows of a pass, fast on CPU.

A decode or verify pass reads out 1 to ~16 rows, and the projection onto a large vocabulary
(49152 x 576 for SmolLM2, a third of its weights) is then a skinny matrix product that BLAS
handles badly on CPU in its default form: measured here (`python -m bench.readout`), `linear`
takes 8.0 ms for one row and 21.0 ms for nine, while one row against a transposed copy of the
weight takes 4.5 ms and `weight @ rows.T` takes 12.6 ms for nine. The result is the same
product up to float summation order. Elsewhere (CUDA, other dtypes) the module runs as is.
"""

from __future__ import annotations

import torch

MAX_SKINNY = 64  # beyond this many rows plain `linear` is as fast (prefill readouts)


class Readout:
    def __init__(self, head: torch.nn.Module):
        self.head = head
        w = getattr(head, "weight", None)
        self.fast = (isinstance(head, torch.nn.Linear) and w.device.type == "cpu" and w.dtype == torch.float32
                     and w.is_contiguous())
        # one extra copy of the weight, laid out [hidden, vocab] for the one-row product
        self.weight_t = w.detach().t().contiguous() if self.fast else None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0]
        if not self.fast or rows > MAX_SKINNY:
            return self.head(hidden)
        w = self.head.weight
        if rows == 1:
            out = hidden @ self.weight_t
        else:
            out = torch.mm(w, hidden.t()).t().contiguous()
        if self.head.bias is not None:
            out = out + self.head.bias
        return out
