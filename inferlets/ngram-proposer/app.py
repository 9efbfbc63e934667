"""ngram-proposer: speculative decoding with a proposer written in the guest, as a user would.

The proposer learns an n-gram table from the context as it grows: for every n-gram
(n = 1..ngram_max) it remembers where it was last followed by a token. To draft, it finds
the longest suffix of the context seen before and proposes the tokens that followed it.
The SDK's `inferlet.proposer.generate` does the rest: one verify pass per round, commit
the accepted rows, emit. Copy this folder to start your own proposer.
"""

from inferlet import Model, UsageError
from inferlet.proposer import Proposer, generate
from inferlet.world import generation_world


class NgramProposer(Proposer):
    def __init__(self, ngram_max: int = 3):
        self.n = ngram_max
        self.seq = []
        # last[g][gram] = index in seq of the token that followed `gram` most recently
        self.last = [dict() for _ in range(ngram_max + 1)]

    def update(self, tokens):
        for t in tokens:
            self.seq.append(t)
            i = len(self.seq) - 1  # t follows the grams ending at i - 1
            for g in range(1, self.n + 1):
                if i - g >= 0:
                    self.last[g][tuple(self.seq[i - g:i])] = i

    def draft(self, context, k):
        # our own copy of the context (self.seq) is what we index; `context` is the same list
        for g in range(min(self.n, len(self.seq)), 0, -1):
            at = self.last[g].get(tuple(self.seq[-g:]))
            if at is not None:
                return self.seq[at:at + k]
        return []


def run(args) -> None:
    model = Model()
    prompt = model.prompt_tokens(args)
    k, n = args.extra["draft_len"], args.extra["ngram_max"]
    if k < 0 or n < 1:
        raise UsageError("need --draft-len >= 0 and --ngram-max >= 1")
    generate(model, NgramProposer(n), prompt, args, draft_len=k)


WitWorld = generation_world(run, {"--draft-len": (6, int), "--ngram-max": (3, int)})
