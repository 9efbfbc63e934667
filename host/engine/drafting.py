"""Draft heads on the engine: an MTP head (host/drafter/mtp.py) run over the paged KV pool.

The head's block has its own KV layer in the pool (the engine allocates one more layer per head),
so its rows live in the working set's pages: forks share them, evictions and page copies move them
with the target's, and only rows below the frozen end are ever attended to. The head's row r pairs
the target's hidden state at row r with the token that follows it, so a round gives the head's
rows for exactly the rows it folds, and its chained drafts go to scratch rows past them (the next
round overwrites those, as it does the target's rejected rows).

A round that will not draft (limit 0) only keeps its rows' inputs (Pending): the head writes them,
with the rows of the round that next drafts, in that round's one pass over its block. Only the
head reads its rows, and it catches up before it does. Pending rows whose rows were edited since
(truncate, evict) are dropped unwritten: the head's drafts there may be worse, never the output.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from ..epilogue.tensors import argmax, exp_race
from ..errors import InvalidArgument
from . import attention, blocks
from .blocks import BlockLinear
from .linear import PackedLinears
from .readout import Readout
from .stack import LayerStack
from .working_set import WorkingSet


# Pending rows past which a round writes them even when it does not draft: one catch-up pass over
# this many rows still runs the block's products on the few-row path (skinny_linear's 32 rows).
CATCH_UP_ROWS = 32


@dataclass
class Pending:
    """The inputs of the head's rows [start, start + rows) not written yet: each folded row's
    target hidden state and the token that follows it, as the rounds that folded them gave them."""

    start: int
    edits: int  # the working set's edits when the first was kept: another count means they are stale
    tokens: list[torch.Tensor] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    rows: int = 0

    def current(self, ws: WorkingSet) -> bool:
        """Whether they are still the rows up to the frozen end, none edited since."""
        return self.edits == ws.edits and self.start + self.rows == ws.frozen


@dataclass
class DraftState:
    """One working set's binding to a head: the rows it has not written yet, and the distributions
    of its last proposal (sampled drafts). It refers to the working set weakly: the head's table of
    states must not keep it alive."""

    _ws: weakref.ref
    q: list[torch.Tensor] | None = None  # the head's [Vd] distributions of its last proposal's drafts, in order
    drafts: torch.Tensor | None = None  # that proposal (read only when q is asked for)
    at: int = -1  # the frozen length its window starts at
    pending: Pending | None = None

    @property
    def ws(self) -> WorkingSet:
        return self._ws()

    def drop_stale(self) -> None:
        """Forget pending rows that are no longer the ones up to the frozen end."""
        if self.pending is not None and not self.pending.current(self.ws):
            self.pending = None

    def keep(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        """Add this round's rows (from the frozen end) to the pending ones, dropping those that no
        longer end where this round's begin."""
        self.drop_stale()
        if self.pending is None:
            self.pending = Pending(self.ws.frozen, self.ws.edits)
        p = self.pending
        p.tokens.append(tokens.clone())  # a round's readout and tokens are not kept past it
        p.hidden.append(hidden.clone())
        p.rows += tokens.shape[0]


@dataclass
class Binding:
    """Env.drafters' value (host/epilogue/env.py DraftBinding)."""

    runner: "HeadRunner"
    state: DraftState


class HeadRunner:
    """Implements the epilogue's DraftRunner protocol for one attached head."""

    def __init__(self, engine, name: str, head, layer: int):
        head.set_attention(attention.NAME)
        head.block.self_attn.layer_idx = layer
        self.engine, self.name, self.head, self.layer = engine, name, head, layer
        self.vocab_size = engine.info.vocab_size
        decoder = engine.model.get_decoder()
        self._embed, self._rotary = decoder.embed_tokens, decoder.rotary_emb
        target_out = engine.model.get_output_embeddings()
        # one rule: a head reads the target's readout in the target's own arithmetic (its blocks, in
        # the layout the import chose), over the draft vocabulary's rows where it has one
        if isinstance(target_out, BlockLinear) and head.head is None and head.draft_vocab is None:
            out = target_out  # the target's readout itself
        elif isinstance(target_out, BlockLinear) and head.head is None:
            # its rows packed anew (blocks.take_rows): a quarter of a float32 copy's bytes a draft step (Q8_0)
            rows = blocks.take_rows(target_out.packed, target_out.format, head.draft_vocab.cpu())
            out = BlockLinear(rows, target_out.format, len(head.draft_vocab), target_out.in_features)
        else:
            w = head.output_weight(target_out.weight).detach()
            out = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
            out.weight = torch.nn.Parameter(w.contiguous(), requires_grad=False)
        self._out = Readout(out)
        if isinstance(target_out, BlockLinear):  # the head's linears in blocks too, read as the target's
            to_blocks(head, q8=target_out.format >= blocks.Q8_ACTIVATIONS)
        self.draft_vocab_size = out.out_features
        self.draft_ids = self._ids = head.draft_vocab  # head output index -> target id (None: the identity)
        self.linears = PackedLinears(head)
        # the block runs in the engine's layer stack where the target's layers do (stack.py): the
        # same calls as one more target layer, over the head's own layer of the pool
        self._stack = None if engine.stack is None else LayerStack(
            decoder, self.linears, engine.stack.native, engine.stack.rows, layers=[head.block],
            final_norm=head.norm, first_layer=layer)
        self._states: dict[int, DraftState] = {}
        # the fused input's two norms as the stack's own (one C++ call each on CPU float32)
        rows = None if self._stack is None else self._stack.rows
        self._norm = None if rows is None else (
            lambda x, norm: rows.residual_norm(x.contiguous(), None, norm.weight, head.eps)[1])

    def bind(self, ws: WorkingSet) -> Binding:
        """The working set's one state for this head: every program run on it (a prompt pass's, then
        its loop's) sees the proposal the last one made."""
        st = self._states.get(ws.id)
        if st is None:
            st = self._states[ws.id] = DraftState(weakref.ref(ws))
            weakref.finalize(ws, self._states.pop, ws.id, None)
        return Binding(self, st)

    # ---- the DraftRunner protocol ------------------------------------------------------
    def propose(self, states: list[DraftState], hidden: torch.Tensor, tokens: torch.Tensor, counts: list[int],
                k: int, temperature: float, uniforms: torch.Tensor | None,
                limits: list[int] | None = None, min_prob: float = 0.0) -> tuple[torch.Tensor, list[int]]:
        eng = self.engine
        B = len(states)
        drafts = torch.full((B, k), -1, dtype=torch.int64, device=eng.device)
        n = [0] * B
        for b in range(B):
            states[b].q, states[b].drafts, states[b].at = None, None, -1
        hidden = torch.as_tensor(hidden)
        # the head's rows for the rows this round commits: kept, and written (with those kept before)
        # only where the head drafts now or too many wait
        live = []
        for b in range(B):
            st = states[b]
            if counts[b] > 0:
                st.keep(tokens[b, :counts[b]], hidden[b, :counts[b]])
            else:
                st.drop_stale()
            drafting = counts[b] > 0 and (limits is None or limits[b] > 0)
            if drafting or (st.pending is not None and st.pending.rows >= CATCH_UP_ROWS):
                live.append(b)
        if not live:
            return drafts, n
        last, normed = self._catch_up([states[b] for b in live])
        # chain: one row per pass, at the scratch rows past the committed ones
        rows = [states[b].ws.frozen + counts[b] for b in live]  # the row the next step writes
        firsts = [states[b].ws.next_position + counts[b] for b in live]
        want = [0 if counts[b] == 0 else k if limits is None else limits[b] for b in live]
        active = [i for i in range(len(live)) if want[i] > 0]
        if len(active) < len(live):
            if not active:
                return drafts, n
            sel = torch.tensor(active, device=eng.device)
            last, normed = last.index_select(0, sel), normed.index_select(0, sel)
        qs: list[list[torch.Tensor]] = [[] for _ in live]
        for j in range(k):
            logits = self._out(normed).float()
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                u = uniforms([live[i] for i in active], j).to(logits.device)
                choice = exp_race(probs, u)
            else:
                probs, choice = None, argmax(logits)
            if min_prob > 0:  # the confidence stop: a chain ends before a draft the head doubts
                conf = probs if temperature == 1 else torch.softmax(logits, dim=-1)
                sure = (conf.gather(1, choice[:, None])[:, 0] >= min_prob).tolist()
                if not all(sure):
                    keep = [a for a in range(len(active)) if sure[a]]
                    if not keep:
                        break
                    active = [active[a] for a in keep]
                    sel = torch.tensor(keep, device=logits.device)
                    last, normed, choice = (t.index_select(0, sel.to(t.device)) for t in (last, normed, choice))
                    probs = None if probs is None else probs.index_select(0, sel)
            if probs is not None:
                for a, i in enumerate(active):
                    qs[i].append(probs[a])
            ids_j = choice if self._ids is None else self._ids.index_select(0, choice.to(self._ids.device))
            rows_b = [live[i] for i in active]
            drafts[rows_b, j] = ids_j.to(drafts.device)  # no host read: on a GPU the chain stays queued
            for b in rows_b:
                n[b] = j + 1
            if j == k - 1:
                break
            keep = [a for a, i in enumerate(active) if j + 1 < want[i] and self._room(states[live[i]].ws, rows[i] + j)]
            if not keep:
                break
            if len(keep) < len(active):
                active = [active[a] for a in keep]
                sel = torch.tensor(keep, device=eng.device)
                last, normed = last.index_select(0, sel), normed.index_select(0, sel)
                ids_j = ids_j.index_select(0, sel.to(ids_j.device))
            r = [rows[i] + j for i in active]
            p = [firsts[i] + j for i in active]
            sl = [states[live[i]].ws.slot(ri) for i, ri in zip(active, r)]
            last, normed = self._run(ids_j.to(eng.device), last, p, sl, [states[live[i]] for i in active],
                                     [1] * len(active), r, target=False)
        if temperature > 0:
            for i, b in enumerate(live):
                st = states[b]
                # the rows as drawn, stacked only if draft_probs asks (the rejection rule)
                st.q, st.drafts, st.at = qs[i], drafts[b, :n[b]], st.ws.frozen + counts[b]
        return drafts, n

    def probs(self, state: DraftState, drafts: list[int]) -> torch.Tensor:
        V = self.vocab_size
        q = torch.zeros(len(drafts), V, dtype=torch.float32, device=self.engine.device)
        real = [d for d in drafts if d >= 0]
        if not real:
            return q
        if not state.q or state.at != state.ws.frozen or state.drafts[:len(real)].tolist() != real \
                or any(d >= 0 for d in drafts[len(real):]):
            raise InvalidArgument(f"drafter {self.name!r}: this window's drafts are not the head's last sampled "
                                  "proposal for this working set (draft_probs needs from_head only for them)")
        rows = torch.stack(state.q[:len(real)]).to(q.device)
        if self._ids is None:
            q[:len(real)] = rows
        else:
            q[:len(real)].index_copy_(1, self._ids.to(q.device), rows)
        return q

    def catch_up(self, ws: WorkingSet) -> None:
        """Write the head's pending rows for this working set now (its rows then equal those a
        prompt pass over the committed text writes)."""
        st = self._states.get(ws.id)
        if st is None:
            return
        st.drop_stale()
        if st.pending is not None:
            with torch.inference_mode():
                self._catch_up([st])

    # ---- the head over the pool ----------------------------------------------------------
    def _catch_up(self, states: list[DraftState]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the head over each state's pending rows, in one pass; returns each one's last row's
        output [len(states), H] (the chain starts from it) and its final norm."""
        eng = self.engine
        ids, hid, pos, slots, win, frozen = [], [], [], [], [], []
        for st in states:
            ws, p = st.ws, st.pending
            end = p.start + p.rows  # rows past the frozen end: this round's, frozen by its fold
            P = ws.frozen
            ids += p.tokens
            hid += p.hidden
            pos.extend(ws.positions[p.start:P])
            first = ws.next_position
            pos.extend(range(first, first + end - P))
            slots.extend(ws.slots(p.start, end))
            win.append(p.rows)
            frozen.append(p.start)
            st.pending = None
        x = torch.cat(ids).to(eng.device)
        h = torch.cat(hid).to(eng.device, eng.dtype)
        g, normed = self._run(x, h, pos, slots, states, win, frozen, target=True)
        ends = torch.tensor(list(_cumsum(win)), device=eng.device) - 1
        return g.index_select(0, ends), normed.index_select(0, ends)

    def _room(self, ws: WorkingSet, row: int) -> bool:
        """Whether the chain may write `row`: its page is the working set's and it is in context."""
        return row < len(ws.pages) * ws.pool.page_size and row < self.engine.info.context_len

    def _run(self, ids, hidden, positions, slots, states, windows, frozen,
             target: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over a ragged batch: pass i (of states[i]'s working set) has `windows[i]` rows
        from row frozen[i]; `hidden` is the target's readout (target) or the chain's own output.
        Returns the block's output [T, H] (a chain's next hidden state) and its final norm (what the
        head reads out)."""
        eng = self.engine
        dev = eng.device
        starts = list(_cumsum([0] + windows[:-1]))
        ends = [f + w for f, w in zip(frozen, windows)]
        group = attention.make_group(dev, starts, windows, frozen, ends, [st.ws for st in states], True,
                                     eng.attention_kernel is not None)
        meta = attention.BatchMeta(eng.kv, torch.tensor(slots, device=dev), [group], eng.attention_kernel)
        pos = torch.tensor(positions, device=dev)[None]
        e = self._embed(ids)[None]
        if self._stack is not None:
            with self.linears.active():
                x = self.head.fuse(e[0], hidden.to(e.dtype), self._norm, target=target)
                g, normed, _ = self._stack.run(x, pos[0], meta)
                return g, normed
        pe = self._rotary(e, pos)
        with self.linears.active():
            g = self.head(e, hidden[None].to(e.dtype), pe, target=target, position_ids=pos, pie_batch=meta)[0]
        return g, self.head.norm(g)


HEAD_BLOCKS = blocks.GGML["Q8_0"]  # a head's linears on a target in blocks: a quarter of float32's bytes a step


def to_blocks(head: torch.nn.Module, q8: bool = False) -> int:
    """Each float linear of a head (its block's, its fc's) as a HEAD_BLOCKS module, in place: a
    head step reads ~5 MB instead of ~20 (the default model's eagle3 head; dev top-1 0.397 quantized,
    0.398 not, offline). Returns how many were converted (none where they already are, or in other rows)."""
    n = 0
    for parent in list(head.modules()):
        for name, m in list(parent.named_children()):
            if type(m) is torch.nn.Linear and m.in_features % 32 == 0 and m is not getattr(head, "head", None):
                setattr(parent, name, blocks.from_linear(m, HEAD_BLOCKS, q8))
                n += 1
    return n


def _cumsum(xs):
    t = 0
    for x in xs:
        t += x
        yield t
