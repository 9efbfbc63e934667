"""The WIT `forward` interface: samplers, epilogue registrations, and passes, run once
(`execute`) or as a device loop (`run-loop`).

A pass's WIT record becomes an engine Pass, or a DeviceLoop when it reads a channel, folds
from a channel or an epilogue, or names an epilogue. The engine (Engine.check_pass) and the
loop (DeviceLoop) check the pass's shape; here only its values are converted.
"""

from __future__ import annotations

import math

from wasmtime.component import Record, Variant

from ...engine import Fold, Pass
from ...engine.loop import DeviceLoop
from ...errors import InvalidArgument
from ...grammar import Matcher
from ..channels import Channel
from ...epilogue.ops.sampling import Penalties
from ..sampling import Context, Sampler, greedy
from .core import Instance
from .wit import any_value, case, f32, field, list_of, record, string, u32, u64

FOLDS = ("all", "constant", "from-channel", "from-epilogue")
KINDS = ("none", "argmax", "sample", "logits")
TOKEN_CHANNELS = ("uint32", "int32")


def _bias_pair(v, what: str) -> None:
    if not isinstance(v, tuple) or len(v) != 2:
        raise InvalidArgument(f"{what} must be a (token id, value) pair")
    u32(v[0], f"the token id of {what}")
    f32(v[1], f"the value of {what}")


class ForwardCalls:
    NAME = "forward"

    def __init__(self, inst: Instance):
        self.inst = inst

    def functions(self) -> dict:
        inst = self.inst
        return {
            "create-sampler": self.create_sampler,
            "create-filtered-sampler": self.create_filtered_sampler,
            "create-penalized-sampler": self.create_penalized_sampler,
            "release-sampler": lambda s: inst._release(s, Sampler, "sampler"),
            "execute": self.execute,
            "register-epilogue": self.register_epilogue,
            "release-epilogue": lambda e: inst._release(e, Registered, "epilogue"),
            "run-loop": self.run_loop,
        }

    def create_sampler(self, temperature: float, top_p: float, seed: int) -> int:
        f32(temperature, "temperature")
        f32(top_p, "top-p")
        u64(seed, "seed")
        return self.inst._new(lambda: Sampler(temperature, top_p, seed))

    def create_filtered_sampler(self, temperature: float, top_p: float, top_k: int, min_p: float, bias: list,
                                seed: int, penalties: Penalties | None = None) -> int:
        f32(temperature, "temperature")
        f32(top_p, "top-p")
        u32(top_k, "top-k")
        f32(min_p, "min-p")
        u64(seed, "seed")
        vocab = self.inst.engine.info.vocab_size
        by_id = {}
        for pair in list_of(bias, "bias", _bias_pair):
            tok, value = pair
            if tok >= vocab:
                raise InvalidArgument(f"bias token id {tok} is outside the vocabulary [0, {vocab})")
            if not math.isfinite(value):
                raise InvalidArgument(f"the bias of token {tok} is {value}, not a finite number")
            by_id[tok] = value
        return self.inst._new(lambda: Sampler(temperature, top_p, seed, top_k, min_p, by_id, penalties))

    def create_penalized_sampler(self, temperature: float, top_p: float, top_k: int, min_p: float, bias: list,
                                 penalties: Record, seed: int) -> int:
        pen = Penalties(f32(field(penalties, "presence", "penalties"), "presence"),
                        f32(field(penalties, "frequency", "penalties"), "frequency"),
                        f32(field(penalties, "repetition", "penalties"), "repetition"),
                        u32(field(penalties, "output-start", "penalties"), "output-start"))
        return self.create_filtered_sampler(temperature, top_p, top_k, min_p, bias, seed, pen)

    # ---- passes ------------------------------------------------------------------------
    def _pass(self, p: Record, rounds: int | None) -> tuple[Pass | DeviceLoop, Variant]:
        """A plain Pass, or a DeviceLoop (see the module's docstring); and the readout kind."""
        inst = self.inst
        ws = inst._ws(field(p, "ws", "the pass"))
        embed = field(p, "embed", "the pass")
        geometry = field(p, "geometry", "the pass")
        readout = field(p, "readout", "the pass")
        call = field(p, "epilogue", "the pass")
        fold = case(field(geometry, "fold", "geometry"), "fold", FOLDS)
        kind = case(field(readout, "kind", "readout"), "readout kind", KINDS)
        window = u32(field(geometry, "window", "geometry"), "geometry window")
        rows = list(list_of(field(readout, "rows", "readout"), "readout rows", u32))
        if fold.tag == "constant":
            u32(fold.payload, "fold constant")
        if kind.tag == "sample":
            inst._get(kind.payload, Sampler, "sampler")
        # embed's cases lower to different classes (list / int), so wasmtime-py gives the payload
        from_channel = not isinstance(embed, list)
        if not from_channel:
            list_of(embed, "embed tokens", u32)
            if window != len(embed):  # an engine Pass's window is its tokens
                raise InvalidArgument(f"geometry window {window} differs from the {len(embed)} embedded tokens")
        loop = rounds is not None or from_channel or fold.tag == "from-channel" or call is not None
        if not loop and fold.tag != "from-epilogue":
            inst.check_readout_rows(rows)
            return Pass(ws, embed, rows, fold=Fold.ALL if fold.tag == "all" else fold.payload), kind
        # a loop has no readout kind; a fold from an epilogue the pass does not name is the loop's to refuse
        if loop and kind.tag != "none":
            raise InvalidArgument("a pass that runs an epilogue or reads a channel takes readout kind `none`; "
                                  "its epilogue consumes the outputs")
        return self._loop(ws, embed, window, rows, fold, call, rounds), kind

    def _loop(self, ws, embed, window: int, rows: list[int], fold: Variant, call, rounds: int | None) -> DeviceLoop:
        inst = self.inst
        if isinstance(embed, list):  # literal tokens feed the first round through a private channel
            # of at least one cell: an empty window is the loop's to refuse
            src = Channel("uint32", max(window, 1), inst.engine.device)
            src.put(embed)
        else:
            src = inst._ch(embed)
            if src.element not in TOKEN_CHANNELS:
                raise InvalidArgument(f"a window is embedded from a u32 or i32 channel, not {src.element}")
        program, channels, matchers, seed = None, {}, {}, 0
        if call is not None:
            program, channels, matchers = inst._get(field(call, "program", "epilogue call"), Registered,
                                                    "epilogue").bound()
            seed = u64(field(call, "seed", "epilogue call"), "seed")
        # each readout row costs a logits row, unless the pass's epilogue reads no logits (a draft
        # head's prompt pass reads hidden states only: a row of the hidden size)
        if program is None or program.reads_logits:
            inst.check_readout_rows(rows)
        fold_channel = None
        if fold.tag == "from-channel":
            fold_channel = inst._ch(fold.payload)
            if fold_channel.element not in TOKEN_CHANNELS:
                raise InvalidArgument(f"a fold is read from a u32 or i32 channel, not {fold_channel.element}")
        rule = {"all": Fold.ALL, "from-channel": Fold.CHANNEL, "from-epilogue": Fold.EPILOGUE}.get(fold.tag, fold.payload)
        drafters = inst.engine.bind_drafters(program.checked.drafters, ws) if program is not None else {}
        # the loop records its rounds straight into the inferlet's draft statistics
        suffix = inst.engine.suffix_source(ws) if program is not None and program.uses_suffix else None
        return DeviceLoop(ws, program, channels, src, matchers=matchers, drafters=drafters, suffix=suffix, max_window=window,
                          rounds=rounds or 1, readout=rows, fold=rule, fold_channel=fold_channel, seed=seed,
                          stats=inst.draft_stats, on_round=inst.count_round,
                          hidden=program is not None and "hidden" in program.uses)

    def execute(self, p: Record) -> Record:
        inst = self.inst
        ps, kind = self._pass(p, None)
        if isinstance(ps, DeviceLoop):
            self._start(ps)
            ps.done.result()  # raises the pass's PieError
            return record(tokens=[], logits=[], frozen=ps.ws.frozen)
        # tokens are chosen on the compute thread right after the model call (on this inferlet
        # thread a reduction over the vocabulary would also start a second OpenMP pool)
        if kind.tag == "argmax":
            ps.choose = greedy
        elif kind.tag == "sample":
            sampler = inst.handles[kind.payload]
            ps.choose = sampler.sample
            if sampler.penalties is not None:  # row r counts the working set's tokens, then the window's to r
                held = len(ps.ws.tokens)
                context = Context(list(ps.ws.tokens) + list(ps.tokens), [held + r + 1 for r in ps.readout])
                ps.choose = lambda logits, at: sampler.sample(logits, at, context)
        inst.scored = ps.ws
        out = inst.scheduler.forward(ps)
        inst.passes += 1
        if ps.fold is not Fold.ALL and ps.fold < ps.window:  # the guest decides the fold later (commit)
            inst.draft_stats.drafted_window(ps.window)
        logits = out.logits.flatten().tolist() if kind.tag == "logits" else []
        return record(tokens=out.tokens or [], logits=logits, frozen=ps.ws.frozen)

    def run_loop(self, p: Record, rounds: int) -> None:
        if u32(rounds, "rounds") < 1:
            raise InvalidArgument("run-loop needs at least one round")
        loop, _ = self._pass(p, rounds)
        self._start(loop)

    def _start(self, loop: DeviceLoop) -> None:
        chans = {id(c): c for c in loop.channels.values()}
        for ch in chans.values():
            ch.attach_producer()

        def ended(fut) -> None:
            err = fut.exception()
            for ch in chans.values():
                ch.detach_producer(err)
        loop.done.add_done_callback(ended)
        self.inst.loops.append(loop)
        self.inst.scored = loop.ws
        self.inst.scheduler.start_loop(loop)

    # ---- epilogues ---------------------------------------------------------------------
    def register_epilogue(self, program: str, bindings: list) -> int:
        from ...epilogue import compile_program

        inst = self.inst
        chans = {}
        for b in list_of(bindings, "channels", any_value):
            name = string(field(b, "name", "a channel binding"), "a channel binding's name")
            if name in chans:
                raise InvalidArgument(f"channel {name!r} is bound twice")
            chans[name] = field(b, "channel", "a channel binding")
            inst._ch(chans[name])
        prog = compile_program(string(program, "program"))
        for name, spec in prog.checked.channels.items():
            if name not in chans:
                raise InvalidArgument(f"the epilogue declares channel {name!r}, but no channel is bound to it")
            ch = inst._ch(chans[name])
            if ch.capacity != spec.capacity:
                raise InvalidArgument(f"channel {name!r} has capacity {ch.capacity}; the epilogue declares {spec.capacity}")
            if (spec.dtype == "f32") != (ch.element == "float32") or (spec.dtype == "bool") != (ch.element == "boolean"):
                raise InvalidArgument(f"channel {name!r} holds {ch.element}; the epilogue declares {spec.dtype}")
        extra = set(chans) - set(prog.checked.channels)
        if extra:
            raise InvalidArgument(f"channel {sorted(extra)[0]!r} is bound but the epilogue does not declare it")
        inst.engine.check_drafters(prog.checked.drafters)
        return inst._new(lambda: Registered(inst, prog, chans))


class Registered:
    """A registered epilogue: the compiled program, its channel handles and its matcher handles
    (grammars.bind-matcher)."""

    def __init__(self, inst: Instance, program, channels: dict[str, int]):
        self.inst = inst
        self.program = program
        self.channels = channels
        self.matchers: dict[str, int] = {}

    def bound(self):
        missing = [m for m in self.program.checked.matchers if m not in self.matchers]
        if missing:
            raise InvalidArgument(f"the epilogue declares matcher {missing[0]!r}, but no matcher is bound to it "
                                  f"(grammars.bind-matcher)")
        matchers = {name: self.inst._get(h, Matcher, "matcher") for name, h in self.matchers.items()}
        return self.program, {name: self.inst._ch(h) for name, h in self.channels.items()}, matchers
