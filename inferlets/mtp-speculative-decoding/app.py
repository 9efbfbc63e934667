"""mtp-speculative-decoding: the model's MTP head drafts; everything per round runs on the device.

The guest runs the prompt's pass (readout on every row, all but the last token folded) with an
epilogue that runs the head over the prompt and drafts the first window, then starts one looping
pass whose epilogue verifies the window, commits the accepted prefix, extends the head over the
committed rows and chains it into the next window (`inferlet.mtp`). The guest only takes the
committed tokens: no call per round.
"""

from inferlet import Model, UsageError, cacheback, mtp
from inferlet.loop import head_prompt_pass, run_window_loop
from inferlet.world import generation_world

# --draft-len 2: on a CPU each verified row costs a share of a pass, and a chained head's later
# drafts are accepted less often than its first (docs/performance.md has the MTP figures)
# --min-prob P: the chain stops before a draft the head gives less than P (0: never)
# --rejection 1: sampled drafts verified by Leviathan's rule with the head's q, not against the target's
# own draws (the same distribution; the tokens then depend on the drafts)
EXTRA = {"--draft-len": (2, int), "--drafter": ("", str), "--fixed": (0, int),
         "--min-prob": (cacheback.HEAD_MIN_PROB, float), "--rejection": (0, int)}


def generate(args) -> None:
    model = Model()
    prompt = model.prompt_tokens(args)
    K, name = args.extra["draft_len"], args.extra["drafter"] or (model.drafters[0] if model.drafters else "")
    if K < 1:
        raise UsageError("need --draft-len >= 1 (text-completion is the plain decoder)")
    if not name:
        raise UsageError(f"model {model.name!r} has no draft head attached; import it with "
                         f"`pie model import {model.name} --drafter NAME`")
    if name not in model.drafters:
        raise UsageError(f"model {model.name!r} has no drafter {name!r} (attached: {', '.join(model.drafters)})")
    if args.max_tokens == 0:
        return
    try:
        program, specs = mtp.mtp_program(
            drafter=name, start=len(prompt) - 1, draft_len=K, eos_ids=model.eos_ids, max_tokens=args.max_tokens,
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, logit_bias=args.logit_bias, adaptive=not args.extra["fixed"],
            penalties=args.penalties(len(prompt)), min_prob=args.extra["min_prob"],
            rejection=bool(args.extra["rejection"]))
        first = mtp.mtp_prefill_program(drafter=name, draft_len=K, max_tokens=args.max_tokens,
                                        temperature=args.temperature,
                                        min_prob=args.extra["min_prob"])
    except ValueError as e:
        raise UsageError(str(e)) from None
    ws = model.working_set()

    run_window_loop(model, ws, program, specs, K, args.max_tokens, args.seed,
                    prefill=lambda chans: head_prompt_pass(model, ws, prompt, first, chans["window"], args.seed))
    ws.release()


WitWorld = generation_world(generate, EXTRA)
