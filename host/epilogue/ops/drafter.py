"""Draft heads: an MTP head attached to the model (`pie model import --drafter`) extends its own
KV rows over the rows a round commits and chains itself into the next window's drafts, on the
host's model thread, next to the pass (Env.drafters; the engine's HeadRunner)."""

from __future__ import annotations

import torch

from host.epilogue.ir import Dim, ProgramError, Value
from host.epilogue.tensors import Stream, uniforms
from host.epilogue.ops.spec import Attr, define, family

F = family("drafter", "Draft heads (attached to the model at import; named by `drafter`):")


def _draft_infer(t, av, at):
    hidden, toks, cnt = av[:3]
    t.need(hidden, "f32"), t.rank(hidden, 2), t.need(toks, "i64"), t.rank(toks, 1)
    t.need(cnt, "i64"), t.rank(cnt, 0), t.drafter(at["drafter"])
    if len(av) == 4:
        t.need(av[3], "i64"), t.rank(av[3], 0)
    k = at["k"]
    return [Value("i64", (Dim.of(k),), [t.subst(Dim("V", -1))]), Value("i64", (), [Dim.of(k)])]


def _bindings(ctx, name):
    binds = [d[name] for d in ctx.drafters]
    runner = binds[0].runner
    if any(b.runner is not runner for b in binds):  # one model per host: never in practice
        raise ProgramError(f"drafter {name!r} is bound to different heads within one batch")
    return runner, [b.state for b in binds]


def _draft(ctx, op, a):
    at = op.attrs
    runner, states = _bindings(ctx, at["drafter"])
    hidden, toks = a[0], a[1]
    n_rows = min(hidden.shape[1], toks.shape[1])
    counts = [min(max(c, 0), n_rows) for c in a[2].tolist()]
    k = at["k"]
    limits = [min(max(x, 0), k) for x in a[3].tolist()] if len(a) == 4 else [k] * len(states)
    T = float(at["temperature"])
    u = _coupled_draws(ctx, runner, counts, at["seed"]) if T > 0 else None
    drafts, n = runner.propose(states, hidden, toks, counts, k, T, u, limits, float(at["min_prob"]))
    return [drafts.to(ctx.device), torch.tensor(n, dtype=torch.int64, device=ctx.device)]


def _coupled_draws(ctx, runner, counts: list[int], salt: int):
    """DraftDraws for pass b's draft j: the uniforms verify_sample draws the target's own token with
    at the row that verifies it, the next window's row j (position: this window's first + the
    rows folded + j), over the head's draft vocabulary. A head drawing its draft from the target's
    uniforms drafts what the target draws wherever the two distributions agree (Gumbel-max
    coupling), and the committed tokens do not depend on the draft. It accepts as often as the
    rejection rule with q where head and target are alike and less where their shapes differ
    (`python -m bench.coupling`, eagle3 head: 0.48 against 0.47 accepted a draft at T=0.7, 0.49
    against 0.56 at T=1.0; docs/performance.md)."""
    V, ids = runner.vocab_size, runner.draft_ids

    def draws(bs: list[int], j: int) -> torch.Tensor:
        u = torch.stack([uniforms(ctx.seeds[b], ctx.positions[b] + counts[b] + j, Stream.SAMPLE, salt, [V], ctx.device)
                         for b in bs])
        return u if ids is None else u.index_select(1, ids.to(u.device))
    return draws


define("mtp_draft", F, args=(3, 4), results=2,
       attrs={"drafter": Attr("drafter"), "k": Attr("int", lo=1, hi=64),
              "temperature": Attr("num", 0.0, lo=0.0, hi=100.0), "seed": Attr("int", 0),
              "min_prob": Attr("num", 0.0, lo=0.0, hi=1.0)},
       infer=_draft_infer, impl=_draft,
       doc="""`mtp_draft(hidden: f32 [R, H], tokens: i64 [n], count: i64 [], [limit: i64 []]; drafter, k,
temperature=0, seed=0, min_prob=0)` -> (drafts i64 [k], n i64 []). The MTP head `drafter` runs over the window rows [0, count) (clamped
to [0, min(R, n)]): row r pairs the target's hidden state `hidden[r]` (readout on every row from
row 0; for an eagle3 head, the inputs of its layers, fused by its fc) with `tokens[r]`, the token that follows it; the head writes its own KV rows at those rows
(they must be the rows this pass folds). Then it chains: its last row's output drafts d1, which with
its output state drafts d2, and so on to k drafts: argmax, or with temperature > 0 drawn from the
head's softmax(logits / temperature) with the uniforms `verify_sample` draws the target's own token
with at the row that verifies the draft (coupled: where head and target agree, the head drafts
the target's draw). A head with a restricted draft
vocabulary only drafts ids in it. With `limit` (clamped to [0, k]) the chain stops at that many
drafts: 0 drafts nothing, and the host keeps the rows' inputs to write the head's rows in the pass
of the next round that drafts (a round that will not draft pays no head pass). n = min(k, limit) unless the chain reached the model's context or the pass's
spare rows (the host reserves k - 1 past the window for a program with this op); drafts past n are -1.
With min_prob > 0 the chain also stops before a draft whose probability under the head's softmax
(temperature 1, whatever `temperature` draws with) is below min_prob, the confidence stop: a draft
the head doubts costs a verify row and rarely pays (lossless: the verifier never sees it).
Typical: after verification, `mtp_draft(hidden, vt, cnt; ...)` gives the next window's drafts;
for a prefill of prompt p with fold len(p) - 1, `mtp_draft(hidden, p[1:], len(p) - 1; ...)`.""")


def _probs_infer(t, av, at):
    drafts, from_head = av
    t.need(drafts, "i64"), t.rank(drafts, 1), t.need(from_head, "bool"), t.rank(from_head, 0), t.drafter(at["drafter"])
    return [Value("f32", (drafts.shape[0], t.subst(Dim("V", 0))))]


def _probs(ctx, op, a):
    runner, states = _bindings(ctx, op.attrs["drafter"])
    drafts, flags = a[0], a[1].tolist()
    k, V = drafts.shape[1], ctx.bind["V"]
    if runner.vocab_size != V:
        raise ProgramError(f"drafter {op.attrs['drafter']!r} covers {runner.vocab_size} tokens but the logits have {V}")
    rows = []
    for b, (state, flag) in enumerate(zip(states, flags)):
        d = drafts[b].tolist()
        if flag:
            rows.append(runner.probs(state, d).to(ctx.device))
        else:  # deterministic drafts: q is one-hot at each draft
            q = torch.zeros(k, V, dtype=torch.float32, device=ctx.device)
            for j, x in enumerate(d):
                if 0 <= x < V:
                    q[j, x] = 1.0
            rows.append(q)
    return [torch.stack(rows)]


define("draft_probs", F, args=2, attrs={"drafter": Attr("drafter")}, infer=_probs_infer, impl=_probs,
       doc="""`draft_probs(drafts: i64 [k], from_head: bool []; drafter)` -> f32 [k, V]: the q of
`verify_sample` for this window's drafts. With from_head, the distributions the head drew them from
in its last `mtp_draft` for this working set (it must have proposed exactly this window's drafts,
else `invalid-argument`); otherwise one-hot rows at the drafts (drafts from elsewhere, e.g. prompt
lookup, are deterministic). Rows past the drafts' end (-1) are zero.""")
