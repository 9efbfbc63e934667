"""Write your own proposer: a guest-side drafting interface and the SDK loop that verifies it.

A proposer drafts tokens; the SDK verifies them against the target model and commits what
the target agrees with, so the output is exactly what plain decoding gives (greedy: token
for token; sampled: the same distribution, by Leviathan et al.'s rejection rule).

    from inferlet import Model, parse_generation_args, arguments
    from inferlet.proposer import Proposer, generate

    class MyProposer(Proposer):
        def update(self, tokens):          # tokens appended to the context: first the whole
            ...                            # prompt, then each round's committed tokens
        def draft(self, context, k):       # up to k guesses of the tokens after `context`
            return [...]                   # or ([...], [[p_0..p_V-1], ...]) with their
                                           # draft distributions, for sampled runs

    args = parse_generation_args(arguments(), {"--draft-len": (6, int)})
    generate(Model(), MyProposer(), prompt_ids, args, draft_len=args.extra["draft_len"])

One round of `generate` is one forward pass over the window [t0, d1..dk] (t0: the last
committed token, d: the drafts) at the working set's frozen end with fold 0 and a readout on
every row, then `WorkingSet.commit(1 + accepted)` freezes t0 and the accepted drafts (their
KV is already written: nothing is recomputed; rejected rows are overwritten by the next pass).

- Greedy (temperature 0): the readout is the target's argmax per row (a host sampler's when a
  logit bias or penalties change it); accept the longest prefix of drafts equal to it, plus the
  target's token at the first mismatch (or after the last draft). Three crossings per round:
  execute, commit, emit; drafting itself is guest-only.
- Sampled (temperature > 0): the readout is the target's logits rows (expensive: a full
  vocabulary row per window row crosses the boundary); the bias, the penalties (row i counting
  the drafts before it), temperature and top-p are applied here in pure Python and `speculative.verify` decides, with `random.Random(seed)`, so a
  seeded run repeats exactly.

Output is cut after the first EOS and at --max-tokens exactly as plain decoding cuts it.
"""

import math
import random
import struct

from .api import ForwardPass, Sampler, StateGeometry, emit
from .speculative import verify


class Proposer:
    """Subclass this. Both methods run inside the guest; neither touches the host."""

    def update(self, tokens: list) -> None:
        """`tokens` were appended to the context: the whole prompt once, then after every
        round the committed tokens (accepted drafts, then the target's own token)."""

    def draft(self, context: list, k: int):
        """Guess up to `k` tokens that follow `context` (the prompt and every committed
        token; do not modify it). Return a list of token ids (may be empty: the round then
        decodes one token), or (tokens, probs) where probs[i] is the distribution over the
        vocabulary token i was drawn from; without probs a draft counts as certain (one-hot)."""
        return []


def _biased(row, bias) -> list:
    """The row with the logit bias added (in float32, as the host adds it)."""
    if not bias:
        return row
    row = list(row)
    for t, b in bias.items():
        if 0 <= t < len(row):
            row[t] = _f32(row[t] + _f32(b))
    return row


class _Counts:
    """Token counts of the context the penalties see: every token (repetition) and the output's
    (presence, frequency: context index >= output_start)."""

    def __init__(self, output_start: int):
        self.start, self.n, self.every, self.out = output_start, 0, {}, {}

    def add(self, tokens) -> None:
        for t in tokens:
            self.every[t] = self.every.get(t, 0) + 1
            if self.n >= self.start:
                self.out[t] = self.out.get(t, 0) + 1
            self.n += 1

    def plus(self, tokens) -> "_Counts":
        c = _Counts(self.start)
        c.n, c.every, c.out = self.n, dict(self.every), dict(self.out)
        c.add(tokens)
        return c


def _penalized(row, counts: _Counts, pen) -> list:
    """The row with the penalties applied (in float32, step by step as the host's `penalize`)."""
    if pen is None:
        return row
    row = list(row)
    r, f, pr = _f32(pen.repetition), _f32(pen.frequency), _f32(pen.presence)
    for t in counts.every:
        if not 0 <= t < len(row):
            continue
        x = row[t]
        if r != 1:
            x = _f32(x / r) if x > 0 else _f32(x * r)
        c = counts.out.get(t, 0)
        if c and f != 0:
            x = _f32(x - _f32(f * c))
        if c and pr != 0:
            x = _f32(x - pr)
        row[t] = x
    return row


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _probs(row, temperature: float, top_p: float, top_k: int = 0, min_p: float = 0.0) -> list:
    """The one sampling rule's distribution, unnormalised (fine for verify): softmax(row /
    temperature), then top-k (ties with the k-th kept), min-p (below min_p times the top one's
    weight dropped), then the smallest top set whose mass reaches top_p, as the host's rule."""
    m = max(row)
    w = [math.exp((x - m) / temperature) for x in row]
    if 0 < top_k < len(w):
        kth = sorted(w, reverse=True)[top_k - 1]
        w = [x if x >= kth else 0.0 for x in w]
    if min_p > 0:  # the top weight is exp(0) = 1
        w = [x if x >= min_p else 0.0 for x in w]
    if top_p < 1.0:
        total = sum(w)
        order = sorted(range(len(w)), key=w.__getitem__, reverse=True)
        keep, acc = [], 0.0
        for i in order:
            keep.append(i)
            acc += w[i]
            if acc >= top_p * total:
                break
        kept = [0.0] * len(w)
        for i in keep:
            kept[i] = w[i]
        w = kept
    return w


class _LazyRows:
    """Target distributions computed on first use: verify stops at the first rejection, so
    rows past it are never softmaxed."""

    def __init__(self, flat, rows: int, vocab: int, temperature: float, top_p: float, top_k: int = 0,
                 min_p: float = 0.0, bias=None, penalties=None, counts=None, drafts=()):
        self._flat, self._rows, self._vocab, self._bias = flat, rows, vocab, bias
        self._pen, self._counts, self._drafts = penalties, counts, drafts
        self._t, self._p, self._k, self._min_p = temperature, top_p, top_k, min_p
        self._cache = {}

    def __len__(self):
        return self._rows

    def __getitem__(self, i):
        if i not in self._cache:
            row = _biased(self._flat[i * self._vocab:(i + 1) * self._vocab], self._bias)
            if self._pen is not None:  # row i sees the drafts before it
                row = _penalized(row, self._counts.plus(self._drafts[:i]), self._pen)
            self._cache[i] = _probs(row, self._t, self._p, self._k, self._min_p)
        return self._cache[i]


def _split(proposal):
    if isinstance(proposal, tuple):
        tokens, probs = proposal
        return [int(t) for t in tokens], (None if probs is None else list(probs))
    return [int(t) for t in proposal], None


def generate(model, proposer: Proposer, prompt: list, args, draft_len: int = 6, ws=None) -> list:
    """Speculative decoding with `proposer`; emits the output as it is committed and returns it.

    args: GenerationArgs (max_tokens, the sampling rule's fields, seed). draft_len: most drafts per
    round (0: plain decoding). ws: a working set to continue (default: a new one, released
    at the end); `prompt` goes at its frozen end, and the output after it (the penalties'
    output starts there).
    """
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    out = []
    if args.max_tokens <= 0:
        return out
    own = ws is None
    if own:
        ws = model.working_set()
    eos = set(model.eos_ids)
    greedy = args.temperature <= 0
    rng = random.Random(args.seed)
    held = [] if own else ws.tokens()
    pen = args.penalties(len(held) + len(prompt))
    counts = _Counts(len(held) + len(prompt))
    counts.add(held + prompt)
    # greedy under a bias or penalties: the host's sampler at temperature 0 applies them
    chooser = Sampler(0.0, 1.0, 0, 0, 0.0, args.logit_bias, pen) if greedy and (args.logit_bias or pen) else None
    try:
        if len(prompt) > 1:
            ForwardPass(ws, prompt[:-1]).execute()  # prefill, fold all; t0 = prompt[-1] opens round one
        context = list(prompt)
        proposer.update(list(prompt))
        t0 = prompt[-1]
        while len(out) < args.max_tokens:
            # drafts past the token budget could never be emitted
            k = max(0, min(int(draft_len), args.max_tokens - len(out) - 1))
            drafts, dprobs = _split(proposer.draft(context, k)) if k else ([], None)
            drafts = drafts[:k]
            if dprobs is not None:
                if len(dprobs) < len(drafts):
                    raise ValueError("the proposer returned fewer probability rows than drafts")
                dprobs = dprobs[:len(drafts)]
            window = [t0] + drafts
            fp = ForwardPass(ws, window, StateGeometry(len(window), fold=0), readout=list(range(len(window))))
            if greedy:
                target = fp.tokens(chooser)
                n = 0
                while n < len(drafts) and drafts[n] == target[n]:
                    n += 1
                committed = drafts[:n] + [target[n]]
            else:
                rows = _LazyRows(fp.logits(), len(window), model.vocab_size, args.temperature, args.top_p,
                                 args.top_k, args.min_p, args.logit_bias, pen, counts, drafts)
                committed = verify(drafts, dprobs, rows, rng)
                n = len(committed) - 1
            # cut after the first EOS and at the budget, as plain decoding stops
            stop = False
            for i, t in enumerate(committed):
                if t in eos:
                    committed, stop = committed[:i + 1], True
                    break
            room = args.max_tokens - len(out)
            if len(committed) >= room:
                committed, stop = committed[:room], True
            # t0 and the accepted drafts (fewer when the output was cut); the target's token
            # is next round's t0. Also on the last round, so the host's accepted count is whole.
            # Before the emit: the host scores emitted ids by the rows frozen before them (logprobs).
            ws.commit(min(1 + n, len(committed)))
            emit(committed)
            out += committed
            if stop:
                break
            context += committed
            counts.add(committed)
            proposer.update(committed)
            t0 = committed[-1]
    finally:
        if chooser is not None:
            chooser.release()
        if own:
            ws.release()
    return out
