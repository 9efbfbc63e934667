"""The engine's compiled CPU kernels (csrc/), built once per machine by torch's extension
builder for the machine's own instruction set. Where they cannot be built (no C++ compiler)
the engine runs torch's operators instead and says so once.

`make` builds them in set-up, ahead of the first engine (`kernels.main()`)."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("csrc") / f for f in ("module.cpp", "paged_attention.cpp", "layer_stack.cpp",
                                                          "skinny_linear.cpp", "block_linear.cpp", "q8_linear.cpp",
                                                          "row_ops.cpp")]
FLAGS = ["-O3", "-march=native", "-fopenmp"]  # OpenMP: at::parallel_for runs on torch's own pool


def _machine_tag() -> str:
    """-march=native code runs only where it was built: the build is named for the CPU."""
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


def _build_dir(name: str) -> Path:
    """Where torch's builder would put it, named for the Python and torch it links against."""
    import sys

    import torch

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}" / name


def _clear_stale_baton(build_dir: Path) -> None:
    """torch's builder guards a build with a `lock` file that only the builder removes: a build
    killed mid-way (a stopped session, a timed-out CI step) leaves it, and every later build then
    waits on it forever. Called under our own flock, which the kernel releases with its holder, so
    a `lock` seen here belongs to no live build of ours."""
    (build_dir / "lock").unlink(missing_ok=True)


@functools.cache
def _module():
    return _build(f"pie_kernels_{_machine_tag()}", SOURCES, FLAGS)


def _build(name: str, sources: list[Path], flags: list[str]):
    from torch.utils.cpp_extension import load

    try:
        build_dir = _build_dir(name)
        build_dir.mkdir(parents=True, exist_ok=True)
        with open(build_dir.parent / f"{name}.flock", "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)  # one build at a time across processes; freed if one dies
            _clear_stale_baton(build_dir)
            return load(name, [str(s) for s in sources], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                        build_directory=os.fspath(build_dir), verbose=False)
    except Exception as e:  # no compiler, no headers: torch's operators do the same work
        log.warning("pie: the CPU kernels could not be built (%s); the engine runs torch's operators instead",
                    str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
        return None


# the instruction sets the products are written for (vec.h; q8_linear.cpp's byte dot products
# also VNNI's), widest first: each one's flags, and the CPU flags it needs to run. The products' bits do not depend on the vector width (one
# multiply-add chain over k per output), so the tests compare each narrower set this CPU runs
# with its own build: an AVX-512 VM tests the AVX2 and scalar code too.
VARIANTS = {"avx512vnni": (["-march=x86-64-v4", "-mavx512vnni"],
                           ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma")),
            "avx512": (["-march=x86-64-v4"], ("avx512f", "avx512bw", "avx512vl", "f16c", "fma")),
            "avx2": (["-march=x86-64-v3"], ("avx2", "fma", "f16c")),
            "scalar": (["-march=x86-64"], ())}
PRODUCT_SOURCES = [SOURCES[0], *(s for s in SOURCES if s.name in ("skinny_linear.cpp", "block_linear.cpp", "q8_linear.cpp"))]


def other_variants() -> list[str]:
    """The VARIANTS narrower than this CPU's own build, which it can run (x86-64 only)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    try:
        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return []
    have = set(line.split(":", 1)[1].split())
    runs = [isa for isa, (_, needs) in VARIANTS.items() if set(needs) <= have]
    return runs[1:]  # the widest it runs is what -march=native builds


@functools.cache
def variant(isa: str) -> SkinnyOps | None:
    """The products (skinny_linear, block_linear) built for one of VARIANTS instead of this CPU's
    own instruction set, or None where they cannot be built. For the tests: run only where
    `other_variants()` names it."""
    flags, _ = VARIANTS[isa]
    mod = _build(f"pie_products_{isa}", PRODUCT_SOURCES, ["-O3", *flags, "-fopenmp", "-DPIE_PRODUCTS_ONLY"])
    return None if mod is None else _skinny_ops(mod)


def paged_attention() -> Callable | None:
    """The paged attention kernel (csrc/paged_attention.cpp), or None."""
    mod = _module()
    return mod.paged_attention if mod is not None else None


def layer_stack() -> Callable | None:
    """stack.py's layer loop called from C++ (csrc/layer_stack.cpp), or None."""
    mod = _module()
    return mod.layer_stack if mod is not None else None


class SkinnyOps(NamedTuple):
    pack: Callable  # weight [N, K] -> its blocks
    linear: Callable  # (x [rows, K], blocks, bias or None, N) -> x @ weight.T + bias
    block: int  # output columns of one block (the target's registers)
    block_linear: Callable  # (x, packed file blocks, ggml type, bias or None, N) -> x @ weight.T + bias
    block_dense: Callable  # (packed file blocks, ggml type, N) -> weight [N, K] float32
    block_gather: Callable  # (packed file blocks, ggml type, N, ids [T]) -> weight[ids] [T, K] float32
    q8_block: int  # output columns of one block in the 8-bit-activation layout (blocks.repack_q8)


@functools.cache
def skinny() -> SkinnyOps | None:
    """The few-row products (csrc/skinny_linear.cpp, csrc/block_linear.cpp), or None."""
    mod = _module()
    return None if mod is None else _skinny_ops(mod)


def _skinny_ops(mod) -> SkinnyOps:
    return SkinnyOps(mod.skinny_pack, mod.skinny_linear, mod.skinny_block(), mod.block_linear, mod.block_dense,
                     mod.block_gather, mod.q8_block())


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
