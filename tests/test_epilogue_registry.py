"""The op registry is complete: every op has a type rule, an implementation, a doc entry in
wit/epilogue-ir.md (written from the registry) and a reference test; the host's scalar
functions and the plan's inline expressions agree with the torch implementations."""

import itertools

import pytest
import torch

import test_epilogue_grammar  # noqa: F401  (their @covers marks count)
import test_epilogue_lru  # noqa: F401
import test_epilogue_ops  # noqa: F401
import test_epilogue_sampling  # noqa: F401
import test_mtp_program  # noqa: F401
from host.epilogue.ir import Op, Value
from host.epilogue.tensors import Ctx
from host.epilogue.ops import FAMILIES, OPS
from host.epilogue.ops.doc import DOC, rewrite
from op_reference import COVERED


def test_every_op_is_declared_whole():
    for name, spec in OPS.items():
        assert spec.name == name and spec.family in FAMILIES, name
        assert spec.arity and all(isinstance(n, int) and n >= 0 for n in spec.arity), name
        assert callable(spec.infer), name
        assert spec.doc and spec.doc.startswith(f"`{name}("), name
        assert (spec.impl is None) == spec.effect, f"{name}: an implementation, unless it is an effect"
        assert spec.inline is None or spec.host is not None, name


def test_the_ir_document_is_written_from_the_registry():
    text = DOC.read_text()
    assert rewrite(text) == text, "run `python -m host.epilogue.ops` to rewrite wit/epilogue-ir.md"
    for name in OPS:
        assert f"- `{name}(" in text, name


def test_every_op_has_a_reference_test():
    missing = sorted(set(OPS) - set(COVERED))
    assert not missing, f"ops without a reference test (mark one with @covers): {missing}"
    assert not set(COVERED) - set(OPS), "a reference test covers an op that does not exist"


INTS = [0, 1, -1, 2, -3, 7, 2**62, -(2**63), 2**63 - 1]
BOOLS = [False, True]


def _domain(spec):
    """Host-function arguments to try: ints for integer ops, bools for logic, mixed for where."""
    if spec.name in ("and", "or", "xor", "not"):
        return [BOOLS] * spec.arity[0]
    if spec.name == "where":
        return [BOOLS, INTS, INTS]
    return [INTS] * spec.arity[0]


@pytest.mark.parametrize("name", sorted(n for n, s in OPS.items() if s.host is not None))
def test_host_function_equals_the_impl(name):
    spec = OPS[name]
    dom = _domain(spec)
    op = Op(0, name, list(range(len(dom))), {}, [len(dom)])
    out_dtype = "bool" if name in ("eq", "ne", "lt", "le", "gt", "ge", "and", "or", "xor", "not") else "i64"
    values = [Value("bool" if d is BOOLS else "i64", ()) for d in dom] + [Value(out_dtype, ())]
    ctx = Ctx(1, torch.device("cpu"), {}, [0], [0], values)
    for xs in itertools.product(*dom):
        ts = [torch.tensor([x], dtype=torch.bool if isinstance(x, bool) else torch.int64) for x in xs]
        want = spec.impl(ctx, op, ts)[0].item()
        got = spec.host(*xs)
        assert got == want and type(got) in (int, bool), (name, xs, got, want)
        if spec.inline is not None:  # the plan's inline expression, on the same Python values
            got = eval(spec.inline.format(*(f"x{j}" for j in range(len(xs)))), {f"x{j}": x for j, x in enumerate(xs)})
            assert got == want and type(got) is type(spec.host(*xs)), (name, xs, got, want)
