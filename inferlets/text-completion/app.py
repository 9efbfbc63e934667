"""text-completion: plain autoregressive decoding, streaming text as it goes.

--loop device (default): the prompt's pass, then one looping pass, both with an epilogue that
samples the token, appends it to the output channel and writes it as the next window (none
after EOS, which ends the loop); the guest only takes committed tokens from the output channel.
--loop guest: one pass per token driven by the guest (execute with a host-side
argmax/sample readout, then emit: two crossings per token).
"""

from inferlet import Channel, ForwardPass, Model, Sampler, StateGeometry, UsageError, emit, emit_channel
from inferlet.decode import decode_program
from inferlet.world import generation_world


def guest_loop(model, ws, prompt, args) -> None:
    sampler = Sampler(args.temperature, args.top_p, args.seed, args.top_k, args.min_p, args.logit_bias,
                      args.penalties(len(prompt)))
    eos = set(model.eos_ids)
    window = prompt
    for _ in range(args.max_tokens):
        token = ForwardPass(ws, window).next_token(sampler)
        emit([token])
        if token in eos:
            break
        window = [token]


def device_loop(model, ws, prompt, args) -> None:
    out, window = Channel("u32", args.max_tokens), Channel("u32", 1)
    emit_channel(out)  # the host streams what the loop commits: no guest call per token
    ep = model.register_epilogue(decode_program(args, model.eos_ids, len(prompt)), {"out": out, "window": window})
    # The prompt is one pass, as in the guest loop and in HF generate: prefilling its head apart
    # from its last token gives other rounding in reduced precision, and other tokens.
    ForwardPass(ws, prompt, StateGeometry(len(prompt)), readout=[len(prompt) - 1], epilogue=ep,
                seed=args.seed).execute()
    if args.max_tokens > 1:  # draws are keyed by position: the same seed as the guest loop's sampler
        ForwardPass(ws, window, StateGeometry(1), readout=[0], epilogue=ep,
                    seed=args.seed).run_loop(args.max_tokens - 1)
    while out.take():  # waits for the loop; [] once it has ended
        pass


def generate(args) -> None:
    mode = args.extra["loop"]
    if mode not in ("device", "guest"):
        raise UsageError(f"--loop must be device or guest, not {mode!r}")
    model = Model()
    prompt = model.prompt_tokens(args)
    if args.max_tokens == 0:
        return
    ws = model.working_set()
    # the host releases every handle when the inferlet ends: no crossings to release them here
    (device_loop if mode == "device" else guest_loop)(model, ws, prompt, args)


WitWorld = generation_world(generate, {"--loop": ("device", str)})
