"""The Cacheback speculative-decoding round as one epilogue (a device program), and its draft gate.

Pure Python (runs inside the Wasm component): only the epilogue tracer.

`cacheback_program` traces the whole speculative round into one epilogue, so the host
fires the pass round after round with no guest call: verify the window [t0, d1..dk]
against the target (greedy, or Leviathan rejection sampling), append the committed
tokens to "out" (cut after the first EOS and at max_tokens), fold 1 + accepted rows,
then draft the next window by prompt lookup over the last `lookup_window` tokens,
falling back to an LRU n-gram table that holds what fell out of that window, then to the
host's suffix index of earlier requests' texts (`suffix_draft`).
"""

from dataclasses import dataclass

from . import trace
from .reference import lru_lookup, lru_update, ngram_lookup
from .round import emit_and_fold, lookup_context, verify_window


# The acceptance estimate, in thousandths of a token. A round that drafts costs little more than
# one that does not (a few-row window reads the weights once; a head that does not draft does not
# run), so drafting pays while it is right a tenth of the time: on the dev prompts 100 beat 400
# by ~6% for the MTP head and the hybrid (bench notes in docs/performance.md).
GATE_INIT, GATE_OPEN = 1000, 100


@dataclass(frozen=True)
class GateRule:
    """How a draft gate follows acceptance. memory: the moving average keeps (memory - 1)/memory
    of the estimate each round that drafted (it must divide 1000); shorten: a draft after one that
    was not accepted whole takes short_draft(K), not K."""

    memory: int = 4
    shorten: bool = True

    def __post_init__(self):
        if self.memory < 1 or 1000 % self.memory:
            raise ValueError("a gate's memory must be a positive divisor of 1000 (the estimate's unit)")

    @property
    def step(self) -> int:
        """What one accepted draft adds to the estimate (thousandths over memory)."""
        return 1000 // self.memory

    def after_miss(self, K):
        """The draft length after a draft that was not accepted whole."""
        return short_draft(K) if self.shorten else K


# prompt lookup's drafts: a long match either holds or breaks, so the gate follows the last few rounds
# and a partly rejected draft halves (replayed on the dev prompts' greedy outputs, the rows this saves
# outweigh the accepted drafts it gives up)
LOOKUP_GATE = GateRule()
# a head's drafts: right at a steadier rate, so the estimate follows more rounds (a short run of misses
# does not close the gate) and every draft takes all K (the head is about as likely right after a miss;
# docs/speculative-decoding.md has the comparison)
HEAD_GATE = GateRule(memory=8, shorten=False)
# a head's confidence stop (op mtp_draft's min_prob), the inferlets' --min-prob default: at 0.2 the
# eagle3 head's chain proposes under half its drafts and keeps 85% of the accepted ones (bench.head_dev),
# and both MTP and the hybrid ran faster a token in the loop (bench.round_split; docs/speculative-decoding.md)
HEAD_MIN_PROB = 0.2


def draft_gate(state, drafted, accepted, K, probe_after=4, probe_max=32, rule=LOOKUP_GATE):
    """The device program's draft-length rule on plain ints (the reference; tests replay it).

    state = [estimate, idle, wait, whole]: estimate = a moving average (rule.memory) of the
    drafts accepted per round that drafted, in thousandths. While it is at least GATE_OPEN the
    next round drafts; below that, drafting stops, and after `wait` rounds one probe round
    drafts again; a probe that fails doubles `wait` (up to probe_max), so a text that never
    matches pays for ever fewer probes. Rounds without a candidate (drafted == 0) move nothing.
    whole = 1 when the last round that drafted had all its drafts accepted: only then does the
    next draft take all K tokens; otherwise (also the first draft and probes) it takes
    short_draft(K) (with rule.shorten; else K).
    Returns (new state, next draft length)."""
    e, idle, wait, whole = state
    if drafted:
        e = e - e // rule.memory + rule.step * accepted
        whole = int(accepted == drafted)
    k = K if whole else rule.after_miss(K)
    if e >= GATE_OPEN:
        return [e, 0, probe_after, whole], k
    if drafted and idle < 0:
        wait = min(wait * 2, probe_max)
    idle = 1 if idle < 0 else idle + 1
    if idle >= wait:
        return [e, -1, wait, whole], k
    return [e, idle, wait, whole], 0


def short_draft(K):
    """The draft length after a draft that was not accepted whole: half of K, rounded up."""
    return (K + 1) // 2


# --- the device program ------------------------------------------------------------

def cacheback_program(*, prompt, draft_len_max=8, ngram_min=1, ngram_max=3, eos_ids=(), max_tokens=256,
                      temperature=0.0, top_p=1.0, seed=0, lookup_window=256, lru_size=64, lru_ngram=2,
                      probe_after=4, probe_max=32, verify=None, start=None, drafter=None, head_len=3,
                      head_gate=HEAD_GATE, top_k=0, min_p=0.0, logit_bias=None, penalties=None, suffix=True,
                      min_prob=0.0):
    """Trace the Cacheback speculative-decoding epilogue.

    The guest commits prompt[:-1] to the working set first, then loops a pass whose
    window comes from channel "window" with readout on every row and the fold from the
    program. Returns (json_text, channels): channels is a list of dicts {name, dtype,
    capacity, init} for the host to create ("out", "window", and the program's state).

    The draft length follows `draft_gate` (probe_after, probe_max).
    temperature <= 0 is greedy. verify(p, drafts, probs, seed) -> (accepted, tokens, count)
    replaces the rejection rule (default p.verify_sample) for sampled runs. seed: the ops' own
    seed; the run's seed (the pass's) keys the draws, and at the default 0 a row draws what plain
    decoding's `sample` draws at that position, so every inferlet samples one text at one seed.
    start: the working set's frozen length when the loop starts (default len(prompt) - 1).
    penalties: args.Penalties (their output_start: where the output starts in the working set).
    The tokens produced so far are counted as history length - start (every round folds
    exactly what it emits until the last), not as the length of "out": the guest takes
    (removes) cells from "out" while the loop runs.

    drafter: the name of an MTP head attached to the model, for the hybrid: each round drafts by
    prompt lookup when the context offers a match (and the gate is open), else by the head
    (`head_len` drafts, chained); the head is given every round's folded rows either way (the host
    writes them when it next drafts), so its state is current whenever it drafts. Channel "source"
    (1 cell) says where the window's drafts came from (1: the head), for the gates.
    min_prob: the head's confidence stop (op mtp_draft). The guest's prompt pass must run the
    head's prefill program (`mtp.mtp_prefill_program`) with window_capacity = the "window" spec's.

    suffix: also draft from the texts of earlier requests in the same namespace (op suffix_draft:
    its draft length follows its match length), where the request's own context and LRU table
    offer no match or a shorter one (prompt lookup matches at most ngram_max tokens). The first
    window, drafted by the guest from the prompt, has none.
    """
    K, g, Lw, S = int(draft_len_max), int(lru_ngram), int(lookup_window), int(lru_size)
    prompt = [int(x) for x in prompt]
    if not prompt:
        raise ValueError("prompt must hold at least one token")
    if K < 0 or max_tokens < 1 or not 1 <= ngram_min <= ngram_max or S < 0 or g < 1 or not 1 <= probe_after <= probe_max:
        raise ValueError("need draft_len_max >= 0, max_tokens >= 1, 1 <= ngram_min <= ngram_max, "
                         "lru_size >= 0, lru_ngram >= 1, 1 <= probe_after <= probe_max")
    if K and Lw < 2 * K + g:
        raise ValueError("lookup_window must be >= 2*draft_len_max + lru_ngram (the LRU update reads "
                         "followers of the leaders leaving the window from the history)")
    if not 0 < top_p <= 1:
        raise ValueError("top_p must be in (0, 1]")
    if drafter is not None and (K < 1 or head_len < 1 or not 0 <= min_prob <= 1):
        raise ValueError("the hybrid needs draft_len_max >= 1, head_len >= 1 and 0 <= min_prob <= 1")
    H = int(head_len) if drafter is not None else 0
    Kw = max(K, H)  # the window's most drafts
    base = len(prompt) - 1 if start is None else int(start)
    # The LRU table holds leaders that left the lookup window: none can while the whole
    # history (at most base + max_tokens tokens) fits in it, so the table is left out.
    use_lru = K > 0 and S > 0 and base + max_tokens > Lw

    p = trace.Program(readout="window")
    p.channel("out", "i64", max_tokens)
    p.channel("window", "i64", Kw + 1)
    logits, win = p.logits(), p.window()
    drafts = win[1:]
    from_head = None
    if H:
        p.channel("source", "i64", 1)
        from_head = p.read("source")[0] > 0

    n, vt, cnt = verify_window(p, drafts, logits, temperature, top_p, seed, verify, top_k, min_p, logit_bias,
                               penalties)
    out_len, emit, fold = emit_and_fold(p, n, vt, cnt, eos_ids, max_tokens, base)

    t0 = p.dyn_slice(vt, n, 1, size=1)  # the target's token: next round's t0
    if K == 0:
        p.set("window", t0)
    elif H:
        cand, cand_n = _draft(p, win, vt, cnt, fold, K, g, Lw, S, ngram_min, ngram_max, use_lru, suffix)
        # the gate follows lookup's drafts only: a round that verified the head's counts as no candidate
        k_gate = gate(p, p.where(from_head, 0, drafts.size()), n, K, int(probe_after), int(probe_max))
        lookup = (cand_n > 0) & (k_gate > 0)
        room = p.maximum(max_tokens - out_len - emit - 1, 0)
        # the head's drafts have their own gate (state "head_state"), following the rounds that verified them
        h_gate = gate(p, p.where(from_head, drafts.size(), 0), n, H, int(probe_after), int(probe_max), "head_state",
                      head_gate)
        # the head is given the folded rows every round; it runs and chains only when its drafts are used
        d, dn = p.mtp_draft(p.hidden(), vt, fold, drafter, H, temperature, seed,
                            limit=p.where(lookup, 0, p.minimum(room, h_gate)), min_prob=min_prob)
        nxt = p.where(lookup, p.dyn_slice(cand, 0, K, size=Kw), p.dyn_slice(d, 0, H, size=Kw))
        k_next = p.minimum(p.where(lookup, p.minimum(cand_n, k_gate), dn), room)
        j = p.arange(1)
        p.set("source", p.where(lookup, j, j + 1))
        p.set("window", p.concat(t0, nxt), k_next + 1)
    else:
        cand, cand_n = _draft(p, win, vt, cnt, fold, K, g, Lw, S, ngram_min, ngram_max, use_lru, suffix)
        k_gate = gate(p, drafts.size(), n, K, int(probe_after), int(probe_max))
        k_next = p.minimum(p.minimum(cand_n, k_gate), p.maximum(max_tokens - out_len - emit - 1, 0))
        p.set("window", p.concat(t0, cand), k_next + 1)

    return p.to_json(), _channels(prompt, K, g, Lw, S, ngram_min, ngram_max, max_tokens, use_lru, int(probe_after), H)


def _draft(p, win, vt, cnt, fold, K, g, Lw, S, ngram_min, ngram_max, use_lru, suffix=False):
    """Next drafts: prompt lookup over the last Lw history tokens + t0 + this round's tokens,
    else the LRU table; earlier requests' texts (suffix) where they match longer; and the table
    update with the leaders leaving the lookup window."""
    ctx, ctx_len = lookup_context(p, win, vt, cnt, Lw, K)
    cand, cand_n = p.ngram_lookup(ctx, K, ngram_min, ngram_max, length=ctx_len)
    if use_lru:
        cand, cand_n = _lru(p, ctx, ctx_len, cand, cand_n, fold, K, g, Lw, S)
    if suffix:
        sc, sn, _, sm = p.suffix_draft(ctx, ctx_len, K, min_match=max(ngram_min, 2))
        # the longer match drafts: prompt lookup matched at most ngram_max tokens (measured against
        # suffix drafts only where lookup finds nothing: docs/prefix-caching.md)
        take = (sn > 0) & ((cand_n == 0) | (sm > ngram_max))
        cand, cand_n = p.where(take, sc, cand), p.where(take, sn, cand_n)
    return cand, cand_n


def _lru(p, ctx, ctx_len, cand, cand_n, fold, K, g, Lw, S):
    """The LRU table's drafts where lookup found none, and its update."""
    hist = p.history()
    N = hist.size()
    p.channel("lru_table", "i64", S * (g + K))
    p.channel("lru_stamps", "i64", S)
    table, stamps = p.read("lru_table"), p.read("lru_stamps")
    lt, ln = p.lru_lookup(table, stamps, p.dyn_slice(ctx, ctx_len - g, g, size=g), g, K)
    found = cand_n > 0
    cand, cand_n = p.where(found, cand, lt), p.where(found, cand_n, ln)
    # History grows by `fold`: the leaders starting at [N-Lw, N-Lw+fold) leave the lookup window.
    span = fold + (g + K - 1)
    seq = p.dyn_slice(hist, N - Lw, span, size=K + 1 + g + K - 1)
    t2, s2 = p.lru_update(table, stamps, seq, span, fold, g, K)
    p.set("lru_table", t2)
    p.set("lru_stamps", s2)
    return cand, cand_n


def gate(p, d, n, K, probe_after, probe_max, state="spec_state", rule=LOOKUP_GATE):
    """draft_gate on the device: channel `state` holds [estimate, idle, wait, whole];
    d drafts went into this round, n were accepted. Returns the next round's draft length."""
    p.channel(state, "i64", 4)
    st = p.read(state)
    e, idle, wait, whole = st[0], st[1], st[2], st[3]
    drafted = d > 0
    e = p.where(drafted, e - e // rule.memory + n * rule.step, e)
    whole = p.where(drafted, (n == d).cast("i64"), whole)
    is_open = e >= GATE_OPEN
    probed = idle < 0
    wait = p.where(is_open, probe_after, p.where(drafted & probed, p.minimum(wait * 2, probe_max), wait))
    idle = p.where(is_open, 0, p.where(probed, 1, idle + 1))
    probe = ~is_open & (idle >= wait)
    j = p.arange(4)
    p.set(state, p.where(j == 0, e, p.where(j == 1, p.where(probe, -1, idle),
                                                     p.where(j == 2, wait, whole))))
    return p.where(is_open | probe, p.where(whole > 0, K, rule.after_miss(K)), 0)


def _channels(prompt, K, g, Lw, S, ngram_min, ngram_max, max_tokens, use_lru, probe_after, H=0):
    """Channel specs with initial contents: the first window drafts from the prompt too (with a
    head, H > 0, the head's prefill program writes the first window instead)."""
    hist = prompt[:-1]
    chans = [{"name": "out", "dtype": "i64", "capacity": max_tokens, "init": []}]
    drafts = []
    if K:
        ctx = hist[-Lw:] + prompt[-1:]
        drafts = ngram_lookup(ctx, K, ngram_min, ngram_max)
        if use_lru:
            table, stamps = lru_update([-1] * (S * (g + K)), [-1] * S, hist, len(hist), len(hist) - Lw, g, K)
            if not drafts:
                drafts = lru_lookup(table, stamps, ctx[-g:], g, K)
            chans += [{"name": "lru_table", "dtype": "i64", "capacity": S * (g + K), "init": table},
                      {"name": "lru_stamps", "dtype": "i64", "capacity": S, "init": stamps}]
        chans.append({"name": "spec_state", "dtype": "i64", "capacity": 4, "init": [GATE_INIT, 0, probe_after, 0]})
    drafts = drafts[:max(min(short_draft(K), max_tokens - 1), 0)]  # the gate's first draft length
    if H:
        chans.append({"name": "source", "dtype": "i64", "capacity": 1, "init": [1]})
        chans.append({"name": "head_state", "dtype": "i64", "capacity": 4, "init": [GATE_INIT, 0, probe_after, 1]})
    init = [] if H else prompt[-1:] + drafts
    chans.insert(1, {"name": "window", "dtype": "i64", "capacity": max(K, H) + 1, "init": init})
    return chans
