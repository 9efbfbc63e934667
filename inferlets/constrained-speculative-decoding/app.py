"""constrained-speculative-decoding: speculative decoding under a grammar constraint.

The guest compiles the grammar (--json-schema, --regex or --grammar) on the host, prefills
prompt[:-1], traces the constrained program (`inferlet.constrained`: masked verification of the
window, commit to the matcher, forced tokens and prompt lookup as the next drafts), binds its
matcher and starts one looping pass. Then it only waits while the host streams "out". The
output always matches the grammar; a run cut by --max-tokens before the grammar is complete
ends with its last token not an end-of-sequence one (the run's stats say "finish": "length").
"""

from inferlet import ForwardPass, Grammar, Model, UsageError, constrained
from inferlet.loop import run_window_loop
from inferlet.world import generation_world

EXTRA = {"--json-schema": ("", str), "--regex": ("", str), "--grammar": ("", str), "--draft-len": (8, int),
         "--ngram-max": (3, int), "--ngram-min": (2, int)}
LOOKUP_WINDOW = 1024


def grammar_of(extra) -> Grammar:
    given = [(kind, extra[key]) for kind, key in (("json-schema", "json_schema"), ("regex", "regex"), ("lark", "grammar"))
             if extra[key]]
    if len(given) != 1:
        raise UsageError("pass exactly one of --json-schema TEXT, --regex R, --grammar TEXT")
    return Grammar(*given[0])


def generate(args) -> None:
    model = Model()
    K, nmin, nmax = args.extra["draft_len"], args.extra["ngram_min"], args.extra["ngram_max"]
    if K < 0 or not 1 <= nmin <= nmax:
        raise UsageError("need --draft-len >= 0 and 1 <= --ngram-min <= --ngram-max")
    grammar = grammar_of(args.extra)  # a bad grammar fails before any model work
    prompt = model.prompt_tokens(args)
    if args.max_tokens == 0:
        return
    matcher = grammar.matcher()
    ws = model.working_set()
    if len(prompt) > 1:
        ForwardPass(ws, prompt[:-1]).execute()  # fold all; prompt[-1] is the first window's t0
    try:
        program, specs = constrained.constrained_program(
            prompt=prompt, draft_len_max=K, ngram_min=nmin, ngram_max=nmax, eos_ids=model.eos_ids,
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, logit_bias=args.logit_bias,
            penalties=args.penalties(len(prompt)),
            lookup_window=LOOKUP_WINDOW, forced=matcher.forced())
    except ValueError as e:
        raise UsageError(str(e)) from None
    run_window_loop(model, ws, program, specs, K, args.max_tokens, args.seed,
                    bind=lambda ep: matcher.bind(ep, constrained.MATCHER))
    matcher.release()
    grammar.release()
    ws.release()


WitWorld = generation_world(generate, EXTRA)
