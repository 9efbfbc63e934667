"""The engine's compiled CPU kernels (csrc/), built once per machine by torch's extension
builder for the machine's own instruction set. Where they cannot be built (no C++ compiler)
the engine runs torch's operators instead and says so once.

`make` builds them in set-up, ahead of the first engine (`kernels.main()`)."""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("csrc") / f for f in ("module.cpp", "paged_attention.cpp", "layer_stack.cpp", "skinny_linear.cpp",
                                                          "row_ops.cpp")]
FLAGS = ["-O3", "-march=native", "-fopenmp"]  # OpenMP: at::parallel_for runs on torch's own pool


def _machine_tag() -> str:
    """-march=native code runs only where it was built: the build is named for the CPU."""
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


@functools.cache
def _module():
    from torch.utils.cpp_extension import load

    try:
        return load(f"pie_kernels_{_machine_tag()}", [str(s) for s in SOURCES], extra_cflags=FLAGS,
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no headers: torch's operators do the same work
        log.warning("pie: the CPU kernels could not be built (%s); the engine runs torch's operators instead",
                    str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
        return None


def paged_attention() -> Callable | None:
    """The paged attention kernel for short windows (csrc/paged_attention.cpp), or None."""
    mod = _module()
    return mod.paged_attention if mod is not None else None


def layer_stack() -> Callable | None:
    """stack.py's layer loop called from C++ (csrc/layer_stack.cpp), or None."""
    mod = _module()
    return mod.layer_stack if mod is not None else None


class SkinnyOps(NamedTuple):
    pack: Callable  # weight [N, K] -> its blocks
    linear: Callable  # (x [rows, K], blocks, bias or None, N) -> x @ weight.T + bias


@functools.cache
def skinny() -> SkinnyOps | None:
    """The few-row product (csrc/skinny_linear.cpp), or None."""
    mod = _module()
    return SkinnyOps(mod.skinny_pack, mod.skinny_linear) if mod is not None else None


class RowOps(NamedTuple):
    """The layer stack's elementwise steps, one call each (csrc/row_ops.cpp)."""
    residual_norm: Callable  # (x, delta or None, weight, eps) -> (x + delta, RMSNorm(x + delta) * weight)
    rope_store: Callable  # (qkv, cos, sin, layer pool, slots, heads, kv_heads) -> q [T, heads, D]
    silu_mul: Callable  # ([gate | up], inter) -> SiLU(gate) * up


@functools.cache
def row_ops() -> RowOps | None:
    mod = _module()
    return RowOps(mod.residual_norm, mod.rope_store, mod.silu_mul) if mod is not None else None


def main() -> None:
    ok = paged_attention() is not None
    print("pie: CPU kernels " + ("ready" if ok else "not built: the engine runs torch's operators instead"))
