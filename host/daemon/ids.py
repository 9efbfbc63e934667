"""An instance's id: `inst_`, in a deployment its replica's id and a dot (host/cluster's router
sends every call on the instance there), then 24 random hex digits. Imports nothing heavy: Ray
Serve's proxy reads it."""

from __future__ import annotations

import re
import secrets

INSTANCE_ID = re.compile(r"inst_(?:([a-z0-9]+)\.)?[0-9a-f]{24}")


def instance_id(replica: str | None) -> str:
    return f"inst_{replica + '.' if replica else ''}{secrets.token_hex(12)}"
