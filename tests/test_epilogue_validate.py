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
