"""Bearer API keys: one key a line in --api-key-file; no file, no authentication."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from ..errors import InvalidArgument


def load_keys(path: str | Path | None) -> list[str] | None:
    """The keys of the file (blank lines and `#` comments skipped), or None without a file."""
    if path is None:
        return None
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise InvalidArgument(f"--api-key-file {path}: {e.strerror}") from None
    keys = [k for k in (line.strip() for line in lines) if k and not k.startswith("#")]
    if not keys:
        raise InvalidArgument(f"--api-key-file {path} holds no key")
    return keys


def matching_key(keys: list[str], header: str | None) -> str | None:
    """The key an `Authorization: Bearer KEY` header carries, if it is one of `keys`."""
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return None
    # compare with every key in constant time: no timing tells which prefix matched
    hits = [k for k in keys if hmac.compare_digest(token.strip().encode(), k.encode())]
    return hits[0] if hits else None


def key_id(key: str) -> str:
    """The name a key's instances are owned under: never the key itself (cards and logs show it)."""
    return "key_" + hashlib.sha256(key.encode()).hexdigest()[:16]
