"""A component's top-level import names, read from its binary (the component model's binary
format: sections of id, LEB128 size and contents) without compiling it: a compile takes seconds
and tens of MB, and a component of another world needs neither to be refused."""

from __future__ import annotations


def _leb(b: bytes, i: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        x = b[i]
        i += 1
        out |= (x & 0x7F) << shift
        shift += 7
        if not x & 0x80:
            return out, i


def import_names(wasm: bytes) -> list[str] | None:
    """The component's top-level import names, read from its binary without compiling it (a
    compile takes seconds and tens of MB); None for an encoding this reader does not know (then
    only the check after compiling applies)."""
    try:
        names, i = [], 8
        while i < len(wasm):
            sid, (size, start) = wasm[i], _leb(wasm, i + 1)
            i, end = start + size, start + size
            if sid != 10:  # not an import section (a nested component's sections are inside others)
                continue
            count, j = _leb(wasm, start)
            for _ in range(count):
                if wasm[j] != 0x00:  # 0x01: a name with a version suffix, not what componentize-py writes
                    return None
                n, j = _leb(wasm, j + 1)
                names.append(wasm[j:j + n].decode())
                j += n
                kind = wasm[j]
                j += 1
                if kind == 0x00:  # a core module: 0x11 typeidx
                    j += 1
                    _, j = _leb(wasm, j)
                elif kind in (0x01, 0x04, 0x05):  # func, component, instance: typeidx
                    _, j = _leb(wasm, j)
                elif kind in (0x02, 0x03):  # a value or a type bound
                    tag = wasm[j]
                    j += 1
                    if not (kind == 0x03 and tag == 0x01):  # `sub resource` has no index
                        _, j = _leb(wasm, j)
                else:
                    return None
            if j != end:
                return None
        return names
    except (IndexError, UnicodeDecodeError):
        return None
