"""The conformance probe: performs a case's steps, one pie:inferlet call each, and reports
each step's outcome as one JSON line through `runtime.send`.

Arguments: --case NAME --steps JSON, where JSON is a list of {"call": "iface.func",
"args": [...], "as": "var"}. The host side (host/conformance/) decides pass or fail; this
component only performs calls, so a new case needs no rebuild. An argument string "$var"
or "$var.field.0" is an earlier step's result (handles, tokens). Outcomes:
{"ok": value} | {"error": code, "message": text} | {"unbound": "$var"}, each sent at once on
its own line after MARK (so the steps before a trap are still reported, and text a case
sends or emits stays apart).

With --start-at T (Unix seconds) it first waits until then (at most START_S seconds): the
runner gives instances launched together one T so that their passes share batches.
With --hold the probe then reports {"held": true} and stays alive, its handles with it, until
the runner cancels it (a case with several instances; at most HOLD_S seconds).
"""

import json
import time
from dataclasses import fields, is_dataclass
from enum import Enum

import wit_world
from componentize_py_types import Err
from wit_world.imports import channels as _ch
from wit_world.imports import forward as _fw
from wit_world.imports import grammars as _gr
from wit_world.imports import runtime as _rt
from wit_world.imports import tokenizer as _tok
from wit_world.imports import working_sets as _ws


MARK = "@probe "  # host/conformance/runner.py reads the lines that start with it
HOLD_S = 60.0  # a held probe whose runner went away still ends
START_S = 10.0  # a start time far off (another machine's clock) delays a case this much at most


class Unbound(Exception):
    pass


# ---- JSON -> WIT values ------------------------------------------------------------------
def _plain(v):
    return v


def _element(v):
    return _ch.ElementType[v.upper()]


_CELLS = {"uint32": _ch.Cells_Uint32, "int32": _ch.Cells_Int32, "float32": _ch.Cells_Float32,
          "boolean": _ch.Cells_Boolean}


def _one(v: dict):
    """The single (case, payload) of a variant written as {"case": payload}."""
    if isinstance(v, str):
        return v, None
    (case, payload), = v.items()
    return case, payload


def _cells(v):
    case, payload = _one(v)
    if case == "float32":
        payload = [float(x) for x in payload]
    return _CELLS[case](payload)


def _embed(v):
    case, payload = _one(v)
    return _fw.Embed_Tokens(payload) if case == "tokens" else _fw.Embed_FromChannel(payload)


def _fold(v):
    case, payload = _one(v)
    return {"all": lambda: _fw.FoldCount_All(), "constant": lambda: _fw.FoldCount_Constant(payload),
            "from-channel": lambda: _fw.FoldCount_FromChannel(payload),
            "from-epilogue": lambda: _fw.FoldCount_FromEpilogue()}[case]()


def _kind(v):
    case, payload = _one(v)
    return {"none": lambda: _fw.ReadoutKind_None_(), "argmax": lambda: _fw.ReadoutKind_Argmax(),
            "sample": lambda: _fw.ReadoutKind_Sample(payload), "logits": lambda: _fw.ReadoutKind_Logits()}[case]()


def _pass(v):
    """{"ws", "embed", "window" (default: the number of embedded tokens), "fold" (default all),
    "readout": {"rows", "kind"} (default none), "epilogue": {"program", "seed"} (default none)}."""
    embed = _embed(v["embed"])
    window = v.get("window", len(embed.value) if isinstance(embed, _fw.Embed_Tokens) else 1)
    readout = v.get("readout", {"rows": [], "kind": "none"})
    call = v.get("epilogue")
    return _fw.Pass(v["ws"], embed, _fw.StateGeometry(window, _fold(v.get("fold", "all"))),
                    _fw.Readout(readout["rows"], _kind(readout["kind"])),
                    None if call is None else _fw.EpilogueCall(call["program"], call.get("seed", 0)))


def _grammar_kind(v):
    return _gr.GrammarKind[v.upper().replace("-", "_")]


def _bindings(v):
    return [_fw.ChannelBinding(b["name"], b["channel"]) for b in v]


def _messages(v):
    return [_tok.Message(m["role"], m["content"]) for m in v]


def _f32(v):
    return float(v)


def _bias(v):
    return [(int(t), float(b)) for t, b in v]


def _penalties(v):
    return _fw.Penalties(float(v["presence"]), float(v["frequency"]), float(v["repetition"]), int(v["output-start"]))


P = _plain
# every import: its binding and how each JSON argument becomes a WIT value
CALLS = {
    "runtime.get-arguments": (_rt.get_arguments, ()),
    "runtime.get-model-info": (_rt.get_model_info, ()),
    "runtime.send": (_rt.send, (P,)),
    "runtime.emit": (_rt.emit, (P,)),
    "runtime.emit-channel": (_rt.emit_channel, (P,)),
    "tokenizer.encode": (_tok.encode, (P,)),
    "tokenizer.decode": (_tok.decode, (P,)),
    "tokenizer.apply-chat-template": (_tok.apply_chat_template, (_messages, P)),
    "working-sets.create": (_ws.create, ()),
    "working-sets.frozen-length": (_ws.frozen_length, (P,)),
    "working-sets.tokens": (_ws.tokens, (P,)),
    "working-sets.fork": (_ws.fork, (P,)),
    "working-sets.truncate": (_ws.truncate, (P, P)),
    "working-sets.evict": (_ws.evict, (P, P, P)),
    "working-sets.commit": (_ws.commit, (P, P)),
    "working-sets.release": (_ws.release, (P,)),
    "channels.create": (_ch.create, (_element, P)),
    "channels.put": (_ch.put, (P, _cells)),
    "channels.read": (_ch.read, (P, P, P)),
    "channels.take": (_ch.take, (P,)),
    "channels.len": (_ch.len, (P,)),
    "channels.close": (_ch.close, (P,)),
    "channels.release": (_ch.release, (P,)),
    "forward.create-sampler": (_fw.create_sampler, (_f32, _f32, P)),
    "working-sets.create-uncached": (_ws.create_uncached, ()),
    "forward.create-filtered-sampler": (_fw.create_filtered_sampler, (_f32, _f32, P, _f32, _bias, P)),
    "forward.create-penalized-sampler": (_fw.create_penalized_sampler, (_f32, _f32, P, _f32, _bias, _penalties, P)),
    "forward.release-sampler": (_fw.release_sampler, (P,)),
    "forward.execute": (_fw.execute, (_pass,)),
    "forward.register-epilogue": (_fw.register_epilogue, (P, _bindings)),
    "forward.release-epilogue": (_fw.release_epilogue, (P,)),
    "forward.run-loop": (_fw.run_loop, (_pass, P)),
    "grammars.compile": (_gr.compile, (_grammar_kind, P)),
    "grammars.release-grammar": (_gr.release_grammar, (P,)),
    "grammars.create-matcher": (_gr.create_matcher, (P,)),
    "grammars.accept": (_gr.accept, (P, P)),
    "grammars.validate": (_gr.validate, (P, P)),
    "grammars.allowed": (_gr.allowed, (P,)),
    "grammars.forced": (_gr.forced, (P,)),
    "grammars.rollback": (_gr.rollback, (P, P)),
    "grammars.fork": (_gr.fork, (P,)),
    "grammars.state": (_gr.state, (P,)),
    "grammars.bind-matcher": (_gr.bind_matcher, (P, P, P)),
    "grammars.release-matcher": (_gr.release_matcher, (P,)),
}


# ---- WIT values -> JSON --------------------------------------------------------------------
def _kebab(name: str) -> str:
    out = ""
    for c in name.rstrip("_"):
        out += ("-" + c.lower()) if c.isupper() and out else c.lower()
    return out


def to_json(v):
    if isinstance(v, Enum):
        return v.name.lower().replace("_", "-")
    if is_dataclass(v):
        cls = type(v).__name__
        if "_" in cls:  # a variant case: Cells_Uint32(value) -> {"uint32": value}
            case = _kebab(cls.split("_", 1)[1])
            return {case: to_json(getattr(v, "value", None))}
        return {f.name.replace("_", "-"): to_json(getattr(v, f.name)) for f in fields(v)}
    if isinstance(v, (list, tuple)):
        return [to_json(x) for x in v]
    return v


# ---- variables -------------------------------------------------------------------------
def resolve(v, env: dict):
    if isinstance(v, str) and v.startswith("$"):
        name, *path = v[1:].split(".")
        if name not in env:
            raise Unbound(v)
        x = env[name]
        for p in path:
            x = x[int(p)] if isinstance(x, list) else x[p]
        return x
    if isinstance(v, list):
        return [resolve(x, env) for x in v]
    if isinstance(v, dict):
        return {k: resolve(x, env) for k, x in v.items()}
    return v


def perform(step: dict, env: dict) -> dict:
    fn, convert = CALLS[step["call"]]
    try:
        args = resolve(step.get("args", []), env)
    except Unbound as e:
        return {"unbound": str(e)}
    try:
        value = to_json(fn(*[c(a) for c, a in zip(convert, args)]))
    except Err as e:
        return {"error": e.value.code.name.lower().replace("_", "-"), "message": e.value.message}
    if step.get("as"):
        env[step["as"]] = value
    return {"ok": value}


class WitWorld(wit_world.WitWorld):
    def run(self) -> None:
        args = _rt.get_arguments()
        steps = json.loads(args[args.index("--steps") + 1])
        if "--start-at" in args:
            time.sleep(max(0.0, min(float(args[args.index("--start-at") + 1]) - time.time(), START_S)))
        env: dict = {}
        for i, step in enumerate(steps):
            out = perform(step, env)
            out["step"] = i
            _rt.send("\n" + MARK + json.dumps(out) + "\n")
        if "--hold" in args:
            _rt.send("\n" + MARK + json.dumps({"held": True}) + "\n")
            end = time.monotonic() + HOLD_S
            while time.monotonic() < end:  # the host's cancellation ends it at its next check
                time.sleep(0.02)
