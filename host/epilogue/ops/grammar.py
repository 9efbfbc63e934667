"""Grammar constraints: the allowed-token masks of a window of drafts, and the commit of the
chosen tokens, through a grammar matcher the pass binds by name (Env.matchers; WIT `grammars`).
The matcher's work runs on the host, next to the pass; its results reach the device as tensors."""

from __future__ import annotations

import numpy as np
import torch

from host.epilogue.ir import Dim, ProgramError, Value
from host.epilogue.ops.spec import Attr, define, family

F = family("grammar", "Grammar constraints (a matcher declared in `matchers`, bound per pass):")


def _mask_infer(t, av, at):
    w = av[0]
    t.need(w, "i64"), t.rank(w, 1), t.matcher(at["matcher"])
    return [Value("bool", (w.shape[0], t.subst(Dim("V", 0))))]


def _mask(ctx, op, a):
    name, V = op.attrs["matcher"], ctx.bind["V"]
    masks = []
    for b, row in enumerate(a[0].tolist()):
        m = ctx.matchers[b][name].window_masks(_drafts_in_vocab(row, V))
        if m.shape[1] != V:
            raise ProgramError(f"matcher {name!r} covers {m.shape[1]} tokens but the logits have {V}")
        if m.shape[0] < len(row):  # rows past an out-of-vocabulary draft allow nothing
            m = np.concatenate([m, np.zeros((len(row) - m.shape[0], V), dtype=np.bool_)])
        masks.append(m)
    return [torch.from_numpy(np.stack(masks)).to(ctx.device)]


def _drafts_in_vocab(row: list[int], V: int) -> list[int]:
    """The window up to its first id outside [0, V) (a draft no grammar allows)."""
    for j, t in enumerate(row):
        if not 0 <= t < V:
            return row[:max(j, 1)] if j else [0]
    return row


define("grammar_mask", F, args=1, attrs={"matcher": Attr("matcher")}, infer=_mask_infer, impl=_mask,
       doc="""`grammar_mask(window: i64 [W]; matcher)` -> bool [W, V]. Row 0: the tokens the matcher
allows now (after what it has committed); row j: those it allows after also consuming window[1..j]
(the drafts); from the first draft the grammar forbids on, rows are all false. The matcher ends as
it began. With the window [t0, d1..dk] and logits read out on every row, `where(mask, logits, -big)`
gives each row's constrained logits; greedy or rejection-sampled verification over them never
accepts a forbidden draft, and its correction or bonus token is always allowed.""")


def _commit_infer(t, av, at):
    toks, cnt = av
    t.need(toks, "i64"), t.rank(toks, 1), t.need(cnt, "i64"), t.rank(cnt, 0), t.matcher(at["matcher"])
    k = at["k"]
    return [Value("i64", (Dim.of(k),), [t.subst(Dim("V", -1))]), Value("i64", (), [Dim.of(k)])]


def _commit(ctx, op, a):
    name, k = op.attrs["matcher"], op.attrs["k"]
    rows, counts = a[0].tolist(), a[1].tolist()
    forced = torch.full((ctx.B, k), -1, dtype=torch.int64)
    n_forced = []
    for b, (row, n) in enumerate(zip(rows, counts)):
        m = ctx.matchers[b][name]
        m.commit(row[:min(max(n, 0), len(row))], ctx.positions[b])
        f = m.forced_tokens(k)
        if f:
            forced[b, :len(f)] = torch.tensor(f, dtype=torch.int64)
        n_forced.append(len(f))
    return [forced.to(ctx.device), torch.tensor(n_forced, dtype=torch.int64, device=ctx.device)]


define("grammar_commit", F, args=2, results=2,
       attrs={"matcher": Attr("matcher"), "k": Attr("int", lo=0, hi=1024)},
       infer=_commit_infer, impl=_commit,
       doc="""`grammar_commit(tokens: i64 [n], count: i64 []; matcher, k)` -> (forced i64 [k], n i64 []).
The matcher consumes tokens[:count] (clamped to [0, n]; a token the grammar forbids is
`invalid-argument` and ends the loop), then returns up to k tokens the grammar now forces (jump-forward:
where exactly one continuation is allowed), padded with -1, and their number. The commit is keyed by
the pass's position: a run of the same pass again consumes nothing twice.""")
