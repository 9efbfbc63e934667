"""windowed-attention: decoding past the model's context length with bounded KV pages.

The working set keeps its first `--sinks` rows (attention sinks: the early tokens that take
much of every row's attention) and its last `--window` rows, and holds at most
sinks + window + step rows. Decoding runs on the device as text-completion's device loop does,
in segments of up to `--step` rounds; between segments the guest evicts the middle rows
[sinks, frozen - window) with `working-sets.evict`, one call per segment (one device copy of
the window's rows), so pages stay bounded however long the generation. Evicted rows keep no
trace; the rows after them keep their positions, so positions go on past the context length.
Until the first eviction the passes are text-completion's (the prompt as one pass, one row a
round), so the tokens are the same.
"""

from inferlet import Channel, ForwardPass, Model, StateGeometry, UsageError, emit_channel
from inferlet.decode import decode_program
from inferlet.world import generation_world

EXTRA = {"--sinks": (4, int), "--window": (0, int), "--step": (64, int)}


class Window:
    """The eviction policy: which rows to keep, and when to drop the rest."""

    def __init__(self, sinks: int, window: int, step: int, context: int):
        if window == 0:
            window = context - sinks - step
        if sinks < 0 or window < 1 or step < 1:
            raise UsageError("need --sinks >= 0, --window >= 1 and --step >= 1")
        if sinks + window + step > context:
            raise UsageError(f"--sinks {sinks} + --window {window} + --step {step} exceed the model's context "
                             f"of {context} rows")
        self.sinks, self.window, self.step, self.cap = sinks, window, step, sinks + window + step

    def make_room(self, ws, frozen: int, rows: int) -> int:
        """Evict the middle if `rows` more do not fit under the cap; returns the frozen length."""
        if frozen + rows <= self.cap:
            return frozen
        ws.evict(self.sinks, frozen - self.window)  # frozen > sinks + window here: the range is not empty
        return self.sinks + self.window


def prefill(ws, prompt, policy: Window, ep, seed: int) -> int:
    """The prompt as one pass when it fits under the cap (as text-completion runs it), else in
    pieces of at most `step` rows after the first, evicting before each; the last piece runs the
    epilogue, which yields the first token. Returns the frozen length."""
    pieces = [prompt[:policy.cap]]
    pieces += [prompt[i:i + policy.step] for i in range(policy.cap, len(prompt), policy.step)]
    frozen = 0
    for i, piece in enumerate(pieces):
        frozen = policy.make_room(ws, frozen, len(piece))
        last = i == len(pieces) - 1
        ForwardPass(ws, piece, StateGeometry(len(piece)), readout=[len(piece) - 1], epilogue=ep if last else None,
                    seed=seed).execute()
        frozen += len(piece)
    return frozen


def generate(args) -> None:
    model = Model()
    policy = Window(args.extra["sinks"], args.extra["window"], args.extra["step"], model.context_length)
    prompt = model.prompt_tokens(args)
    if args.penalties(len(prompt)) is not None:
        raise UsageError("windowed-attention takes no penalties: it evicts the context they count")
    if args.max_tokens == 0:
        return
    ws = model.working_set()
    out, window = Channel("u32", args.max_tokens), Channel("u32", 1)
    emit_channel(out)  # the host streams what the loops commit
    ep = model.register_epilogue(decode_program(args, model.eos_ids), {"out": out, "window": window})
    frozen = prefill(ws, prompt, policy, ep, args.seed)
    left = args.max_tokens - 1
    while left > 0 and len(window):  # an empty window: the last token was EOS
        frozen = policy.make_room(ws, frozen, 1)
        rounds = min(left, policy.cap - frozen)
        ForwardPass(ws, window, StateGeometry(1), readout=[0], epilogue=ep, seed=args.seed).run_loop(rounds)
        while out.take():  # waits for the loop; [] once it has ended
            pass
        frozen += rounds  # exact unless the loop met EOS, which empties the window and ends this
        left -= rounds


WitWorld = generation_world(generate, EXTRA)
