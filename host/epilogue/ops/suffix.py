"""Cross-request drafting: a continuation of the context from what earlier requests of the pass's
namespace read and wrote (the engine's suffix index, bound per pass as Env.suffix; its lookup runs
on the host, next to the pass)."""

from __future__ import annotations

import numpy as np
import torch

from host.epilogue.ir import Dim, Value
from host.epilogue.ops.spec import ARRAY, HOST, Attr, Variant, define, family

F = family("suffix", "Cross-request drafting (the suffix index of the pass's namespace, bound by the host):")


def _infer(t, av, at):
    ctx, length = av
    t.need(ctx, "i64"), t.rank(ctx, 1), t.need(length, "i64"), t.rank(length, 0)
    if at["max_match"] < at["min_match"]:
        t.fail(f"attr 'max_match'={at['max_match']} is below min_match={at['min_match']}")
    k = Dim.of(at["k"])
    return [Value("i64", (k,), ctx.ub), Value("i64", (), [k]), Value("f32", ()), Value("i64", (), [Dim.of(at["max_match"])])]


def _lookup(ctx, op, rows: list[list[int]], lengths: list[int]):
    """Per pass: (drafts padded with -1 to k, their number, score, match length)."""
    at = op.attrs
    k = at["k"]
    out = np.full((len(rows), k), -1, dtype=np.int64)
    counts, scores, matches = [], [], []
    for b, (row, n) in enumerate(zip(rows, lengths)):
        source = ctx.suffixes[b] if ctx.suffixes else None
        n = min(max(int(n), 0), len(row))
        context = row[:n]
        if source is None or any(x < 0 for x in context[-at["max_match"]:]):
            counts.append(0), scores.append(0.0), matches.append(0)
            continue
        d = source.draft(context[-at["max_match"]:], k, max_match=at["max_match"], factor=at["factor"],
                         min_prob=at["min_prob"], min_match=at["min_match"])
        out[b, :len(d.tokens)] = d.tokens
        counts.append(len(d.tokens)), scores.append(float(np.float32(d.score)))
        matches.append(d.match if d.tokens else 0)
    return out, counts, scores, matches


def _impl(ctx, op, a):
    out, counts, scores, matches = _lookup(ctx, op, a[0].tolist(), a[1].tolist())
    dev = ctx.device
    return [torch.from_numpy(out).to(dev), torch.tensor(counts, dtype=torch.int64, device=dev),
            torch.tensor(scores, dtype=torch.float32, device=dev), torch.tensor(matches, dtype=torch.int64, device=dev)]


def _host(ctx, op, seq, lengths):
    out, counts, scores, matches = _lookup(ctx, op, seq.tolist(), lengths)
    return out, counts, np.array(scores, dtype=np.float32), matches


define("suffix_draft", F, args=2, results=4,
       variants=(Variant((ARRAY, HOST), (ARRAY, HOST, ARRAY, HOST), _host, host_memory=True),),
       attrs={"k": Attr("int", lo=1, hi=1024), "min_match": Attr("int", 2, lo=2, hi=1024),
              "max_match": Attr("int", 32, lo=2, hi=1024), "factor": Attr("num", 1.0, lo=0.0, hi=1024.0),
              "min_prob": Attr("num", 0.1, lo=0.0, hi=1.0)},
       infer=_infer, impl=_impl,
       doc="""`suffix_draft(context: i64 [n], length: i64 []; k, min_match=2, max_match=32, factor=1.0,
min_prob=0.1)` -> (drafts i64 [k], count i64 [], score f32 [], match i64 []). A continuation of context[:length]
(clamped to [0, n]) from the texts (prompts and outputs) that earlier working sets of the pass's
namespace committed: the positions that follow its last two tokens, each matched backwards up to
`max_match` tokens; those matched longest (at least `min_match`) vote, step by step, for the token
most of them continue with; the draft's probability is the product of each step's share, and it
stops below `min_prob`, at k tokens, or at max(1, floor(factor x match length)). score = the sum of
those products (the draft's expected accepted tokens by the index's counts); match = the match
length the draft was found with (a longer match is likelier to go on). drafts past count are
-1; count, score and match 0 where nothing matches, where context's last max_match tokens hold a negative
token, and where the host binds no index (suffix drafting off). A namespace's texts join its index
when their working set is released (not one created uncached); another namespace's never do.
Typical: drafts from earlier requests where `ngram_lookup` over the request's own context finds
nothing or matched fewer tokens than `match`: `suffix_draft(ctx, ctx_len; k=K)`.""")
