"""text-completion: plain autoregressive decoding, streaming text as it goes.

--loop device (default): one prefill pass, then one looping pass whose epilogue samples the
token, appends it to the output channel, writes it as the next window and stops at EOS or
the limit; the guest only takes committed tokens from the output channel.
--loop guest: one pass per token driven by the guest (execute with a host-side
argmax/sample readout, then emit: two crossings per token).
"""

import wit_world
from componentize_py_types import Err
from inferlet import (Channel, ForwardPass, Model, PieError, Sampler, StateGeometry, UsageError, arguments, emit,
                      emit_channel, parse_generation_args)
from inferlet.trace import Program


def guest_loop(model, ws, prompt, args) -> None:
    sampler = Sampler(args.temperature, args.top_p, args.seed)
    eos = set(model.eos_ids)
    window = prompt
    for _ in range(args.max_tokens):
        token = ForwardPass(ws, window).next_token(sampler)
        emit([token])
        if token in eos:
            break
        window = [token]
    sampler.release()


def decode_program(args, eos_ids) -> str:
    """The device loop's epilogue: one token per round."""
    p = Program(window=1, readout=1)
    p.channel("out", "i64", args.max_tokens)
    p.channel("window", "i64", 1)
    logits = p.logits()
    if args.temperature > 0:
        tok = p.sample(logits, temperature=args.temperature, top_p=args.top_p if args.top_p < 1 else None)
    else:
        tok = logits.argmax()
    p.put("out", tok)
    p.set("window", tok)
    p.fold(p.const(1))
    done = p.round() >= args.max_tokens - 1  # one token per round (the host drains "out" as it streams)
    first = tok[0]
    for e in eos_ids:
        done = done | (first == e)
    p.stop_if(done)
    return p.to_json()


def device_loop(model, ws, prompt, args) -> None:
    if len(prompt) > 1:
        ForwardPass(ws, prompt[:-1]).execute()
    out, window = Channel("u32", args.max_tokens), Channel("u32", 1)
    window.put(prompt[-1:])
    emit_channel(out)  # the host streams what the loop commits: no guest call per token
    ep = model.register_epilogue(decode_program(args, model.eos_ids), {"out": out, "window": window})
    ForwardPass(ws, window, StateGeometry(1, fold="epilogue"), readout=[0], epilogue=ep,
                seed=args.seed).run_loop(args.max_tokens)
    while out.take():  # waits for the loop; [] once it has ended
        pass
    ep.release()
    out.release()
    window.release()


def generate(args) -> None:
    mode = args.extra["loop"]
    if mode not in ("device", "guest"):
        raise UsageError(f"--loop must be device or guest, not {mode!r}")
    model = Model()
    prompt = model.prompt_tokens(args)
    if args.max_tokens == 0:
        return
    ws = model.working_set()
    (device_loop if mode == "device" else guest_loop)(model, ws, prompt, args)
    ws.release()


class WitWorld(wit_world.WitWorld):
    def run(self) -> None:
        try:
            generate(parse_generation_args(arguments(), {"--loop": ("device", str)}))
        except (PieError, UsageError) as e:
            raise Err(str(e))
