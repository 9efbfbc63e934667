"""What one inferlet instance may cost the host: every limit declared once, here.

`pie run`'s flags, their help and the table in SECURITY.md derive from the field metadata
(`python -m host.runtime.limits` prints the table). A field without a flag is fixed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..errors import InvalidArgument


def _limit(default, what: str, flag: str | None = None, unit: int = 1, kind=int):
    """A limit: its default, what it bounds, and its `pie run` flag (in units of `unit`)."""
    return field(default=default, metadata={"what": what, "flag": flag, "unit": unit, "kind": kind})


@dataclass
class Limits:
    memory_bytes: int = _limit(512 << 20, "guest linear memory, all memories of the store together "
                               "(componentize-py's CPython needs ~40 MiB)", "--memory-mb", 1 << 20)
    cpu_time_s: float = _limit(60.0, "guest execution time: its thread's CPU time (not time asleep, blocked in host "
                               "calls, or its device loops' model time)", "--cpu-time", kind=float)
    compute_time_s: float = _limit(600.0, "model time of the instance's device loops: each round's share of the compute "
                                   "thread's CPU time for the step it ran in", "--compute-time", kind=float)
    wall_time_s: float = _limit(600.0, "the whole run, from start to end; past it the run is cancelled",
                                "--wall-time", kind=float)
    kv_share: float = _limit(0.5, "the most of the KV page pool one instance's working sets may hold",
                             "--kv-share", kind=float)
    channel_cells: int = _limit(1 << 21, "cells of all the instance's live channels together",
                                "--channel-cells")
    readout_rows: int = _limit(64, "readout rows of one pass whose epilogue reads logits (each costs a logits row on the device)",
                               "--readout-rows")
    output_bytes: int = _limit(16 << 20, "the run's output: its text (UTF-8) and 4 bytes per token id",
                               "--output-mb", 1 << 20)
    log_bytes: int = _limit(1 << 20, "the guest's stdout and stderr together", "--log-kb", 1 << 10)
    handles: int = _limit(4096, "live handles (working sets, channels, samplers, epilogues)", "--handles")
    # the store's own limits (wasmtime StoreLimits), fixed: componentize-py components use one
    # memory, two tables of ~6k elements and ~14 core instances
    memories: int = _limit(1, "linear memories per store (each gets memory_bytes / memories)")
    tables: int = _limit(8, "tables per store")
    table_elements: int = _limit(1 << 16, "elements per table")
    instances: int = _limit(64, "core instances per store")

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if not v > 0 or (f.name == "kv_share" and v > 1):
                raise InvalidArgument(f"limit {_name(f)} must be {'in (0, 1]' if f.name == 'kv_share' else 'positive'},"
                                      f" not {v}")

    def store_limits(self) -> dict:
        """wasmtime's Store.set_limits arguments: together they bound all memories and tables."""
        return {"memory_size": self.memory_bytes // self.memories, "memories": self.memories,
                "tables": self.tables, "table_elements": self.table_elements, "instances": self.instances}


def _name(f) -> str:
    return f.metadata["flag"] or f.name


def flag(name: str) -> str:
    """How a message names a limit: its flag, else its field."""
    return _name(next(f for f in fields(Limits) if f.name == name))


def add_flags(parser) -> None:
    for f in fields(Limits):
        m = f.metadata
        if m["flag"]:
            parser.add_argument(m["flag"], type=m["kind"], default=m["kind"](f.default / m["unit"]),
                                help=f"{m['what']} (default %(default)s)")


def from_args(args) -> Limits:
    kw = {}
    for f in fields(Limits):
        m = f.metadata
        if m["flag"]:
            v = getattr(args, m["flag"].lstrip("-").replace("-", "_"))
            kw[f.name] = m["kind"](v * m["unit"])
    return Limits(**kw)


def table() -> str:
    """The limits as a markdown table (SECURITY.md)."""
    rows = ["| limit | bounds | default | `pie run` flag |", "|---|---|---|---|"]
    for f in fields(Limits):
        m = f.metadata
        shown = m["kind"](f.default / m["unit"])
        rows.append(f"| `{f.name}` | {m['what']} | {shown} | {'`' + m['flag'] + '`' if m['flag'] else 'fixed'} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
