"""The MTP speculative-decoding programs on the tiny model with a random MTP head, driven by the
device loop: greedy output equals plain greedy decoding, the head's KV rows equal those of a fresh
prompt pass over the committed text after many rejections, seeded runs repeat, and sampled output
has the target distribution with the head's own q (and a broken rule is caught). The same for a
head of kind eagle3 (issue 54: it fuses the inputs of three layers), where marked KINDS."""

from __future__ import annotations

import importlib

import pytest
import torch

from host.drafter.mtp import MtpHead
from host.engine import Engine
from host.engine.compute import compute
from host.engine.drafting import DraftState
from host.engine.loop import DeviceLoop
from host.engine.scheduler import Scheduler
from host.epilogue import compile_program
from host.errors import InvalidArgument

from guest import cells, chan, plain_greedy
from op_reference import covers
from test_cacheback_program import DIST_PROMPT, REPETITIVE, T, TOP_P, accept_every_draft, chi_square_p, exact_pairs

mtp = importlib.import_module("inferlet.mtp")
cacheback = importlib.import_module("inferlet.cacheback")
NAME = "mtp"
EAGLE3_LAYERS = (0, 1, 2)  # the tiny model's two layers' inputs and its last output
KINDS = pytest.mark.parametrize("layers", [None, EAGLE3_LAYERS], ids=["mtp", "eagle3"])


def head_engine(tiny, vocab, successor=False, layers=None, **kw):
    """The tiny model with an MTP head whose drafts are restricted to `vocab` (tokens the target
    often picks here): random, or (successor) one that drafts each token's most frequent successor
    in `vocab` read as a text, so its drafts are accepted on a repetitive text and rejected elsewhere.
    layers: an eagle3 head fusing those layers' inputs."""
    eng, ref = tiny
    torch.manual_seed(1)
    head = MtpHead(eng.model, draft_vocab=torch.tensor(sorted(set(vocab))), layers=layers)
    if successor:
        successor_head(head, eng.model, vocab)
    return Engine(eng.model, eng.tokenizer, name="tiny-mtp", kv_pages=kw.pop("kv_pages", 4096), page_size=4,
                  heads={NAME: head}, **kw), ref


def successor_head(head, model, text):
    """Weights for which the head ignores the hidden state and maps embed(t) to the output row of t's
    most frequent successor in `text`: the block is the identity (zero output projections), and
    eh_proj sends each token's normalised embedding to that row (random vectors: nearly orthogonal)."""
    from collections import Counter

    H = model.config.hidden_size
    with torch.no_grad():
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            head.block.get_submodule(name).weight.zero_()
        head.hnorm.weight.zero_()
        W = model.get_output_embeddings().weight
        M = torch.zeros(H, H)
        for t in set(text):
            nxt = Counter(b for a, b in zip(text, text[1:]) if a == t).most_common(1)
            if nxt:
                e = head.enorm(model.get_input_embeddings().weight[t])
                M += torch.outer(W[nxt[0][0]], e) / e.dot(e)
        head.eh_proj.weight.copy_(torch.cat([M, torch.zeros(H, H)], dim=1))


@pytest.fixture(scope="module")
def greedy_text(tiny_module):
    eng, _ = tiny_module
    return plain_greedy(eng, REPETITIVE, 48)


@pytest.fixture(scope="module")
def tiny_module():
    import copy

    from transformers import LlamaForCausalLM

    from host.conformance.models import TinyTokenizer, tiny_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config()).eval()
    ref = copy.deepcopy(model)
    ref.config._attn_implementation = "eager"
    return Engine(model, TinyTokenizer(), name="tiny", kv_pages=256, page_size=4), ref


def start(sched, eng, prompt, K=3, max_tokens=32, seed=0, temperature=0.0, top_p=1.0, adaptive=True, verify=None,
          min_prob=0.0, **kw):
    """The prompt's pass (its epilogue drafts the first window), then the loop: both on the engine."""
    prog, specs = mtp.mtp_program(drafter=NAME, start=len(prompt) - 1, draft_len=K, max_tokens=max_tokens,
                                  temperature=temperature, top_p=top_p, seed=seed, adaptive=adaptive,
                                  min_prob=min_prob, **kw)
    if verify is not None:  # a broken rule, to show the distribution test can fail
        prog = _with_rule(K, max_tokens, len(prompt) - 1, seed, verify)
    first = mtp.mtp_prefill_program(drafter=NAME, draft_len=K, max_tokens=max_tokens, temperature=temperature, seed=seed,
                                    min_prob=min_prob)
    P = compile_program(prog)
    ch = {s["name"]: chan(s["capacity"], s["init"]) for s in specs}
    ws, _, _ = prompt_pass(sched, eng, prompt, first, ch["window"], seed)

    def loop():
        lp = DeviceLoop(ws, P, ch, ch["window"], max_window=K + 1, rounds=1000, seed=seed, hidden=True,
                        drafters=eng.bind_drafters(P.checked.drafters, ws),
                        on_round=lambda lp, w, f, cost: lp.folds.append((w, f)))
        lp.folds = []  # (window, fold) of each round
        return lp, sched.start_loop(lp)

    lp, fut = compute().call(loop)
    return lp, ch, fut


def _with_rule(K, max_tokens, base, seed, verify):
    """mtp_program with another verification rule (the SDK takes one only for lookup drafts)."""
    from guest import trace
    from inferlet.round import emit_and_fold, verify_window

    p = trace.Program(readout="window")
    p.channel("out", "i64", max_tokens)
    p.channel("window", "i64", K + 1)
    logits, win, hidden = p.logits(), p.window(), p.hidden()
    n, vt, cnt = verify_window(p, win[1:], logits, T, TOP_P, seed, verify)
    out_len, emit, fold = emit_and_fold(p, n, vt, cnt, (), max_tokens, base)
    d, dn = p.mtp_draft(hidden, vt, fold, NAME, K, T, seed)
    k_next = p.minimum(dn, p.maximum(max_tokens - out_len - emit - 1, 0))
    p.set("window", p.concat(p.dyn_slice(vt, n, 1, size=1), d), k_next + 1)
    return p.to_json()


def run(eng, prompt, **kw):
    sched = Scheduler(eng)
    try:
        lp, ch, fut = start(sched, eng, prompt, **kw)
        stats = fut.result(timeout=120)
    finally:
        sched.close()
    return cells(ch["out"]), stats, lp


@KINDS
@pytest.mark.parametrize("K,adaptive", [(1, True), (3, True), (4, False)])
def test_greedy_output_equals_plain_greedy(tiny_module, greedy_text, K, adaptive, layers):
    eng, _ = head_engine(tiny_module, greedy_text, successor=True, layers=layers)
    out, stats, lp = run(eng, REPETITIVE, K=K, max_tokens=48, adaptive=adaptive)
    assert out == greedy_text
    assert 0 < stats.accepted < stats.drafted  # the head was right and wrong
    eng.release(lp.ws)
    assert eng.pool.free_pages == eng.pool.num_pages


def test_the_draft_length_follows_the_head_gate(tiny_module, greedy_text):
    """Replayed from the rounds' (window, fold) log, the reference rule (cacheback.draft_gate with
    HEAD_GATE) allows every window the device drafted."""
    eng, _ = head_engine(tiny_module, greedy_text)  # a random head: mostly wrong, so the gate closes
    K = 3
    out, stats, lp = run(eng, REPETITIVE, K=K, max_tokens=48)
    assert out == greedy_text
    state, ks = list(mtp.mtp_program(drafter=NAME, start=1, draft_len=K)[1][-1]["init"]), []
    for w, f in lp.folds[:-1]:  # the last round may be cut by max_tokens
        state, k = cacheback.draft_gate(state, w - 1, f - 1, K, rule=cacheback.HEAD_GATE)
        ks.append(k)
    drafted = [w - 1 for w, _ in lp.folds[1:]]
    assert all(d <= k for d, k in zip(drafted, ks))
    # the same length wherever the tokens left (max_tokens) did not cut it: the last rounds'
    room = [48 - sum(f for _, f in lp.folds[:i + 1]) - 1 for i in range(len(ks))]
    assert all(d == k for d, k, r in zip(drafted, ks, room) if r >= K)
    assert 0 in ks and K in ks  # the gate closed, and probes reopened it


@KINDS
@pytest.mark.parametrize("adaptive", [False, True])
def test_head_rows_after_many_rejections_equal_a_fresh_prompt_pass(tiny_module, greedy_text, adaptive, layers):
    """The head's KV rows, built round by round over whatever each round folded (its chains written
    past them and overwritten; with the adaptive gate, rounds that do not draft leave theirs to the
    next that does), equal those one prompt pass over the committed text writes."""
    eng, _ = head_engine(tiny_module, greedy_text, successor=True, layers=layers)
    runner = eng.heads[NAME]
    deferred = []
    keep = DraftState.keep

    def counted(state, tokens, hidden):
        deferred.append(state.pending is not None and state.pending.rows > 0)
        return keep(state, tokens, hidden)
    DraftState.keep = counted
    try:
        # the lookup drafts' rule closes the gate after fewer misses than the head's: more rounds defer
        out, stats, lp = run(eng, REPETITIVE, K=3, max_tokens=60, temperature=1.0, seed=3, adaptive=adaptive,
                             gate_rule=cacheback.LOOKUP_GATE)
    finally:
        DraftState.keep = keep
    assert stats.drafted - stats.accepted > 10
    if adaptive:  # the rounds the gate kept from drafting left their rows to later ones
        assert sum(deferred) > 5
    ws = lp.ws
    compute().call(lambda: runner.catch_up(ws))  # the rows the last rounds left pending
    text = list(ws.tokens) + [out[-1]]  # the head's last row pairs the last frozen row with the last token
    sched = Scheduler(eng)
    try:
        ref_ws, _, _ = _prefill_only(sched, eng, text)
    finally:
        sched.close()
    F = ws.frozen
    assert ref_ws.frozen == F
    layer = eng.model.config.num_hidden_layers  # the head's KV layer
    mine = eng.kv[:, :, :, ws.slots(0, F)]
    fresh = eng.kv[:, :, :, ref_ws.slots(0, F)]
    torch.testing.assert_close(mine[:layer], fresh[:layer], atol=1e-4, rtol=1e-4)  # the target's rows
    torch.testing.assert_close(mine[layer], fresh[layer], atol=1e-4, rtol=1e-4)  # the head's rows


def prompt_pass(sched, eng, prompt, program, window, seed=0):
    """The head's prompt pass (an mtp_prefill_program): readout on every row, all but the last token
    folded; its epilogue drafts the first window into `window`. Returns (ws, window, its future)."""
    prog = compile_program(program)

    def begin():
        ws = eng.new_working_set()
        pre = DeviceLoop(ws, prog, {"window": window}, chan(len(prompt), prompt), max_window=len(prompt), rounds=1,
                         fold=len(prompt) - 1, hidden=True, seed=seed, drafters=eng.bind_drafters(prog.checked.drafters, ws))
        return ws, sched.start_loop(pre)

    ws, fut = compute().call(begin)
    fut.result(timeout=60)
    return ws, window, fut


def _prefill_only(sched, eng, prompt, K=3, temperature=0.0, seed=0):
    first = mtp.mtp_prefill_program(drafter=NAME, draft_len=K, temperature=temperature, seed=seed)
    return prompt_pass(sched, eng, prompt, first, chan(K + 1), seed)


def test_seeded_sampled_runs_repeat(tiny_module, greedy_text):
    eng, _ = head_engine(tiny_module, greedy_text)
    a = run(eng, REPETITIVE, K=3, max_tokens=24, temperature=0.7, seed=11)[0]
    b = run(eng, REPETITIVE, K=3, max_tokens=24, temperature=0.7, seed=11)[0]
    c = run(eng, REPETITIVE, K=3, max_tokens=24, temperature=0.7, seed=12)[0]
    assert a == b and a != c


def sample_pairs(eng, verify=None, runs=600, min_prob=0.0, **kw):
    sched = Scheduler(eng)
    try:
        started = [start(sched, eng, DIST_PROMPT, K=2, max_tokens=3, seed=s, temperature=T, top_p=TOP_P,
                         adaptive=False, verify=verify, min_prob=min_prob, **kw) for s in range(runs)]
        stats = [fut.result(timeout=120) for _, _, fut in started]
    finally:
        sched.close()
    pairs = [tuple(cells(ch["out"])[:2]) for _, ch, _ in started]
    for lp, _, _ in started:
        eng.release(lp.ws)
    return pairs, stats


@pytest.mark.parametrize("layers,min_prob,rejection", [(None, 0.0, False), (EAGLE3_LAYERS, 1 / 6, False),
                                                       (None, 0.0, True)], ids=["mtp", "eagle3-min-prob", "rejection"])
def test_sampled_output_has_the_target_distribution(tiny_module, layers, min_prob, rejection):
    """Drafts coupled to the target's draws and verified against them, or (rejection) verified by
    Leviathan's rule with the head's q. With the eagle3 head, also the confidence stop (min_prob):
    some windows end before a draft drawn and then dropped, never verified; the distribution stays
    the target's."""
    # drafts from the head restricted to tokens the target gives moderate mass after DIST_PROMPT
    eng, ref = head_engine(tiny_module, [92, 32, 79, 63, 85, 65], kv_pages=16384, layers=layers)
    exact = exact_pairs(ref, DIST_PROMPT)
    pairs, stats = sample_pairs(eng, min_prob=min_prob, rejection=rejection)  # a random head over 6 ids
    accepted, drafted = sum(s.accepted for s in stats), sum(s.drafted for s in stats)
    assert 0 < accepted < drafted
    if min_prob:
        assert drafted < 0.9 * 2 * sum(s.rounds for s in stats)
    assert chi_square_p(pairs, exact) > 0.001
    bad, _ = sample_pairs(eng, verify=accept_every_draft)
    assert chi_square_p(bad, exact) < 1e-6


def test_greedy_output_with_a_confidence_stop_equals_plain_greedy(tiny_module, greedy_text):
    eng, _ = head_engine(tiny_module, greedy_text, successor=True)  # its drafts' probabilities: ~0.10 to 0.20
    _, full, lp_full = run(eng, REPETITIVE, K=3, max_tokens=48)
    out, stats, lp = run(eng, REPETITIVE, K=3, max_tokens=48, min_prob=0.17)
    assert out == greedy_text and 0 < stats.accepted and stats.drafted < full.drafted
    eng.release(lp_full.ws), eng.release(lp.ws)
    assert eng.pool.free_pages == eng.pool.num_pages


def test_a_confidence_stop_ends_each_chain_before_its_first_doubted_draft(tiny_module, greedy_text):
    """propose(min_prob=P) gives each chain's drafts up to the first one the head gives less than
    P (its softmax at temperature 1), and those drafts are the unstopped chain's."""
    from host.engine import Pass

    eng, _ = head_engine(tiny_module, greedy_text)
    runner, k = eng.heads[NAME], 4
    seen = []
    read = runner._out

    def recorded(x):
        logits = read(x)
        seen.append(torch.softmax(logits.float(), -1).max(-1).values)
        return logits

    def chains(min_prob, record=False):
        text, at = REPETITIVE + greedy_text, (0, 5, 11, 20)
        prompts = [text[i:i + 16] for i in at]
        wss = [eng.new_working_set() for _ in prompts]
        outs = eng.forward([Pass(ws, p, list(range(16)), fold=0, hidden=True, spare=k) for ws, p in zip(wss, prompts)])
        hidden = torch.stack([o.hidden for o in outs])
        toks = torch.tensor([text[i + 1:i + 17] for i in at])
        runner._out = recorded if record else read
        try:
            with torch.inference_mode():
                got = runner.propose([runner.bind(ws).state for ws in wss], hidden, toks, [16] * 4, k, 0.0, None,
                                     min_prob=min_prob)
        finally:
            runner._out = read
            for ws in wss:
                eng.release(ws)
        return got

    full, n_full = chains(0.0, record=True)
    assert n_full == [k] * 4
    probs = torch.stack(seen, 1)  # [chain, step]: the head's probability of each draft
    P = float(probs.median())
    drafts, n = chains(P)
    want = [int((probs[b] >= P).int().cumprod(0).sum()) for b in range(4)]
    assert n == want and min(want) < k
    for b in range(4):
        assert drafts[b, :n[b]].tolist() == full[b, :n[b]].tolist() and (drafts[b, n[b]:] == -1).all()


def test_a_program_naming_a_missing_drafter_is_refused(tiny_module):
    eng, _ = tiny_module  # no head attached
    prog = compile_program(mtp.mtp_prefill_program(drafter=NAME, draft_len=2))
    assert prog.checked.drafters == (NAME,) and prog.spare == 1 and "logits" not in prog.uses
    with pytest.raises(InvalidArgument, match="drafter 'mtp'.*pie model import"):
        eng.bind_drafters(prog.checked.drafters, eng.new_working_set())


def test_the_chain_stops_at_the_context_end(tiny_module, greedy_text):
    eng, _ = head_engine(tiny_module, greedy_text, context_len=len(REPETITIVE) + 1)
    sched = Scheduler(eng)
    try:
        ws, win, _ = _prefill_only(sched, eng, REPETITIVE, K=4)
    finally:
        sched.close()
    # rows 0..15 are folded and row 15 drafts d1; the chain writes rows 16 and 17 (d2, d3), and
    # row 18 is past the context of 18 rows: 3 drafts, not 4
    assert ws.frozen == 16 and win.length == 1 + 3


# --- the ops against a plain-PyTorch reference of the head ----------------------------------

def reference_drafts(model, head, prompt, k, temperature=0.0):
    """model: the target with stock (eager) attention. The head over the prompt's rows and its chain, recomputed from scratch with causal sdpa over
    the whole sequence at every step (no paged KV): rows i pair the target's pre-norm hidden state
    h_i with prompt[i+1]; each chained row appends (embed(draft), g of the previous row).
    Returns the drafts (greedy) and each step's distribution over the full vocabulary."""
    ref_head = MtpHead(model, draft_vocab=head.draft_vocab, layers=head.layers)  # a fresh module: no engine hooks
    ref_head.load_state_dict(head.state_dict())
    ref_head.set_attention("sdpa")
    keep = {}
    hook = model.model.norm.register_forward_pre_hook(lambda m, a: keep.__setitem__("h", a[0]))
    try:
        with torch.inference_mode():
            hs = model.model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    L = model.config.num_hidden_layers
    # an eagle3 head's rows read the inputs of its layers (hidden_states[L] is after the final norm)
    h = (torch.cat([keep["h"] if c == L else hs[c] for c in head.layers], -1) if head.layers else keep["h"])[0, :-1]
    emb = model.get_input_embeddings().weight
    ids, hid, drafts, qs = list(prompt[1:]), [(x, True) for x in h], [], []
    W = head.output_weight(model.get_output_embeddings().weight)
    with torch.inference_mode():
        for _ in range(k):
            n = len(ids)
            pos = torch.arange(n)[None]
            e = emb[torch.tensor(ids)][None]
            pe = model.model.rotary_emb(e, pos)
            # row by row: the target's readout rows (fused by fc for eagle3), then the chain's own g
            x = torch.cat([ref_head.fuse(e[0, r:r + 1], hr[None], target=t) for r, (hr, t) in enumerate(hid)])
            out = ref_head.block(x[None], position_embeddings=pe, position_ids=pos, attention_mask=None)
            g = (out[0] if isinstance(out, tuple) else out)[0]
            logits = ref_head.logits(g[-1], W)
            full = torch.zeros(model.config.vocab_size)
            full[head.draft_vocab] = torch.softmax(logits / (temperature or 1.0), -1)
            qs.append(full)
            d = int(head.draft_vocab[int(logits.argmax())])
            drafts.append(d)
            ids.append(d)
            hid.append((g[-1], False))
    return drafts, qs


@covers("mtp_draft")
@KINDS
def test_mtp_draft_equals_the_plain_head_formula(tiny_module, layers):
    eng, ref = head_engine(tiny_module, list(range(97)), layers=layers)
    head = eng.heads[NAME].head
    sched = Scheduler(eng)
    try:
        _, win, _ = _prefill_only(sched, eng, PROMPT_REF, K=4)
    finally:
        sched.close()
    want, _ = reference_drafts(ref, head, PROMPT_REF, 4)
    assert cells(win) == [PROMPT_REF[-1]] + want


@covers("draft_probs")
def test_draft_probs_are_the_heads_distributions_or_one_hot(tiny_module):
    from guest import trace
    from host.epilogue import Env

    eng, ref = head_engine(tiny_module, list(range(0, 97, 2)))
    runner, head, Tq = eng.heads[NAME], eng.heads[NAME].head, 0.9
    sched = Scheduler(eng)
    try:
        ws, win, _ = _prefill_only(sched, eng, PROMPT_REF, K=3, temperature=Tq, seed=5)
    finally:
        sched.close()
    window = cells(win)
    drafts = window[1:]
    assert len(drafts) == 3 and all(d % 2 == 0 for d in drafts)  # from the draft vocabulary
    p = trace.Program(readout="window")
    flag = p.const(True)
    q_head, q_lookup = p.draft_probs(p.window()[1:], flag, NAME), p.draft_probs(p.window()[1:], ~flag, NAME)
    prog = compile_program(p.to_json())
    env = Env(logits=torch.zeros(4, 97), window=torch.tensor(window), drafters={NAME: runner.bind(ws)})
    values = prog.run([env], keep_values=True)[0].values
    q, one_hot = (values[_ir_index(p, v)] for v in (q_head, q_lookup))
    assert q.shape == (3, 97) and torch.allclose(q.sum(-1), torch.ones(3), atol=1e-5)
    assert torch.equal(one_hot, torch.nn.functional.one_hot(torch.tensor(drafts), 97).float())
    # the first row is the head's tempered distribution after the prompt (later rows depend on the draws)
    _, ref_q = reference_drafts(ref, head, PROMPT_REF, 1, temperature=Tq)
    torch.testing.assert_close(q[0], ref_q[0], atol=1e-5, rtol=1e-4)
    with pytest.raises(InvalidArgument, match="not the head's last sampled proposal"):
        runner.probs(runner.bind(ws).state, [drafts[0] + 1])


def test_a_sampled_draft_is_coupled_to_the_targets_draw(tiny_module):
    """The head draws its draft with the uniforms verify_sample draws the target's own token with
    at the row that verifies it (the next window's first row: the prompt's last position)."""
    from host.epilogue.tensors import Stream, exp_race, uniforms

    eng, ref = head_engine(tiny_module, list(range(0, 97, 2)))
    head, Tq = eng.heads[NAME].head, 0.9
    _, ref_q = reference_drafts(ref, head, PROMPT_REF, 1, temperature=Tq)
    got, want = [], []
    for seed in range(6):
        sched = Scheduler(eng)
        try:
            ws, win, _ = _prefill_only(sched, eng, PROMPT_REF, K=1, temperature=Tq, seed=seed)
        finally:
            sched.close()
        got.append(cells(win)[1])
        eng.release(ws)
        u = uniforms(seed, len(PROMPT_REF) - 1, Stream.SAMPLE, seed, [97], "cpu")
        want.append(int(exp_race(ref_q[0][None], u[None])[0]))
    assert got == want and len(set(got)) > 1


def _ir_index(p, v) -> int:
    kind, i = p._where[v.id]
    return i if kind == "in" else len(p._inputs) + i


PROMPT_REF = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]


def test_a_limit_stops_the_chain_and_zero_leaves_the_heads_rows_for_later(tiny_module, greedy_text):
    from host.engine import Pass

    eng, _ = head_engine(tiny_module, greedy_text)
    runner = eng.heads[NAME]
    wss = [eng.new_working_set() for _ in range(3)]
    outs = eng.forward([Pass(ws, REPETITIVE, list(range(len(REPETITIVE))), fold=0, hidden=True, spare=3) for ws in wss])
    hidden = torch.stack([o.hidden for o in outs])
    toks = torch.tensor([REPETITIVE[1:] + [0]] * 3)
    before = eng.kv[-1].clone()
    with torch.inference_mode():
        drafts, n = runner.propose([runner.bind(ws).state for ws in wss], hidden, toks, [16, 16, 16], 4, 0.0, None,
                                   limits=[4, 2, 0])
    assert n == [4, 2, 0]
    assert (drafts[0] >= 0).all() and drafts[1, :2].tolist() == drafts[0, :2].tolist() and (drafts[1, 2:] == -1).all()
    assert (drafts[2] == -1).all()
    for ws in wss[:2]:  # the drafting passes wrote the head's rows 0..15
        rows = ws.slots(0, 16)
        assert not torch.equal(eng.kv[-1][:, :, rows], before[:, :, rows])
    rows = wss[2].slots(0, 16)  # the limit-0 one keeps them for when it next drafts
    assert torch.equal(eng.kv[-1][:, :, rows], before[:, :, rows])
    wss[2].apply_fold(REPETITIVE[:16], 16, 0)  # the round's fold
    runner.catch_up(wss[2])
    torch.testing.assert_close(eng.kv[-1][:, :, rows], eng.kv[-1][:, :, wss[0].slots(0, 16)])


def test_pending_head_rows_are_written_in_the_next_drafting_pass_or_dropped_after_an_edit(tiny_module, greedy_text):
    from host.engine import Pass

    eng, _ = head_engine(tiny_module, greedy_text)
    runner = eng.heads[NAME]
    P = REPETITIVE[:12]
    a, b = eng.new_working_set(), eng.new_working_set()
    outs = eng.forward([Pass(ws, P, list(range(len(P))), fold=0, hidden=True, spare=3) for ws in (a, b)])
    hidden = torch.stack([o.hidden for o in outs])
    toks = torch.tensor([P[1:] + [0]] * 2)

    def fold(ws, rows):  # what a round's fold does to the working set after its epilogue
        ws.apply_fold(P[ws.frozen:ws.frozen + rows], rows, ws.next_position)

    with torch.inference_mode():
        sa, sb = runner.bind(a).state, runner.bind(b).state
        # a: rounds of 4, 4, 3 rows; only the last drafts. b: all at once
        for start, c, lim in [(0, 4, 0), (4, 4, 0), (8, 3, 2)]:
            d, n = runner.propose([sa], hidden[:1, start:start + c], toks[:1, start:start + c], [c], 2, 0.0, None, [lim])
            assert n == [lim] and (sa.pending is None) == (lim > 0)
            fold(a, c)
        d2, n2 = runner.propose([sb], hidden[1:, :11], toks[1:, :11], [11], 2, 0.0, None, [2])
        fold(b, 11)
    assert d.tolist() == d2.tolist()
    torch.testing.assert_close(eng.kv[-1][:, :, a.slots(0, 11)], eng.kv[-1][:, :, b.slots(0, 11)])
    # kept rows whose working set was truncated since are stale: dropped, the next round's start anew
    with torch.inference_mode():
        runner.propose([sa], hidden[:1, :2], toks[:1, :2], [2], 2, 0.0, None, [0])
        assert sa.pending.start == 11 and sa.pending.rows == 2
        a.truncate(8)
        runner.propose([sa], hidden[:1, 8:10], toks[:1, 8:10], [2], 2, 0.0, None, [0])
        assert sa.pending.start == 8 and sa.pending.rows == 2
    before = eng.kv[-1].clone()
    runner.catch_up(a)  # those two rows were never folded: nothing to write
    assert sa.pending is None and torch.equal(eng.kv[-1], before)


def test_a_models_heads_share_one_hidden_readout(tiny_module):
    """Issue 54: an eagle3 head's passes read its layers' inputs where an MTP head's read the last
    output, so a model takes heads of one kind (and one set of layers); a head's layers are inside
    the model."""
    eng, _ = tiny_module
    mtp_head = MtpHead(eng.model)
    e3 = MtpHead(eng.model, layers=[0, 1])
    with pytest.raises(ValueError, match="share one hidden readout"):
        Engine(eng.model, eng.tokenizer, name="t", kv_pages=64, page_size=4, heads={"a": mtp_head, "b": e3})
    with pytest.raises(ValueError, match="distinct, in 0..2"):
        MtpHead(eng.model, layers=[0, 3])
    both = Engine(eng.model, eng.tokenizer, name="t", kv_pages=64, page_size=4,
                  heads={"a": e3, "b": MtpHead(eng.model, layers=[0, 1])})
    assert both.head_layers == (0, 1)
