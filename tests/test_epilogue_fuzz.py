"""Random and mutated epilogue programs: the host answers each with a compiled program or an
invalid-argument (ProgramError), and a program it accepts runs or fails with one, with bounded
memory; never another exception."""

import json
import resource

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from host.epilogue import Env, ProgramError, SimpleChannel, compile_program
from host.epilogue.ops import OPS

from guest import cacheback, trace

TRIED = {"programs": 0, "compiled": 0, "ran": 0}


def _seeds() -> list[dict]:
    """Valid programs to mutate: cacheback's (greedy and sampled) and a greedy loop's."""
    out = []
    for temp in (0.0, 0.8):
        text, _ = cacheback.cacheback_program(prompt=[1, 2, 3, 1, 2], draft_len_max=3,
                                                lookup_window=16, lru_size=4, max_tokens=20, temperature=temp)
        out.append(json.loads(text))
    p = trace.Program(window=1)
    p.channel("out", "i64", 16)
    tok = p.logits().argmax()
    p.put("out", tok)
    p.fold(p.const(1))
    p.stop_if(p.round() >= 3)
    out.append(json.loads(p.to_json()))
    return out


SEEDS = _seeds()
# past every dtype's range too: int32 and i64 cells, float32, and ints no float holds (10**400)
BIG_INTS = [2**31, -(2**31) - 1, 2**40, 2**63, -(2**63) - 1, 2**64, 2**128, 10**400, -(10**400)]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from(BIG_INTS),
                    st.floats(allow_nan=True),
                    st.text(max_size=4), st.sampled_from(["W", "W-1", "R", "V", "N+3", "i64", "f32", "bool", "out",
                                                          "window", *OPS]))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                              st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                           max_leaves=12)


def _paths(node, path=()):
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, path + (i,))


def _replace(node, path, value):
    if not path:
        return value
    node = json.loads(json.dumps(node))
    cur = node
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = value
    return node


@st.composite
def mutated(draw):
    prog = draw(st.sampled_from(SEEDS))
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(prog))
        path = draw(st.sampled_from(paths))
        prog = _replace(prog, path, draw(json_values))
    return prog


random_programs = st.fixed_dictionaries({
    "version": st.just(1),
    "dims": st.dictionaries(st.sampled_from("RWVNHK"), st.one_of(st.integers(-2, 70), st.sampled_from("RWVNHK")),
                            max_size=2),
    "channels": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["out", "window", "s"]),
                                                "dtype": st.sampled_from(["i64", "f32", "bool"]),
                                                "capacity": st.integers(0, 70)}), max_size=2),
    "inputs": st.lists(st.fixed_dictionaries({"kind": st.sampled_from(["logits", "window", "history", "round",
                                                                       "channel", "channel_len", "hidden"])},
                                             optional={"name": st.sampled_from(["out", "window", "s"])}), max_size=3),
    "ops": st.lists(st.fixed_dictionaries({"op": st.sampled_from(sorted(OPS)),
                                           "args": st.lists(st.integers(-1, 8), max_size=4)},
                                          optional={"attrs": st.dictionaries(
                                              st.sampled_from(["axis", "i", "k", "n", "dtype", "value", "shape",
                                                               "channel", "size", "start", "stop", "seed", "p",
                                                               "temperature", "g", "fill", "ngram_min"]),
                                              scalars, max_size=3)}), max_size=8),
})


def _env(prog) -> Env:
    """Inputs of the sizes the program declares (small defaults for free symbols)."""
    c = prog.checked
    dims = {"R": 3, "W": 3, "V": 11, "N": 9, "H": 5, "K": 2, **c.dims}
    for k, v in c.alias.items():
        dims[k] = dims[v]
    # an i64 channel is stored as int64 (a WIT u32 channel) or int32 (an s32 one), by turns
    chans = {ch.name: SimpleChannel.empty(ch.capacity, {"i64": (torch.int64, torch.int32)[i % 2], "f32": torch.float32,
                                                        "bool": torch.bool}[ch.dtype])
             for i, ch in enumerate(c.channels.values())}
    return Env(logits=torch.randn(dims["R"], dims["V"]), window=torch.randint(0, dims["V"], (dims["W"],)),
               history=torch.randint(0, dims["V"], (dims["N"],)), hidden=torch.randn(dims["R"], dims["H"]),
               channels=chans, seed=1, round=2)


def _try(obj) -> None:
    TRIED["programs"] += 1
    try:
        text = json.dumps(obj)
    except ValueError:  # a NaN: JSON text cannot hold it the strict way; the host gets what json.dumps gives
        text = json.dumps(obj, allow_nan=True)
    try:
        prog = compile_program(text)
    except ProgramError:
        return
    TRIED["compiled"] += 1
    try:
        prog.run([_env(prog)])
        TRIED["ran"] += 1
    except ProgramError:
        pass


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


FUZZ = settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@FUZZ
@given(mutated())
def test_mutated_programs(obj):
    _try(obj)


@FUZZ
@given(random_programs)
def test_random_programs(obj):
    _try(obj)


def test_fuzz_memory_stays_bounded():
    """Runs after the two above (file order): what they left behind is bounded."""
    before = _rss_mb()
    for obj in SEEDS:
        for n in range(20):
            _try(_replace(obj, ("ops",), obj["ops"] + [{"op": "full", "attrs": {
                "shape": [1 << 12, 1 << 12, 1 << (n % 5)], "value": 0, "dtype": "i64"}}]))
    assert _rss_mb() - before < 200
    assert TRIED["programs"] >= 2000, TRIED
    print(f"fuzz: {TRIED}")
