"""Plain decoding's epilogue: one token per round, shared by text-completion and windowed-attention."""

from .trace import Program


def decode_program(args, eos_ids, output_start: int = 0) -> str:
    """One token per round from the window's last row, appended to `out` and written to `window`
    as the next round's window (none after EOS: a loop whose window is empty ends; run_loop's
    round count ends it at the token limit). The window is free: the whole prompt in the first
    round, one token after; the pass folds all of it. output_start: where the output starts in the
    working set (the penalties' presence and frequency count from there)."""
    p = Program(readout=1)
    p.channel("out", "i64", args.max_tokens)
    p.channel("window", "i64", 1)
    logits = p.penalized(p.biased(p.logits(), args.logit_bias), args.penalties(output_start))
    if args.temperature > 0:
        tok = p.sample(logits, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    else:
        tok = logits.argmax()
    p.put("out", tok)
    first = tok[0]
    eos = p.const(False)
    for e in eos_ids:
        eos = eos | (first == e)
    p.set("window", tok, count=p.where(eos, 0, 1))
    return p.to_json()
