"""Bearer API keys: one key a line in --api-key-file; no file, no authentication."""

from __future__ import annotations

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


def authorized(keys: list[str] | None, header: str | None) -> bool:
    """Whether an `Authorization` header carries one of the keys (any, when keys is None)."""
    if keys is None:
        return True
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    # compare with every key in constant time: no timing tells which prefix matched
    return any([hmac.compare_digest(token.strip().encode(), k.encode()) for k in keys])
