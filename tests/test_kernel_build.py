"""The kernels' build (host/engine/kernels.py): a build killed mid-way must not stall every later
one. torch's builder leaves its `lock` file behind when killed and then waits on it forever; this
is what stopped a CI run at `make kernels` until its time ran out."""

from __future__ import annotations

import subprocess
import sys

from host.engine import kernels


def test_a_stale_build_lock_does_not_stall_the_next_build():
    name = f"pie_kernels_{kernels._machine_tag()}"
    build_dir = kernels._build_dir(name)
    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / "lock").touch()  # as a killed build leaves it
    # a fresh process (this one's module is cached); within the timeout even with a full rebuild
    out = subprocess.run([sys.executable, "-c", "from host.engine import kernels; kernels.main()"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "CPU kernels ready" in out.stdout, out.stdout + out.stderr
    assert not (build_dir / "lock").exists()
