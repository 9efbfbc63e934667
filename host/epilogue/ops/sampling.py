"""Sampling ops: softmax, top-k and top-p filters, categorical samples and uniforms (seeded)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from host.epilogue.ir import Value
from host.epilogue.tensors import Stream, exp_race
from host.epilogue.ops.spec import F32_MAX, Attr, define, family

F = family("sampling", "Sampling (seeded, see Randomness):")
SEED = Attr("int", 0)


def _softmax_infer(t, av, at):
    (x,) = av
    t.need(x, "f32")
    t.nonscalar(x, "softmax")
    t.axis(x, at)
    if at["temperature"] <= 0:
        t.fail("temperature must be > 0 (use argmax for greedy)")
    return [Value("f32", x.shape)]


def softmax(x: torch.Tensor, temperature: float = 1.0, dim: int = -1) -> torch.Tensor:
    return torch.softmax(x / temperature, dim=dim)


define("softmax", F, args=1, attrs={"axis": Attr("int", -1), "temperature": Attr("num", 1.0)},
       infer=_softmax_infer,
       impl=lambda ctx, op, a: [softmax(a[0], op.attrs["temperature"], op.attrs["axis"] + 1)],
       doc="`softmax(x: f32; axis=-1, temperature=1.0)`: softmax(x / temperature); temperature > 0.")


def _filter_infer(name):
    def infer(t, av, at):
        (x,) = av
        t.need(x, "f32")
        t.nonscalar(x, name)
        if name == "top_p" and not 0 < at["p"] <= 1:
            t.fail(f"top_p p={at['p']} must be in (0, 1]")
        if name == "min_p" and not 0 <= at["p"] <= 1:
            t.fail(f"min_p p={at['p']} must be in [0, 1]")
        return [Value("f32", x.shape)]
    return infer


def _top_k(ctx, op, a):
    return [top_k_filter(a[0], op.attrs["k"])]


def top_p_filter(x: torch.Tensor, p: float) -> torch.Tensor:
    """Logits outside the top-p nucleus of the last axis become -inf."""
    srt, order = x.sort(dim=-1, descending=True)
    probs = torch.softmax(srt, dim=-1)
    # Drop a token when the tokens ranked above it already hold mass >= p (the top one is always kept).
    drop_sorted = (probs.cumsum(-1) - probs) >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return x.masked_fill(drop, -torch.inf)


def _top_p(ctx, op, a):
    return [top_p_filter(a[0], op.attrs["p"])]


def top_k_filter(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logits below the k-th largest of the last axis become -inf (ties with it are kept)."""
    kth = x.topk(min(k, x.shape[-1]), dim=-1).values[..., -1:]
    return x.masked_fill(x < kth, -torch.inf)


def min_p_filter(x: torch.Tensor, p: float) -> torch.Tensor:
    """Logits whose probability is below p times the top one's become -inf: exp(x - max) < p,
    compared on the logits (x < max + log p), so no softmax is needed and the top is always kept."""
    if p <= 0:
        return x
    top = x.max(dim=-1, keepdim=True).values
    return x.masked_fill(x < top + math.log(p), -torch.inf)


define("top_k", F, args=1, attrs={"k": Attr("int", lo=1)}, infer=_filter_infer("top_k"), impl=_top_k,
       doc="`top_k(x: f32; k >= 1)`: over the last axis, entries below the k-th largest become -inf "
           "(ties with the k-th are kept).")
define("min_p", F, args=1, attrs={"p": Attr("num")}, infer=_filter_infer("min_p"),
       impl=lambda ctx, op, a: [min_p_filter(a[0], op.attrs["p"])],
       doc="`min_p(x: f32 logits; 0 <= p <= 1)`: over the last axis, an entry whose probability is below p times "
           "the most likely entry's becomes -inf (x < max(x) + log p); the top entry is always kept.")
define("top_p", F, args=1, attrs={"p": Attr("num")}, infer=_filter_infer("top_p"), impl=_top_p,
       doc="`top_p(x: f32 logits; 0 < p <= 1)`: over the last axis, sorted by descending probability, an entry "
           "is dropped (-inf) when the entries ranked above it already hold probability >= p; the top entry is "
           "always kept.")


@dataclass(frozen=True)
class Penalties:
    """The one sampling rule's penalties, applied after the logit bias and before temperature,
    as vLLM applies them: repetition (HF's: a seen token's logit divided by it when positive,
    multiplied when not) over every token of the context; then frequency (minus frequency x
    count) and presence (minus presence once) over the output's tokens, those at context index
    `output_start` and later (OpenAI's formula). Off: 0, 0, 1."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    output_start: int = 0

    def problem(self) -> str | None:
        """Why these penalties are not valid, or None."""
        for name in ("presence", "frequency", "repetition"):
            v = getattr(self, name)
            if not math.isfinite(v) or abs(v) > F32_MAX:
                return f"{name} penalty {v} is not a finite float32"
        if not self.repetition > 0:
            return f"repetition penalty {self.repetition} must be > 0"
        if self.output_start < 0:
            return f"output start {self.output_start} must be >= 0"
        return None

    @property
    def active(self) -> bool:
        return self.presence != 0 or self.frequency != 0 or self.repetition != 1


def penalize(x: torch.Tensor, ctx: torch.Tensor, ends: torch.Tensor, pen: Penalties) -> torch.Tensor:
    """x [B, R, V] with `pen` applied, row r of pass b counting the tokens ctx[b, :ends[b, r]]
    (ctx [B, M]: the history, then the window; ends [B, R]); ids outside [0, V) count for
    nothing. Counts are exact small integers in float32, so every order of adding gives the same
    bits; the host's Sampler runs this too."""
    B, R, V = x.shape
    M = ctx.shape[-1]
    j = torch.arange(M, device=x.device)
    every = (j.view(1, 1, M) < ends.unsqueeze(-1)) & ((ctx >= 0) & (ctx < V)).unsqueeze(1)  # [B, R, M]
    tok = ctx.clamp(0, max(V - 1, 0)).unsqueeze(1).expand(B, R, M)

    def counts(mask):
        return torch.zeros(B, R, V, dtype=torch.float32, device=x.device).scatter_add_(-1, tok, mask.float())

    def f32(v):
        return torch.tensor(v, dtype=torch.float32, device=x.device)

    if pen.repetition != 1:
        r = f32(pen.repetition)
        x = torch.where(counts(every) > 0, torch.where(x > 0, x / r, x * r), x)
    if pen.presence != 0 or pen.frequency != 0:
        cnt = counts(every & (j >= pen.output_start).view(1, 1, M))
        hit = cnt > 0
        if pen.frequency != 0:
            x = torch.where(hit, x - f32(pen.frequency) * cnt, x)
        if pen.presence != 0:
            x = torch.where(hit, x - f32(pen.presence), x)
    return x


def _penalize_infer(t, av, at):
    x, hist, win = av
    t.need(x, "f32"), t.rank(x, 2)
    t.need(hist, "i64"), t.rank(hist, 1)
    t.need(win, "i64"), t.rank(win, 1)
    why = _penalties(at).problem()
    if why:
        t.fail(why)
    return [Value("f32", x.shape)]


def _penalize(ctx, op, a):
    """Row r of R is the window's row W - R + r: it counts the history and the window up to itself."""
    x, hist, win = a
    R, N, W = x.shape[1], hist.shape[-1], win.shape[-1]
    ends = torch.arange(N + W - R + 1, N + W + 1, device=x.device).expand(x.shape[0], R)
    return [penalize(x, torch.cat([hist, win], -1), ends, _penalties(op.attrs))]


def _penalties(at) -> Penalties:
    return Penalties(at["presence"], at["frequency"], at["repetition"], at["start"])


define("penalize", F, args=3,
       attrs={"start": Attr("int", 0, lo=0), "presence": Attr("num", 0.0), "frequency": Attr("num", 0.0),
              "repetition": Attr("num", 1.0)},
       infer=_penalize_infer, impl=_penalize,
       doc="`penalize(x: f32 [R, V], history: i64 [N], window: i64 [W]; start=0, presence=0, frequency=0, "
           "repetition=1)`: the penalties of the one sampling rule for readout on the window's last R rows (every "
           "row, or the last): row r (the window's row W - R + r) counts the history, then the window up to and "
           "including its row. A token counted there has its logit divided by repetition when positive, "
           "multiplied by it when not (HF's repetition penalty); then a token counted at an index >= start (in "
           "history + window) has frequency x its count, then presence, subtracted (OpenAI's penalties). Ids "
           "outside [0, V) count for nothing; repetition > 0 (`p.penalized(logits, penalties)`).")


def _sample_infer(t, av, at):
    (x,) = av
    t.need(x, "f32")
    t.nonscalar(x, "sample (weights over the last axis)")
    return [Value("i64", x.shape[:-1], [x.shape[-1] + -1])]


def _sample(ctx, op, a):
    w = a[0]
    return [exp_race(w, ctx.uniforms(Stream.SAMPLE, op.attrs["seed"], list(w.shape[1:])))]


def filter_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
                  min_p: float = 0.0) -> torch.Tensor:
    """The one sampling rule's distribution, as logits over the last axis: logits / temperature,
    then top-k (0: off), min-p (0: off), the top-p nucleus (1: off); its softmax is what a token is
    drawn from. A traced `p.filtered(...)` (and so `p.sample` and speculative verification) is
    the same ops in the same order."""
    x = logits if temperature == 1.0 else logits / torch.tensor(temperature, dtype=logits.dtype)
    if top_k > 0:
        x = top_k_filter(x, top_k)
    if min_p > 0:
        x = min_p_filter(x, min_p)
    if top_p < 1.0:
        x = top_p_filter(x, top_p)
    return x


def sample_logits(logits: torch.Tensor, temperature: float, top_p: float, u: torch.Tensor, top_k: int = 0,
                  min_p: float = 0.0) -> torch.Tensor:
    """The one sampling rule: filter_logits, softmax, and the exponential race on uniforms `u`
    (logits' shape). The host's Sampler runs it; a traced `p.sample(...)` is the same ops in the
    same order, so a seeded guest-driven decode and a device loop draw the same tokens."""
    return exp_race(softmax(filter_logits(logits, temperature, top_p, top_k, min_p)), u)


define("sample", F, args=1, attrs={"seed": SEED}, infer=_sample_infer, impl=_sample,
       doc="`sample(w: f32 [..., V]; seed=0)` -> i64 [...]: index i with probability w_i / sum(w) over the last "
           "axis (w >= 0, need not be normalised); -1 if no w_i > 0. Its uniforms are keyed by the position of the "
           "pass's last readout row, as verify_sample keys that row's target draw. Temperature, top-k, min-p and top-p are "
           "composed from the ops above (the tracer's `p.sample(logits, temperature, top_k, top_p, seed, min_p)` "
           "does it in that order).")


define("rand", F, args=0, attrs={"shape": Attr("dims"), "seed": SEED},
       infer=lambda t, av, at: [Value("f32", t.shape(at["shape"]))],
       impl=lambda ctx, op, a: [ctx.uniforms(Stream.RAND, op.attrs["seed"], ctx.shape(ctx.values[op.outs[0]]))],
       doc="`rand(; shape, seed=0)` -> f32 uniforms in [0, 1).")
