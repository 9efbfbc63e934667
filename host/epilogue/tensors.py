"""What the ops' torch implementations share: the batched context they run in, dtypes and fills,
seeded uniforms (keyed by seed and position), the exponential race, and a fast argmax.

Every runtime value carries a leading batch dim B (passes of several working
sets running the same program). Axis attrs in the IR are for the unbatched
value; the validator has normalised them to be non-negative, so +1 in an implementation.
No implementation reads a tensor back to the host: lengths and counts stay on the device.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

from host.epilogue.ir import Op, Value

TORCH_DTYPE = {"i64": torch.int64, "f32": torch.float32, "bool": torch.bool}
NP_DTYPE = {"i64": np.dtype(np.int64), "f32": np.dtype(np.float32), "bool": np.dtype(np.bool_)}  # in host memory
DEFAULT_FILL = {"i64": -1, "f32": 0.0, "bool": False}
_MASK64 = (1 << 64) - 1


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class Stream(enum.IntEnum):
    """Which kind of draw a set of uniforms is for: draws of different kinds never coincide."""

    SAMPLE = 1  # a categorical sample (the `sample` op, and the host's Sampler)
    RAND = 2  # the `rand` op
    VERIFY_ACCEPT = 3  # verify_sample's accept tests
    VERIFY_RESIDUAL = 4  # verify_sample's draw from the residual (or bonus) distribution


def draw_seed(seed: int, position: int, stream: Stream, salt: int) -> int:
    """The generator seed of one draw: a host-side hash of host ints (no sync). A draw is keyed
    by the run's seed, the absolute position of the row it draws for, its kind and the op's own
    seed, so it does not depend on how a sequence was split into passes or rounds, nor on which
    other passes share the batch: a guest-driven decode step, a device loop's round and a
    speculative round's verification at the same position draw the same uniforms."""
    h = 0
    for part in (seed, position, int(stream), salt):
        h = _splitmix(h ^ (part & _MASK64))
    return h & ((1 << 63) - 1)


def uniforms(seed: int, position: int, stream: Stream, salt: int, shape: list[int], device) -> torch.Tensor:
    """`shape` uniforms in [0, 1), from the generator draw_seed names."""
    g = torch.Generator(device=device)
    g.manual_seed(draw_seed(seed, position, stream, salt))
    return torch.rand(shape, generator=g, device=device, dtype=torch.float32)


def row_uniforms(seed: int, position: int, stream: Stream, salt: int, rows: int, shape: list[int],
                 device) -> torch.Tensor:
    """[rows, *shape] uniforms in [0, 1): row r from its own generator, keyed by its own absolute
    position (position + r), so a row's draws are the same whatever window it shares."""
    if rows == 0:
        return torch.empty([0, *shape], device=device, dtype=torch.float32)
    return torch.stack([uniforms(seed, position + r, stream, salt, shape, device) for r in range(rows)])


@dataclass
class Ctx:
    B: int
    device: torch.device
    bind: dict[str, int]
    seeds: list[int]
    positions: list[int]  # per pass: the absolute position of its window's first row
    values: list[Value]
    matchers: list = None  # per pass: name -> GrammarMatcher (env.py), for the grammar ops
    drafters: list = None  # per pass: name -> DraftBinding (env.py), for the drafter ops
    suffixes: list = None  # per pass: its SuffixSource (env.py) or None, for suffix_draft
    draws_at: list = None  # per pass: Env.draw_position, the position `uniforms` keys by (None: its position)

    def shape(self, v: Value) -> list[int]:
        return [d.resolve(self.bind) for d in v.shape]

    def uniforms(self, stream: Stream, salt: int, shape: list[int]) -> torch.Tensor:
        """[B, *shape] uniforms in [0, 1); pass b's from its own generator (see draw_seed), keyed by
        the position of its last readout row (the row a one-row readout's token is drawn for)."""
        at = [p if d is None else d for p, d in zip(self.positions, self.draws_at or [None] * self.B)]
        return torch.stack([uniforms(s, p, stream, salt, shape, self.device) for s, p in zip(self.seeds, at)])

    def row_uniforms(self, stream: Stream, salt: int, rows: int, shape: list[int]) -> torch.Tensor:
        """[B, rows, *shape] uniforms in [0, 1); row r of pass b keyed by the position of its window's
        row r (see row_uniforms)."""
        return torch.stack([row_uniforms(s, p, stream, salt, rows, shape, self.device)
                            for s, p in zip(self.seeds, self.positions)])


def align(t, rank: int):
    """A batched value [B, ...] (tensor or array) with axes after B added up to `rank` unbatched
    axes: broadcasting then pairs each pass's value with its own."""
    while t.ndim - 1 < rank:
        t = t[:, None]
    return t


def int_values(values, op) -> bool:
    """Every operand and result of the op is i64 or bool: numpy's arithmetic on them is torch's
    (no float rounding to differ in), so a variant on arrays gives the same values."""
    return all(values[i].dtype in ("i64", "bool") for i in (*op.args, *op.outs))


def fill_of(op: Op, dtype: str):
    fill = op.attrs["fill"]
    return DEFAULT_FILL[dtype] if fill is None else fill


def gather_fill(x: torch.Tensor, idx: torch.Tensor, fill) -> torch.Tensor:
    """x[b, idx[b, j]] along dim 1 of 2-D x; out-of-range indices give `fill`."""
    n = x.shape[1]
    if n == 0:
        return torch.full(idx.shape, fill, dtype=x.dtype, device=x.device)
    ok = (idx >= 0) & (idx < n)
    out = x.gather(1, idx.clamp(0, n - 1))
    return out.masked_fill(~ok, fill)


def exp_race(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample an index over the last axis with P(i) = w_i / sum(w) (exponential race:
    argmax of log w - log E, E = -log u ~ Exp(1)); no normalisation needed, no sync.
    Rows without a positive weight give -1."""
    logw = torch.where(weights > 0, weights.clamp_min(1e-38).log(), torch.full_like(weights, -torch.inf))
    e = -torch.log(u.clamp_min(1e-38))
    idx = argmax(logw - torch.log(e))
    return torch.where((weights > 0).any(-1), idx, torch.full_like(idx, -1))


_NP_ARGMAX = (torch.float32, torch.float64, torch.int64, torch.int32)


def argmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """torch.argmax over `dim` (first index of the largest value; a NaN counts as the largest).
    On the CPU, numpy's vectorised argmax gives the same index ~10x faster than torch's
    (5 us against 50 us for one row of a 49k vocabulary here): greedy decoding pays it every round."""
    if x.device.type == "cpu" and x.dtype in _NP_ARGMAX and x.numel() and not x.requires_grad:
        return torch.from_numpy(argmax_np(x.numpy(), dim))
    return x.argmax(dim)


def argmax_np(x: np.ndarray, dim: int) -> np.ndarray:
    """`argmax` of an array in host memory, as an array (the method: np.argmax's Python wrappers
    cost more than the call itself right after a model call)."""
    out = x.argmax(axis=dim)
    return out if isinstance(out, np.ndarray) else np.asarray(out)
