"""cacheback-speculative-decoding: prompt-lookup speculative decoding entirely on the device.

Where the texts of earlier requests in the same namespace match the context longer than its own
text does, the drafts come from them (the host's suffix index; --suffix-draft 0 turns that off).

With --drafter NAME (an MTP head attached to the model), the hybrid: prompt lookup drafts where
the context offers a match, the head drafts otherwise, in the same one device program; with
--min-prob P (default 0.2) the head's chain stops before a draft it gives less than probability P.

The guest prefills prompt[:-1], traces the Cacheback program (`inferlet.cacheback`:
verify the window [t0, d1..dK] against the target, append the committed tokens to "out",
fold 1 + accepted rows, draft the next window by prompt lookup / an LRU n-gram table, stop
at EOS or max-tokens), and starts one looping pass whose window comes from the program's
"window" channel. Then it only takes the committed tokens from "out" as they arrive: a few
guest calls for the whole run instead of two per token.
"""

from inferlet import ForwardPass, Model, UsageError, cacheback, mtp
from inferlet.loop import head_prompt_pass, run_window_loop
from inferlet.world import generation_world

# ngram-min 2: single-token matches propose drafts nearly every round and are mostly wrong, and
# verifying any draft costs a step (a 2-row pass ~1.2x a 1-row pass on a CPU, 9 rows ~1.4x).
# The lookup window covers most chat contexts whole (the LRU table holds what leaves it); the
# lookup is one vectorised pass whatever its length (a byte search on the CPU).
EXTRA = {"--draft-len": (8, int), "--ngram-max": (3, int), "--ngram-min": (2, int), "--drafter": ("", str),
         "--head-len": (3, int), "--suffix-draft": (1, int),
         "--min-prob": (cacheback.HEAD_MIN_PROB, float)}
LOOKUP_WINDOW = 1024


def generate(args) -> None:
    model = Model()
    prompt = model.prompt_tokens(args)
    K, nmin, nmax = args.extra["draft_len"], args.extra["ngram_min"], args.extra["ngram_max"]
    drafter, H = args.extra["drafter"] or None, args.extra["head_len"]
    if K < 0 or not 1 <= nmin <= nmax:
        raise UsageError("need --draft-len >= 0 and 1 <= --ngram-min <= --ngram-max")
    if drafter is not None and drafter not in model.drafters:
        have = ", ".join(model.drafters) or "none is attached"
        raise UsageError(f"model {model.name!r} has no drafter {drafter!r} ({have})")
    if args.max_tokens == 0:
        return
    try:
        program, specs = cacheback.cacheback_program(
            prompt=prompt, draft_len_max=K, ngram_min=nmin, ngram_max=nmax, eos_ids=model.eos_ids,
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, logit_bias=args.logit_bias,
            penalties=args.penalties(len(prompt)),
            lookup_window=max(LOOKUP_WINDOW, 2 * K + 2), drafter=drafter, head_len=H,
            suffix=bool(args.extra["suffix_draft"]), min_prob=args.extra["min_prob"])
        first = None if drafter is None else mtp.mtp_prefill_program(
            drafter=drafter, draft_len=H, max_tokens=args.max_tokens, temperature=args.temperature,
            window_capacity=max(K, H) + 1, min_prob=args.extra["min_prob"])
    except ValueError as e:
        raise UsageError(str(e)) from None
    ws = model.working_set()

    def prefill(chans):
        if first is None:  # fold all; prompt[-1] is the first window's t0
            if len(prompt) > 1:
                ForwardPass(ws, prompt[:-1]).execute()
            return
        head_prompt_pass(model, ws, prompt, first, chans["window"], args.seed)  # drafts the first window

    run_window_loop(model, ws, program, specs, max(K, H if drafter else 0), args.max_tokens, args.seed, prefill=prefill)
    ws.release()


WitWorld = generation_world(generate, EXTRA)
