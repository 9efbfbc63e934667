"""Programs the host must reject, each with the op named in the message."""

import json

import pytest

from host.epilogue import ProgramError, compile_program
from host.errors import InvalidArgument


def prog(ops, inputs=({"kind": "logits"}, {"kind": "window"}), channels=(), dims=None):
    return json.dumps({"version": 1, "dims": dims or {}, "channels": list(channels),
                       "inputs": list(inputs), "ops": ops})


def rejects(text, *needles):
    with pytest.raises(ProgramError) as e:
        compile_program(text)
    assert isinstance(e.value, InvalidArgument)
    for n in needles:
        assert n in str(e.value), str(e.value)


def test_accepts_a_good_program():
    p = compile_program(prog([{"op": "argmax", "args": [0]}, {"op": "size", "args": [1]}, {"op": "fold", "args": [3]}]))
    assert p.has_fold and len(p.digest) == 64


def test_cache_by_content_hash():
    a = prog([{"op": "argmax", "args": [0]}])
    b = json.dumps(json.loads(a), indent=2, sort_keys=False)
    assert compile_program(a) is compile_program(b)


def test_wrong_dtype():
    rejects(prog([{"op": "add", "args": [0, 1]}]), "op 0 (add)", "wrong dtype")
    rejects(prog([{"op": "argmax", "args": [0]}, {"op": "not", "args": [2]}]), "op 1 (not)", "wrong dtype")
    rejects(prog([{"op": "fold", "args": [0]}]), "op 0 (fold)")


def test_shape_mismatch():
    rejects(prog([{"op": "argmax", "args": [0]}, {"op": "eq", "args": [2, 1]}]), "op 1 (eq)", "shape mismatch")
    rejects(prog([{"op": "const", "attrs": {"value": [1, 2, 3], "dtype": "i64"}},
                  {"op": "const", "attrs": {"value": [1, 2], "dtype": "i64"}},
                  {"op": "add", "args": [2, 3]}]), "op 2 (add)", "shape mismatch")
    rejects(prog([{"op": "argmax", "args": [0]}, {"op": "verify_greedy", "args": [1, 2]}], dims={"W": 4, "R": 4}),
            "op 1 (verify_greedy)", "shape mismatch")


def test_unknown_channel():
    rejects(prog([{"op": "put", "args": [1], "attrs": {"channel": "nope"}}]), "op 0 (put)", "unknown channel")
    rejects(prog([], inputs=[{"kind": "channel", "name": "nope"}]), "input 0", "unknown channel")


def test_channel_dtype_and_double_write():
    ch = [{"name": "out", "dtype": "f32", "capacity": 4}]
    rejects(prog([{"op": "put", "args": [1], "attrs": {"channel": "out"}}], channels=ch), "op 0 (put)", "wrong dtype")
    ch = [{"name": "out", "dtype": "i64", "capacity": 4}]
    rejects(prog([{"op": "put", "args": [1], "attrs": {"channel": "out"}},
                  {"op": "set", "args": [1], "attrs": {"channel": "out"}}], channels=ch), "op 1 (set)", "twice")


def test_fold_larger_than_window():
    rejects(prog([{"op": "const", "attrs": {"value": 5, "dtype": "i64"}}, {"op": "fold", "args": [2]}], dims={"W": 4}),
            "op 1 (fold)", "window")
    rejects(prog([{"op": "argmax", "args": [0]}, {"op": "index", "args": [2], "attrs": {"i": 0}},
                  {"op": "fold", "args": [3]}]), "op 2 (fold)", "not provably")
    # bounded by minimum(x, size(window)) is accepted
    compile_program(prog([{"op": "argmax", "args": [0]}, {"op": "index", "args": [2], "attrs": {"i": 0}},
                          {"op": "size", "args": [1]}, {"op": "minimum", "args": [3, 4]}, {"op": "fold", "args": [5]}]))


def test_unknown_op():
    rejects(prog([{"op": "argmax", "args": [0]}, {"op": "frobnicate", "args": [2]}]), "op 1", "unknown op 'frobnicate'")


def test_forward_reference_and_cycle():
    rejects(prog([{"op": "neg", "args": [3]}, {"op": "neg", "args": [0]}]), "op 0 (neg)", "forward reference")
    rejects(prog([{"op": "neg", "args": [2]}]), "op 0 (neg)", "cycle")  # its own result


def test_bad_args_attrs_and_structure():
    rejects(prog([{"op": "argmax", "args": [0, 1]}]), "op 0 (argmax)", "takes 1")
    rejects(prog([{"op": "argmax", "args": [0], "attrs": {"axis": 5}}]), "op 0 (argmax)", "axis")
    rejects(prog([{"op": "softmax", "args": [0], "attrs": {"temperature": 0}}]), "op 0 (softmax)", "temperature")
    rejects(prog([{"op": "top_p", "args": [0], "attrs": {"p": 1.5}}]), "op 0 (top_p)")
    rejects(prog([{"op": "const", "attrs": {"value": 1.5, "dtype": "i64"}}]), "op 0 (const)")
    rejects(prog([], inputs=[{"kind": "secrets"}]), "input 0", "unknown input kind")
    rejects("{not json", "not valid JSON")
    rejects(json.dumps({"version": 2, "ops": []}), "version")
    rejects(json.dumps({"version": 1, "ops": [], "extra": 1}), "unknown keys")
    rejects(json.dumps([1, 2]), "JSON object")


def test_strict_json_types_and_bounds():
    """Malformed numbers, shapes and fields are invalid-argument, never another exception."""
    rejects('{"version": 1, "ops": [{"op": "const", "attrs": {"value": ' + "9" * 5000 + ', "dtype": "i64"}}]}',
            "not valid JSON")
    rejects('{"version": 1, "ops": [{"op": "const", "attrs": {"value": ' + "[" * 50000 + "]" * 50000 + "}}]}",
            "not valid JSON")
    rejects(json.dumps({"version": True, "ops": []}), "version")
    rejects(json.dumps({"version": 1.0, "ops": []}), "version")
    ch = [{"name": "out", "dtype": "i64", "capacity": 4}]
    rejects(prog([{"op": "put", "args": [1], "attrs": {"channel": ["out"]}}], channels=ch), "op 0 (put)", "channel")
    rejects(prog([], channels=[{"name": ["out"], "dtype": "i64", "capacity": 4}]), "channel 0", "'name'")
    rejects(prog([], channels=[{"name": "o", "dtype": "i64", "capacity": True}]), "channel 0", "'capacity'")
    rejects(prog([{"op": "const", "attrs": {"value": 1e39, "dtype": "f32"}}]), "op 0 (const)", "float32")
    rejects(prog([{"op": "full", "attrs": {"shape": [2**40], "value": 0, "dtype": "i64"}}]), "op 0 (full)", "out of range")
    rejects(prog([{"op": "full", "attrs": {"shape": [2**12, 2**12, 2**4], "value": 0, "dtype": "i64"}}]), "MiB")
    rejects(prog([{"op": "full", "attrs": {"shape": ["W+99999999999999999999"], "value": 0, "dtype": "i64"}}]),
            "op 0 (full)", "dim")
    rejects(prog([{"op": "argmax", "args": [0], "attrs": {"axis": True}}]), "op 0 (argmax)", "'axis' must be an int")
    rejects(prog([{"op": "argmax", "args": [0], "attrs": {"axis": -1.0}}]), "op 0 (argmax)", "'axis' must be an int")
    rejects(prog([{"op": "argmax", "args": [0], "attrs": {"axsi": -1}}]), "op 0 (argmax)", "unknown attr 'axsi'")
    rejects(prog([{"op": "argmax", "args": [True]}]), "op 0 (argmax)", "value indices")
    rejects(prog([{"op": "argmax", "args": [0], "extra": 1}]), "op 0", "unknown key")
    rejects(prog([{"op": ["argmax"], "args": [0]}]), "op 0", "'op' must be a JSON string")
    rejects(prog([], inputs=[{"kind": "logits", "name": "x"}]), "input 0", "takes no 'name'")
    rejects(prog([], inputs=[{"kind": "channel", "name": ["x"]}]), "input 0", "'name'")
    rejects(prog([], dims={"W": True}), "dims")


def test_integer_ops_wrap_on_the_host_as_on_the_device():
    """INT64_MIN // -1 and friends: the host's Python ints wrap as torch's int64 does."""
    import torch

    from host.epilogue import Env
    lo = -(2**63)
    p = compile_program(json.dumps({"version": 1, "ops": [
        {"op": "const", "attrs": {"value": lo, "dtype": "i64"}}, {"op": "const", "attrs": {"value": -1, "dtype": "i64"}},
        {"op": "floordiv", "args": [0, 1]}, {"op": "mul", "args": [0, 1]}, {"op": "abs", "args": [0]}]}))
    r = p.run([Env()], keep_values=True)[0]
    assert [int(v) for v in r.values[2:5]] == [lo, lo, lo] and r.values[2].dtype == torch.int64


def test_budget_checked_when_the_pass_binds_its_dims():
    import torch

    from host.epilogue import Env
    p = compile_program(prog([{"op": "full", "attrs": {"shape": ["V", "V"], "value": 0, "dtype": "i64"}}],
                             inputs=[{"kind": "logits"}]))
    p.run([Env(logits=torch.zeros(1, 16))])  # 2 KiB
    rejects_run = pytest.raises(ProgramError, match="MiB")
    with rejects_run:
        p.run([Env(logits=torch.zeros(1, 49152))])  # 18 GiB


@pytest.mark.parametrize("value", [10**400, -(10**400), 2**128, [1.0, 10**400], [[0, -(2**1000)]]])
def test_f32_constant_past_float32_as_an_int(value):
    """An int past float32's range: refused at validation (math.isfinite(10**400) raises OverflowError)."""
    rejects(prog([{"op": "const", "attrs": {"value": value, "dtype": "f32"}}]), "op 0 (const)")
    rejects(prog([{"op": "full", "attrs": {"shape": [2], "value": value, "dtype": "f32"}}]), "op 0 (full)")


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 2**64, 10**400, [0, 2**63]])
def test_i64_constant_past_its_range(value):
    rejects(prog([{"op": "const", "attrs": {"value": value, "dtype": "i64"}}]), "op 0 (const)")


@pytest.mark.parametrize("value", [10**400, -(10**400)])
def test_number_attr_past_float32_as_an_int(value):
    rejects(prog([{"op": "softmax", "args": [0], "attrs": {"temperature": value}}]), "op 0 (softmax)")


@pytest.mark.parametrize("cells", [[2**40], [2**40, 1], [-(2**31) - 1]])
def test_i64_into_an_int32_channel_is_invalid_argument(cells):
    """A channel the runtime stores as int32 (an int32 WIT channel): a cell past its range is the
    program's invalid-argument, not an OverflowError out of the executor."""
    import torch

    from host.epilogue import Env, SimpleChannel

    p = compile_program(prog([{"op": "const", "attrs": {"value": cells, "dtype": "i64"}},
                              {"op": "put", "args": [0], "attrs": {"channel": "out"}}], inputs=(),
                             channels=[{"name": "out", "dtype": "i64", "capacity": 4}]))
    out = SimpleChannel(torch.zeros(4, dtype=torch.int32), 0)
    with pytest.raises(InvalidArgument, match="int32"):
        p.run([Env(channels={"out": out})])
