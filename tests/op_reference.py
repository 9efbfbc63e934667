"""Which epilogue ops a reference test (the op against plain torch or Python) covers.
tests/test_epilogue_registry.py fails when an op of the registry has none."""

COVERED: dict[str, list[str]] = {}  # op name -> the reference tests that cover it


def covers(*ops: str):
    def mark(fn):
        for op in ops:
            COVERED.setdefault(op, []).append(f"{fn.__module__}.{fn.__name__}")
        return fn
    return mark
