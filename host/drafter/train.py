"""Self-distil an MTP draft head for a target that has none (`pie drafter train`).

The data is the target's own: it answers a fixed prompt set (`prompts.training_prompts`) under its
chat template, then, if `context_share` > 0, in a second round tasks over its own first-round
replies (summarise, translate, extract, answer from a passage: `prompts.context_prompts`, that
share of the token budget), and one forward of the target (in its own dtype) over each prompt +
reply records, at every row j, the hidden state h_j before the final norm and the target's argmax c_j. The head
learns, for row j,

    step 1:  (h_j, embed(x_{j+1}))  at position j      -> c_{j+1}
    step s:  (g_{s-1,j}, embed(c_{j+s-1})) at position j+s-1 -> c_{j+s}   (the chained drafts)

where g_{s-1,j} is the previous step's block output. The block's attention follows what chaining
does at inference: a step-1 row attends causally to the step-1 rows before it (the head's KV rows
of accepted positions); a step-s row attends to the step-1 rows 0..j and to its own chain's rows
(steps 2..s at row j), nothing else. Loss: cross-entropy over the draft vocabulary (the most
frequent target choices; a label outside it is ignored in the loss and counted a miss in the
validation figures), only on reply rows (j >= prompt length - 1, where drafting happens).

Stages, each cached in the work folder so that a re-run skips what is done and `resume` continues:
  gen/shard_NNNN.pt    the generated token sequences, gen-context/ the second round's (generation
                       may run in bfloat16: much faster on CPU; the features and labels below
                       always come from the target's dtype)
  feat/shard_NNNN.pt   per sequence: tokens, prompt length, h (bfloat16) and the argmax choices
  ckpt.pt              the head, optimizer, schedule, step and history (every `ckpt_every` steps)
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from transformers import LogitsProcessorList

from .mtp import MtpHead

IGNORE = -100


@dataclass
class TrainConfig:
    name: str
    out: Path | None = None  # default $PIE_HOME/drafters/<name>
    work_dir: Path | None = None  # default <out>.work
    tokens: int = 200_000  # generated reply tokens (train + validation) to collect
    # of those, generated in a second round (tasks over the first round's replies); 0: none. The
    # shipped head was trained without it: with 0.4 the dev acceptance stayed the same (its RECIPE.md)
    context_share: float = 0.0
    # prompts about words of the target's own vocabulary (prompts.vocabulary_words) join the fixed
    # set, so topics do not recur; False: the fixed set only (the head shipped before this option)
    word_prompts: bool = True
    max_new_tokens: int = 192
    gen_batch: int = 128
    gen_dtype: str = "bfloat16"  # the dtype replies are generated in ("auto" = the target's dtype)
    # who generates the replies: "hf" (transformers' generate in gen_dtype) or "engine" (the engine's
    # batched passes on the model as served: engine_gen.py)
    generator: str = "hf"
    features: str = "generate"  # "generate": h and argmax captured while generating (in gen_dtype);
    #                             "forward": one more forward of the target in its own dtype (exact, slower)
    sample_every: int = 4  # every n-th generation batch samples (temperature) instead of greedy; 0: never
    temperature: float = 0.7
    val_every: int = 10  # every n-th prompt is held apart for validation
    epochs: int = 8
    lr: float = 1e-3
    weight_decay: float = 0.01
    batch: int = 8  # sequences per optimizer step
    draft_vocab: int = 0  # 0: the smallest of VOCAB_SIZES covering `coverage` of the training labels
    coverage: float = 0.98
    unroll: int = 2  # chained steps trained (1: step 1 only)
    # weight of the soft target (the target's own distribution over the draft vocabulary at the
    # predicted row, from its stored h) against the hard one (its argmax); 0: hard labels only
    soft: float = 1.0
    step_decay: float = 0.7  # loss weight of step s: decay ** (s - 1)
    # the head's kind: [] an MTP head (the last layer's output); layer indices: an eagle3 head fusing the
    # inputs of those layers (mtp.default_layers: EAGLE-3's low, middle and high)
    layers: list[int] = dataclasses.field(default_factory=list)
    init: str = "random"  # "random" (measured best); "block": block + final norm copied from the target's last layer; "target": also eh_proj ~ [0 | I]
    autocast: bool = True  # bfloat16 autocast for the head's matmuls (CPU: avx512_bf16/AMX)
    eval_points: int = 8  # validations during training (for the plot)
    ckpt_every: int = 50
    ckpt_s: float = 600.0  # and at least this often (seconds): a killed run loses at most this much training
    # this run's wall-clock budget in seconds (None: none): past it the run stops at the next shard or
    # step, checkpointed, and `resume` continues it
    budget_s: float | None = None
    seed: int = 0
    resume: bool = False
    max_steps: int | None = None  # cap the schedule at this many optimizer steps
    stop_after: int | None = None  # interrupt after this many steps of this run (checkpointed; tests)
    progress: bool = True
    command: str = ""  # the command line, for the recipe

    def resolved(self) -> "TrainConfig":
        from ..paths import drafters_dir

        c = copy.copy(self)
        c.out = Path(c.out) if c.out else drafters_dir() / c.name
        c.work_dir = Path(c.work_dir) if c.work_dir else c.out.parent / f"{c.out.name}.work"
        return c


VOCAB_SIZES = (1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384)


# ---- data -------------------------------------------------------------------------------

def _encode_prompt(tok, text: str) -> list[int]:
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return list(tok.encode(text))


def _eos_ids(model, tok) -> list[int]:
    e = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if e is None:
        e = getattr(tok, "eos_token_id", None)
    return [] if e is None else ([e] if isinstance(e, int) else list(e))


def _tqdm(it=None, **kw):
    from tqdm.auto import tqdm

    return tqdm(it, **kw)


def _gen_meta(cfg: TrainConfig, prompts: list[str]) -> dict:
    if cfg.generator == "engine":  # the engine's own passes: the model as served, float32, features inline
        return {"generator": "engine", "max_new_tokens": cfg.max_new_tokens, "gen_batch": cfg.gen_batch,
                "sample_every": cfg.sample_every, "temperature": cfg.temperature, "seed": cfg.seed,
                "prompts": len(prompts), "first_prompt": prompts[0] if prompts else "", "layers": list(cfg.layers)}
    meta = {"max_new_tokens": cfg.max_new_tokens, "gen_batch": cfg.gen_batch, "gen_dtype": cfg.gen_dtype,
            "features": cfg.features,
            "sample_every": cfg.sample_every, "temperature": cfg.temperature, "seed": cfg.seed,
            "prompts": len(prompts), "first_prompt": prompts[0] if prompts else ""}
    if cfg.layers and cfg.features == "generate":  # shards then hold those layers' inputs too
        meta["layers"] = list(cfg.layers)
    return meta


def _layer_hooks(model, layers: list[int], sink: dict) -> list:
    """Forward pre-hooks keeping the input of each of `layers` (num_layers: the final norm's input)
    in sink[layer], one tensor per call appended."""
    dec = model.get_decoder()
    mods = [dec.norm if c == len(dec.layers) else dec.layers[c] for c in layers]
    for c in layers:
        sink[c] = []
    def keep(c):
        def hook(_m, args, kwargs):
            sink[c].append(args[0] if args else kwargs["hidden_states"])
        return hook
    return [m.register_forward_pre_hook(keep(c), with_kwargs=True) for m, c in zip(mods, layers)]


def until_eos(reply: list[int], eos: list[int]) -> list[int]:
    """A generated reply up to and including its first end-of-sequence token (padding after it dropped)."""
    for j, t in enumerate(reply):
        if t in eos:
            return reply[:j + 1]
    return reply


def _reply_tokens(seqs: list[dict]) -> int:
    return sum(len(q["ids"]) - q["prompt_len"] for q in seqs)


def _shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("shard_*.pt")) if folder.exists() else []


def _save_atomic(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class _ArgmaxRecorder:
    """A logits processor that records each step's argmax (temperature keeps it)."""

    def __init__(self, out: list):
        self.out = out

    def __call__(self, input_ids, scores):
        self.out.append(scores.argmax(-1))
        return scores


def _now() -> float:
    """The clock of the budget and of timed checkpoints (a test's to replace)."""
    return time.time()


@torch.inference_mode()
def generate(target, tok, prompts: list[str], cfg: TrainConfig, work: Path, folder: str = "gen",
             first_index: int = 0, deadline: float | None = None, engine_factory=None) -> list[dict]:
    """The target's replies, in shards of `gen_batch` prompts, until `tokens` reply tokens are
    collected; existing shards are reused (a different generation setting needs a fresh work folder).
    Prompt i gets prompt_index first_index + i. With cfg.generator "engine", engine_factory(kv_pages)
    makes the engine that generates (engine_gen.py), its pool sized for a batch of these prompts."""
    gdir = work / folder
    gdir.mkdir(parents=True, exist_ok=True)
    meta = _gen_meta(cfg, prompts)
    mfile = gdir / "meta.json"
    if mfile.exists() and json.loads(mfile.read_text()) != meta:
        raise ValueError(f"{gdir} holds replies generated with other settings ({mfile.read_text().strip()}); "
                         "use another --work-dir or remove it")
    mfile.write_text(json.dumps(meta) + "\n")
    seqs: list[dict] = []
    for s in _shards(gdir):
        seqs += torch.load(s)
    have = _reply_tokens(seqs)
    eos = _eos_ids(target, tok)
    pad = getattr(tok, "pad_token_id", None)
    pad = pad if pad is not None else (eos[0] if eos else 0)
    gdt = target.dtype if cfg.gen_dtype == "auto" else getattr(torch, cfg.gen_dtype)
    engine = None
    if cfg.generator == "engine":
        gen_model = None
    else:
        gen_model = target if gdt == target.dtype else copy.deepcopy(target).to(gdt)
    k = len(_shards(gdir))
    inline = cfg.features == "generate"
    bar = _tqdm(total=cfg.tokens, initial=min(have, cfg.tokens), desc="generate", unit="tok",
                disable=not cfg.progress)
    tfile = gdir / "seconds.json"  # generation time per shard, so a re-run can report it
    secs = json.loads(tfile.read_text()) if tfile.exists() else {}
    while have < cfg.tokens and k * cfg.gen_batch < len(prompts):
        if deadline is not None and _now() > deadline:  # the shards so far are kept: a resume goes on
            break
        ts = time.time()
        idx = list(range(k * cfg.gen_batch, min((k + 1) * cfg.gen_batch, len(prompts))))
        enc = [_encode_prompt(tok, prompts[i]) for i in idx]
        sample = cfg.sample_every > 0 and k % cfg.sample_every == cfg.sample_every - 1
        if cfg.generator == "engine":
            from .engine_gen import pages_for, replies

            if engine is None:
                if engine_factory is None:
                    raise ValueError("generator 'engine' needs an engine_factory")
                engine = engine_factory(pages_for([_encode_prompt(tok, p) for p in prompts], cfg.gen_batch,
                                                  cfg.max_new_tokens))

            g = torch.Generator().manual_seed(cfg.seed * 100_003 + k)
            shard = [q | {"prompt_index": first_index + i, "sampled": sample}
                     for i, q in zip(idx, replies(engine, enc, cfg.max_new_tokens, eos, cfg.layers,
                                                  cfg.temperature if sample else 0.0, g))]
        else:  # transformers' generate, features captured by hooks
            T = max(map(len, enc))
            ids = torch.tensor([[pad] * (T - len(e)) + e for e in enc])
            mask = torch.tensor([[0] * (T - len(e)) + [1] * len(e) for e in enc])
            kw = dict(do_sample=True, temperature=cfg.temperature, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
            hs, choices, fs = [], [], {}
            handle = gen_model.get_decoder().norm.register_forward_pre_hook(lambda _m, a: hs.append(a[0]))
            extra = _layer_hooks(gen_model, cfg.layers, fs) if inline and cfg.layers else []
            proc = _ArgmaxRecorder(choices)
            try:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(cfg.seed * 100_003 + k)
                    out = gen_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=cfg.max_new_tokens,
                                             pad_token_id=pad, eos_token_id=eos or None,
                                             logits_processor=LogitsProcessorList([proc]) if inline else None, **kw)
            finally:
                handle.remove()
                for x in extra:
                    x.remove()
            shard = []
            for b, i in enumerate(idx):
                reply = until_eos(out[b, T:].tolist(), eos)
                q = {"prompt_index": first_index + i, "ids": enc[b] + reply, "prompt_len": len(enc[b]), "sampled": sample}
                if inline:  # h of rows 0..L-2 (prefill, then one row per decode step); c_j for j >= P-1
                    P, n, o = len(enc[b]), len(reply), T - len(enc[b])
                    h = torch.cat([hs[0][b, o:]] + [x[b] for x in hs[1:n]]).to(torch.bfloat16).clone()
                    c = torch.full((P + n,), -1, dtype=torch.int32)
                    c[P - 1:P - 1 + n] = torch.stack([x[b] for x in choices[:n]]).to(torch.int32)
                    q.update(ids=torch.tensor(q["ids"], dtype=torch.int32), h=h, choice=c)
                    if cfg.layers:  # the eagle3 head's input: its layers' inputs side by side, per row
                        q["feat"] = torch.cat([torch.cat([fs[l][0][b, o:]] + [x[b] for x in fs[l][1:n]])
                                               for l in cfg.layers], -1).to(torch.bfloat16).clone()
                shard.append(q)
        _save_atomic(shard, gdir / f"shard_{k:04d}.pt")
        secs[str(k)] = round(time.time() - ts, 2)
        tfile.write_text(json.dumps(secs) + "\n")
        seqs += shard
        got = _reply_tokens(shard)
        have += got
        bar.update(min(got, max(0, cfg.tokens - bar.n)))
        k += 1
    bar.close()
    del gen_model, engine
    return seqs


@torch.inference_mode()
def capture(target, seqs: list[dict], cfg: TrainConfig, work: Path, batch_tokens: int = 4096) -> list[dict]:
    """One forward of the target per batch of sequences: h before the final norm (bfloat16) and the
    argmax at every row. Cached per generation shard."""
    fdir = work / "feat"
    fdir.mkdir(parents=True, exist_ok=True)
    by_shard: dict[int, list[dict]] = {}
    for q in seqs:
        by_shard.setdefault(q["prompt_index"] // cfg.gen_batch, []).append(q)
    store: dict = {}
    fs: dict = {}

    def hook(_mod, args):
        store["h"] = args[0]

    out_seqs = []
    todo = [k for k in sorted(by_shard) if not (fdir / f"shard_{k:04d}.pt").exists()]
    bar = _tqdm(total=sum(len(q["ids"]) for k in todo for q in by_shard[k]), desc="features", unit="tok",
                disable=not cfg.progress)
    handle = target.get_decoder().norm.register_forward_pre_hook(hook)
    extra = _layer_hooks(target, cfg.layers, fs) if cfg.layers else []
    lm_w = target.get_output_embeddings().weight
    try:
        for k in sorted(by_shard):
            path = fdir / f"shard_{k:04d}.pt"
            if path.exists():
                out_seqs += torch.load(path)
                continue
            items = sorted(by_shard[k], key=lambda q: len(q["ids"]))
            feats = []
            i = 0
            while i < len(items):
                j = i + 1
                while j < len(items) and (j + 1 - i) * len(items[j]["ids"]) <= batch_tokens:
                    j += 1
                group = items[i:j]
                L = max(len(q["ids"]) for q in group)
                ids = torch.tensor([q["ids"] + [0] * (L - len(q["ids"])) for q in group])
                mask = torch.tensor([[1] * len(q["ids"]) + [0] * (L - len(q["ids"])) for q in group])
                o = target.get_decoder()(input_ids=ids, attention_mask=mask)
                normed, h = o.last_hidden_state, store.pop("h")
                layer_in = [fs[c].pop() for c in cfg.layers]
                for b, q in enumerate(group):
                    n = len(q["ids"])
                    choice = torch.cat([F.linear(normed[b, r:min(r + 512, n)], lm_w).argmax(-1) for r in range(0, n, 512)])
                    feats.append({**q, "ids": torch.tensor(q["ids"], dtype=torch.int32),
                                  "h": h[b, :n].to(torch.bfloat16).clone(), "choice": choice.to(torch.int32)})
                    if cfg.layers:
                        feats[-1]["feat"] = torch.cat([x[b, :n] for x in layer_in], -1).to(torch.bfloat16).clone()
                    bar.update(n)
                i = j
            feats.sort(key=lambda q: q["prompt_index"])
            _save_atomic(feats, path)
            out_seqs += feats
    finally:
        handle.remove()
        for x in extra:
            x.remove()
        bar.close()
    return out_seqs


def _reply_rows(q: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """(h, next token, label, first trained row, the head's input) over rows 0..n-2 of a sequence:
    row j takes h_j (an eagle3 head: its layers' inputs, "feat") and x_{j+1}, its label is c_{j+1};
    rows before prompt_len - 1 are context only."""
    ids, choice = q["ids"].long(), q["choice"].long()
    n = len(ids) - 1
    return q["h"][:n], ids[1:], choice[1:], q["prompt_len"] - 1, q.get("feat", q["h"])[:n]


def choose_draft_vocab(seqs: list[dict], vocab_size: int, size: int, coverage: float) -> tuple[torch.Tensor, dict]:
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for q in seqs:
        _, _, lab, start, _ = _reply_rows(q)
        lab = lab[start:]
        counts += torch.bincount(lab[lab >= 0], minlength=vocab_size)
    total = int(counts.sum())
    order = torch.argsort(counts, descending=True, stable=True)
    cum = counts[order].cumsum(0).double() / max(total, 1)
    table = {n: float(cum[min(n, vocab_size) - 1]) for n in VOCAB_SIZES if n <= vocab_size}
    if not size:
        size = next((n for n in VOCAB_SIZES if n <= vocab_size and table[n] >= coverage),
                    min(VOCAB_SIZES[-1], vocab_size))
        size = min(size, vocab_size)
    size = min(size, vocab_size)
    ids = torch.sort(order[:size]).values
    return ids, {"size": size, "coverage": float(cum[size - 1]), "distinct_labels": int((counts > 0).sum()),
                 "coverage_by_size": table, "label_rows": total}


# ---- the head's forward over sequences --------------------------------------------------

class _Rows:
    """A duck-typed KV cache for the block: step 1's keys/values stay, each chained step's are appended."""

    def __init__(self):
        self.k = self.v = None

    def update(self, k, v, layer_idx=None, *args, **kwargs):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


def _chain_mask(T: int, step: int, device) -> torch.Tensor:
    """[1, 1, T, step*T] bool: a step-`step` row j sees step-1 rows 0..j and its own chain's rows."""
    r = torch.arange(T, device=device)
    m = [r[None, :] <= r[:, None]]
    m += [r[None, :] == r[:, None]] * (step - 1)
    return torch.cat(m, dim=1)[None, None]


class Batch:
    def __init__(self, seqs: list[dict], vmap: torch.Tensor, unroll: int):
        rows = [_reply_rows(q) for q in seqs]
        T = max(len(r[1]) for r in rows)
        B, H = len(rows), rows[0][0].shape[-1]
        self.h = torch.zeros(B, T, rows[0][4].shape[-1])  # the head's input at step 1
        self.nxt = torch.zeros(B, T, dtype=torch.long)
        self.full = torch.zeros(B, T + unroll, dtype=torch.long)  # target choices c_{j+1}, for chained inputs
        self.lab = torch.full((B, T + unroll), IGNORE, dtype=torch.long)  # draft-vocab index of c_{j+1}
        self.raw = torch.full((B, T + unroll), IGNORE, dtype=torch.long)  # c_{j+1}, trained rows only
        self.h_next = torch.zeros(B, T + unroll, H)  # h_{j+1}: where the target chose c_{j+1}
        self.h_next_ok = torch.zeros(B, T + unroll, dtype=torch.bool)
        for b, (h, nxt, lab, start, x) in enumerate(rows):
            n = len(nxt)
            self.h[b, :n] = x.float()
            self.h_next[b, :n - 1] = h[1:n].float()
            self.h_next_ok[b, :n - 1] = True
            self.nxt[b, :n] = nxt
            known = lab >= 0  # -1: a choice not recorded (prompt rows, after the last token)
            self.full[b, :n] = lab.clamp(min=0)
            t = torch.where(known, lab, IGNORE)
            t[:start] = IGNORE
            self.raw[b, :n] = t
            self.lab[b, :n] = torch.where(t >= 0, vmap[t.clamp(min=0)], IGNORE)
        self.T = T


def head_steps(head: MtpHead, target, batch: Batch, W: torch.Tensor, steps: int, teacher: bool = True):
    """Run `steps` chained steps over a batch. Yields (step, logits [B, T, Vd]); step s's row j
    predicts c_{j+s}. teacher: step s > 1 embeds the label c_{j+s-1}, else the previous step's draft."""
    embed = target.get_input_embeddings()
    rotary = target.get_decoder().rotary_emb
    T = batch.T
    cache = _Rows()
    hidden, tokens = batch.h, batch.nxt
    for s in range(1, steps + 1):
        pos = torch.arange(s - 1, T + s - 1)[None]
        x = embed(tokens)
        pe = rotary(x, pos)
        mask = None if s == 1 else _chain_mask(T, s, x.device)
        g = head(x, hidden, pe, target=s == 1, attention_mask=mask, cache=cache, position_ids=pos)
        logits = head.logits(g, W)
        yield s, logits
        hidden = g
        if teacher:
            tokens = batch.full[:, s - 1:s - 1 + T]
        else:
            tokens = head.draft_vocab[logits.argmax(-1)]


def _soft_ce(logits: torch.Tensor, target, h_next: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the head's logits [N, Vd] against the target's own distribution over the
    draft vocabulary at the predicted rows (its final norm and lm_head rows W over h_next [N, H]):
    every row teaches the ranking of all draft ids, not only the target's first choice."""
    with torch.no_grad():
        p = F.softmax(F.linear(target.get_decoder().norm(h_next), W).float(), dim=-1)
    return -(p * F.log_softmax(logits.float(), dim=-1)).sum(-1).mean()


def _init_head(head: MtpHead, target, how: str) -> None:
    if how == "random":
        return
    last = target.get_decoder().layers[-1]
    head.block.load_state_dict(last.state_dict())
    head.norm.load_state_dict(target.get_decoder().norm.state_dict())
    if how == "block":  # eh_proj keeps its random init
        return
    H = head.config.hidden_size
    with torch.no_grad():
        w = torch.zeros(H, 2 * H)
        e_cols, h_cols = (slice(H, 2 * H), slice(0, H)) if head.hidden_first else (slice(0, H), slice(H, 2 * H))
        w[:, h_cols] = torch.eye(H)
        w[:, e_cols] = torch.randn(H, H) * (0.02 if how == "target" else 0.0)
        head.eh_proj.weight.copy_(w)


# ---- training ---------------------------------------------------------------------------

def _lr_at(step: int, total: int, base: float, warmup: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


def _batches(n: int, size: int, seed: int, epoch: int, lengths: list[int]) -> list[list[int]]:
    """A seeded order of the training sequences: shuffled, sorted by length within windows of
    8 batches (less padding), batches shuffled."""
    rng = random.Random(seed * 7919 + epoch)
    order = list(range(n))
    rng.shuffle(order)
    win = size * 8
    order = [i for w in range(0, n, win) for i in sorted(order[w:w + win], key=lambda i: lengths[i])]
    out = [order[i:i + size] for i in range(0, n, size)]
    rng.shuffle(out)
    return out


@torch.no_grad()
def evaluate(head: MtpHead, target, seqs: list[dict], vmap, W, steps: int, autocast: bool,
             batch: int = 8, stops: tuple[float, ...] = ()) -> dict:
    """Greedy chained drafting over the validation rows: top-1 of step 1, step s's top-1 given the
    drafts before it were right, and the expected accepted drafts for k = 1..steps (rows whose k
    next choices exist), plus the validation loss of step 1. With `stops`, for each confidence stop
    P (op mtp_draft's min_prob): the drafts a row's chain of `steps` proposes when it stops before a
    draft whose probability (softmax over the draft vocabulary) is below P, and how many of those
    are accepted, per row."""
    was = head.training
    head.eval()
    n_rows = 0
    ok_prefix = torch.zeros(steps)  # rows whose first s drafts were all right
    loss_sum, loss_n, hit1, n1 = 0.0, 0, 0, 0
    proposed, kept = torch.zeros(len(stops)), torch.zeros(len(stops))  # per stop: drafts, accepted drafts
    for i in range(0, len(seqs), batch):
        bt = Batch(seqs[i:i + batch], vmap, steps)
        T = bt.T
        all_ok = None
        rows = (bt.raw[:, :T] != IGNORE) & (bt.raw[:, steps - 1:T + steps - 1] != IGNORE)
        alive = [rows] * len(stops)  # rows whose chain has not stopped, per stop
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            for s, logits in head_steps(head, target, bt, W, steps, teacher=False):
                logits = logits.float()
                draft = head.draft_vocab[logits.argmax(-1)]
                lab = bt.raw[:, s - 1:T + s - 1]
                ok = draft == lab
                if s == 1:
                    valid = lab != IGNORE
                    hit1 += int((ok & valid).sum())
                    n1 += int(valid.sum())
                    tl = bt.lab[:, :T]
                    m = tl != IGNORE
                    if m.any():
                        loss_sum += float(F.cross_entropy(logits[m], tl[m], reduction="sum"))
                        loss_n += int(m.sum())
                all_ok = ok if all_ok is None else all_ok & ok
                ok_prefix[s - 1] += float((all_ok & rows).sum())
                if stops:
                    sure = torch.softmax(logits, -1).amax(-1)
                    for x, P in enumerate(stops):
                        alive[x] = alive[x] & (sure >= P)
                        proposed[x] += float(alive[x].sum())
                        kept[x] += float((alive[x] & all_ok).sum())
        n_rows += int(rows.sum())
    head.train(was)
    p = (ok_prefix / max(n_rows, 1)).tolist()
    res = {"top1": hit1 / max(n1, 1), "loss": loss_sum / max(loss_n, 1), "rows": n1,
           "p_all_correct": p, "expected_accepted": [sum(p[:k]) for k in range(1, steps + 1)]}
    for s in range(2, steps + 1):
        res[f"top1_step{s}"] = p[s - 1] / p[s - 2] if p[s - 2] else 0.0
    if stops:
        res["stops"] = [{"min_prob": P, "drafts": float(d) / max(n_rows, 1), "accepted": float(a) / max(n_rows, 1)}
                        for P, d, a in zip(stops, proposed, kept)]
    return res


def _plot(history: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax1 = plt.subplots(figsize=(8, 4.5))
    if history["train"]:
        st, lo = zip(*[(h["step"], h["loss"]) for h in history["train"]])
        ax1.plot(st, lo, color="tab:blue", alpha=0.35, lw=0.8)
        k = max(1, len(lo) // 40)
        if k > 1:
            sm = [sum(lo[max(0, i - k + 1):i + 1]) / len(lo[max(0, i - k + 1):i + 1]) for i in range(len(lo))]
            ax1.plot(st, sm, color="tab:blue", lw=1.5)
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("train loss (step 1 + chained)", color="tab:blue")
    ax2 = ax1.twinx()
    if history["val"]:
        vs = [h["step"] for h in history["val"]]
        ax2.plot(vs, [h["top1"] for h in history["val"]], "o-", color="tab:red", label="val top-1 (step 1)")
        if "top1_step2" in history["val"][0]:
            ax2.plot(vs, [h["top1_step2"] for h in history["val"]], "s--", color="tab:orange",
                     label="val top-1 (step 2 | step 1 right)")
        ax2.legend(loc="lower right")
    ax2.set_ylabel("validation top-1")
    ax2.set_ylim(0, 1)
    ax1.set_title("MTP head self-distillation")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def train(target, tok, cfg: TrainConfig, prompts: list[str] | None = None, engine_factory=None) -> dict:
    """Generate, capture, train and save a head for `target` (a transformers causal LM, eval mode).
    engine_factory(kv_pages) -> Engine: the generator of cfg.generator "engine"."""
    from .prompts import context_prompts, is_validation, training_prompts, vocabulary_words

    t0 = time.time()
    cfg = cfg.resolved()
    work, out = Path(cfg.work_dir), Path(cfg.out)
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    if prompts is None:
        prompts = training_prompts(cfg.seed, vocabulary_words(tok) if cfg.word_prompts else None)
    prompts = list(prompts)
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)

    tg = time.time()
    deadline = None if cfg.budget_s is None else _now() + cfg.budget_s
    out_of_time = lambda: deadline is not None and _now() > deadline  # noqa: E731
    second = round(cfg.tokens * cfg.context_share)
    seqs = generate(target, tok, prompts, dataclasses.replace(cfg, tokens=cfg.tokens - second), work,
                    deadline=deadline, engine_factory=engine_factory)
    rounds = {"first": {"sequences": len(seqs), "reply_tokens": _reply_tokens(seqs)}}
    if second and not out_of_time():
        shortest = min(40, cfg.max_new_tokens // 2)  # a passage worth working on
        passages = [(q["prompt_index"], text) for q in seqs if len(q["ids"]) - q["prompt_len"] >= shortest
                    for text in [tok.decode(list(q["ids"][q["prompt_len"]:]), skip_special_tokens=True).strip()]
                    if text]
        ctx = context_prompts(passages, len(prompts), len(prompts), cfg.seed, cfg.val_every)
        more = generate(target, tok, ctx, dataclasses.replace(cfg, tokens=second), work, "gen-context", len(prompts),
                        deadline=deadline, engine_factory=engine_factory)
        rounds["second"] = {"sequences": len(more), "reply_tokens": _reply_tokens(more),
                            "prompt_tokens": sum(q["prompt_len"] for q in more)}
        seqs += more
    t_gen_run = time.time() - tg
    if out_of_time():  # the data is not all made: the shards so far are kept for --resume
        if cfg.progress:
            print(f"stopped at the budget of {cfg.budget_s:.0f} s while generating ({_reply_tokens(seqs)} of "
                  f"{cfg.tokens} reply tokens); run again with --resume to go on", file=sys.stderr)
        return {"out": None, "work": work, "history": {"train": [], "val": []}, "steps": 0, "interrupted": True}
    t_gen = 0.0
    for folder in ("gen", "gen-context"):
        f = work / folder / "seconds.json"
        shard_s = json.loads(f.read_text()) if f.exists() else {}
        t_gen += sum(shard_s.get(str(k), 0.0) for k in range(len(_shards(work / folder))))
    tc, t_cap = time.time(), 0.0
    if cfg.features == "forward":
        seqs = capture(target, seqs, cfg, work)
        t_cap = time.time() - tc
    if cfg.layers and any("feat" not in q for q in seqs):
        raise ValueError(f"{work} holds features without the layers {list(cfg.layers)} an eagle3 head reads "
                         "(made for an MTP head); use another --work-dir")
    val = [q for q in seqs if is_validation(q["prompt_index"], cfg.val_every)]
    trn = [q for q in seqs if not is_validation(q["prompt_index"], cfg.val_every)]
    if not trn or not val:
        raise ValueError(f"too little data: {len(trn)} training and {len(val)} validation sequences; raise --tokens")
    V = target.get_output_embeddings().out_features
    dv, vinfo = choose_draft_vocab(trn, V, cfg.draft_vocab, cfg.coverage)
    vmap = torch.full((V,), IGNORE, dtype=torch.long)
    vmap[dv] = torch.arange(len(dv))
    reply_tokens = _reply_tokens(seqs)
    data = {"prompts_train": len(trn), "prompts_val": len(val), "reply_tokens": reply_tokens, "rounds": rounds,
            "rows_total": sum(len(q["ids"]) - 1 for q in seqs),
            "train_rows": _reply_tokens(trn),
            "val_rows": _reply_tokens(val),
            "greedy_agreement": _agreement(seqs) if cfg.features == "forward" else None}
    if cfg.progress:
        print(f"data: {len(trn)} training / {len(val)} validation sequences, {reply_tokens} reply tokens; "
              f"draft vocabulary {vinfo['size']} ids covering {vinfo['coverage']:.2%} of the labels", file=sys.stderr)

    head = MtpHead(target, draft_vocab=dv, layers=cfg.layers or None)
    head.set_attention("sdpa")
    _init_head(head, target, cfg.init)
    head.train()
    W = head.output_weight(target.get_output_embeddings().weight).detach()
    params = [p for p in head.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    nodecay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": nodecay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.98))
    lengths = [len(q["ids"]) for q in trn]
    per_epoch = math.ceil(len(trn) / cfg.batch)
    total = per_epoch * cfg.epochs
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)
    warmup = max(1, min(30, total // 10))
    eval_at = {min(total, max(1, round(total * (i + 1) / cfg.eval_points))) for i in range(cfg.eval_points)}
    history = {"train": [], "val": []}
    step, t_train_before = 0, 0.0
    ckpt = work / "ckpt.pt"
    if cfg.resume and ckpt.exists():
        st = torch.load(ckpt, weights_only=False)
        if st["draft_vocab"].tolist() != dv.tolist() or st["total"] != total:
            raise ValueError(f"{ckpt} is from another run (draft vocabulary or schedule differ)")
        head.load_state_dict(st["head"])
        opt.load_state_dict(st["opt"])
        step, history, t_train_before = st["step"], st["history"], st.get("train_s", 0.0)
        if cfg.progress:
            print(f"resumed from {ckpt} at step {step}/{total}", file=sys.stderr)

    def save_ckpt():
        _save_atomic({"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "total": total,
                      "history": history, "draft_vocab": dv, "train_s": t_train_before + time.time() - tt},
                     ckpt)

    tt = time.time()
    weights = [cfg.step_decay ** s for s in range(cfg.unroll)]
    bar = _tqdm(total=total, initial=step, desc="train", unit="step", disable=not cfg.progress)
    first = step
    last_ckpt = _now()

    def stop_now() -> bool:
        return (cfg.stop_after is not None and step - first >= cfg.stop_after) or out_of_time()

    while step < total:
        if stop_now():
            break
        epoch, pos = divmod(step, per_epoch)
        batches = _batches(len(trn), cfg.batch, cfg.seed, epoch, lengths)
        for b_idx in batches[pos:]:
            if step >= total or stop_now():
                break
            for g in opt.param_groups:
                g["lr"] = _lr_at(step, total, cfg.lr, warmup)
            bt = Batch([trn[i] for i in b_idx], vmap, cfg.unroll)
            T = bt.T
            loss, parts = 0.0, []
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast):
                for s, logits in head_steps(head, target, bt, W, cfg.unroll, teacher=True):
                    lab = bt.lab[:, s - 1:T + s - 1]
                    m = lab != IGNORE
                    ls = F.cross_entropy(logits[m].float(), lab[m]) if m.any() else logits.sum() * 0
                    if cfg.soft:
                        ms = m & bt.h_next_ok[:, s - 1:T + s - 1]
                        if ms.any():
                            ls = (1 - cfg.soft) * ls + cfg.soft * _soft_ce(logits[ms], target, bt.h_next[:, s - 1:T + s - 1][ms], W)
                    parts.append(float(ls.detach()))
                    loss = loss + weights[s - 1] * ls
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            history["train"].append({"step": step, "loss": float(loss.detach()), "steps": parts})
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", s1=f"{parts[0]:.3f}")
            if step in eval_at:
                v = evaluate(head, target, val, vmap, W, min(2, max(cfg.unroll, 2)), cfg.autocast)
                history["val"].append({"step": step, **{k: v[k] for k in v if k.startswith("top1") or k == "loss"}})
                if cfg.progress:
                    bar.write(f"step {step}: val top-1 {v['top1']:.3f}"
                              + (f", step-2 top-1 {v['top1_step2']:.3f}" if "top1_step2" in v else "")
                              + f", val loss {v['loss']:.3f}")
            if step % cfg.ckpt_every == 0 or step == total or time.time() - last_ckpt > cfg.ckpt_s:
                save_ckpt()
                last_ckpt = _now()
    bar.close()
    if step < total:  # interrupted
        save_ckpt()
        if cfg.progress and out_of_time():
            print(f"stopped at the budget of {cfg.budget_s:.0f} s at step {step}/{total} (checkpointed); run again "
                  "with --resume to go on", file=sys.stderr)
        return {"out": None, "work": work, "history": history, "steps": step, "interrupted": True}
    t_train = t_train_before + time.time() - tt

    final = evaluate(head, target, val, vmap, W, 4, cfg.autocast)
    wall = time.time() - t0
    recipe = {
        "method": "self-distillation (target's own replies, its argmax choices as labels)",
        "command": cfg.command,
        "prompts": ("host.drafter.prompts.training_prompts(seed, vocabulary_words(tokenizer)) (single-word topics of "
                    "the target's vocabulary x tasks, " if cfg.word_prompts else
                    "host.drafter.prompts.training_prompts(seed) (") + "topics x tasks, code, math, stories, dialogue, rewrite, "
                   "questions)" + (", then context_prompts over the first round's replies (summarise, translate, "
                                   "extract, answer from one or two passages)" if cfg.context_share else ""),
        "seed": cfg.seed, "tokens_budget": cfg.tokens, "context_share": cfg.context_share, "max_new_tokens": cfg.max_new_tokens, "features": cfg.features,
        "generation": {"generator": cfg.generator, "batch": cfg.gen_batch,
                       "dtype": cfg.gen_dtype if cfg.generator == "hf" else "the engine's (float32 over the stored weights)",
                       "greedy_except_every": cfg.sample_every,
                       "temperature": cfg.temperature, "chat_template": bool(getattr(tok, "chat_template", None))},
        "data": data, "validation_split": f"every {cfg.val_every}th prompt",
        "draft_vocab": {k: vinfo[k] for k in ("size", "coverage", "distinct_labels", "label_rows")},
        "draft_vocab_oov": "labels outside the draft vocabulary are ignored in the loss, counted misses in validation",
        "training": {"epochs": cfg.epochs, "steps": step, "batch_sequences": cfg.batch, "lr": cfg.lr,
                     "schedule": f"linear warmup {warmup} steps, cosine to 10%", "optimizer": "AdamW(0.9, 0.98)",
                     "weight_decay": cfg.weight_decay, "unroll": cfg.unroll, "step_decay": cfg.step_decay,
                     "init": cfg.init, "autocast_bf16": cfg.autocast, "soft": cfg.soft},
        "validation": {"top1": round(final["top1"], 4),
                       **{f"top1_step{s}": round(final[f"top1_step{s}"], 4) for s in range(2, 5)},
                       "expected_accepted": {str(k + 1): round(x, 4) for k, x in enumerate(final["expected_accepted"])},
                       "loss": round(final["loss"], 4), "rows": final["rows"]},
        "time_s": {"generate": round(t_gen, 1), "generate_this_run": round(t_gen_run, 1),
                   "features": round(t_cap, 1), "train": round(t_train, 1), "total_this_run": round(wall, 1)},
        "host": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
        "kind": head.kind, "layers": list(head.layers) if head.layers else None,
    }
    spec = head.spec(cfg.name, source="trained", recipe=recipe)
    head.save(out, spec, dtype=torch.bfloat16)
    _plot(history, out / "training.png")
    (work / "history.json").write_text(json.dumps(history) + "\n")
    (out / "RECIPE.md").write_text(_recipe_md(cfg.name, recipe))
    if cfg.progress:
        ea = ", ".join(f"k={k + 1}: {x:.2f}" for k, x in enumerate(final["expected_accepted"]))
        print(f"validation: top-1 {final['top1']:.3f}, step-2 top-1 {final['top1_step2']:.3f}, "
              f"expected accepted drafts {ea}", file=sys.stderr)
        print(f"saved {out} ({(out / 'head.safetensors').stat().st_size / 1e6:.1f} MB) in {wall:.0f} s", file=sys.stderr)
    return {"out": out, "work": work, "spec": spec, "history": history, "validation": final, "steps": step,
            "interrupted": False,
            "recipe": recipe}


def _agreement(seqs: list[dict]) -> float:
    """How often the target (in its own dtype) chose the greedy replies' next token: generation in
    bfloat16 vs the features' dtype."""
    n = hit = 0
    for q in seqs:
        if q.get("sampled"):
            continue
        ids, c, p = q["ids"].long(), q["choice"].long(), q["prompt_len"]
        hit += int((c[p - 1:len(ids) - 1] == ids[p:]).sum())
        n += len(ids) - p
    return round(hit / max(n, 1), 4)


def _loss_words(soft: float) -> str:
    hard = "cross-entropy against the target's argmax (the label)"
    full = ("cross-entropy against the target's own distribution over the draft vocabulary at the predicted "
            "row (softmax of its lm_head rows over its final norm of the stored h)")
    if not soft:
        return hard
    return full if soft == 1 else f"{soft} x {full} + {1 - soft:g} x {hard}"


def _recipe_md(name: str, r: dict) -> str:
    v, g, t, d = r["validation"], r["generation"], r["training"], r["data"]
    ea = ", ".join(f"k={k}: {x}" for k, x in v["expected_accepted"].items())
    feats = ("read out of the engine's own passes while generating (each row's features and argmax, as the "
             "engine computes them when it serves)" if g.get("generator") == "engine" else
             "captured while generating (the pre-norm hook and each step's argmax, in the generation dtype)"
             if r.get("features", "generate") == "generate" else
             "from one more forward of the target in its own dtype")
    sampled = f"every {g['greedy_except_every']}th batch sampled at temperature {g['temperature']}, the rest greedy" \
        if g["greedy_except_every"] else "all greedy"
    second = (f", a share of {r['context_share']} of them in the second round (rounds: {json.dumps(d['rounds'])})"
              if r.get("context_share") else "")
    fused = (f"; the inputs of layers {', '.join(map(str, r['layers']))} (the hidden states entering them, side by "
             "side: the head's fused features, through its fc)" if r.get("kind") == "eagle3" else "")
    what = "EAGLE-3-style draft head (fused features of three layers)" if r.get("kind") == "eagle3" else \
        "MTP draft head"
    return f"""# {name}: a self-distilled {what}

Made by

    {r['command'] or '(a library call of host.drafter.train.train)'}

Data (seed {r['seed']}):

- Prompts: {r['prompts']}; every {r['validation_split'].split()[1]} prompt held apart for validation.
- The target answered each prompt under its chat template ({'the engine' + "'" + 's batched passes' if g.get('generator') == 'engine' else 'transformers generate'}): up to {r['max_new_tokens']} new tokens, batches of
  {g['batch']} prompts, in {g['dtype']}; {sampled}; until {r['tokens_budget']} reply tokens{second}.
- {d['prompts_train']} training / {d['prompts_val']} validation replies, {d['reply_tokens']} reply tokens
  ({d['train_rows']} training rows, {d['val_rows']} validation rows; {d['rows_total']} rows with the prompts as context).
- Features: h (the target's last hidden state before its final norm, stored in bfloat16){fused} and the
  target's argmax at every row, {feats}. Label of row j: the target's own choice at row j+1.
- Draft vocabulary: the {r['draft_vocab']['size']} most frequent training labels, covering
  {r['draft_vocab']['coverage']:.2%} of them ({r['draft_vocab']['distinct_labels']} distinct); {r['draft_vocab_oov']}.

Training: {t['epochs']} epochs, {t['steps']} steps of {t['batch_sequences']} sequences, {t['optimizer']}, lr {t['lr']}
({t['schedule']}), weight decay {t['weight_decay']}, {t['unroll']} chained steps trained (step s weighted
{t['step_decay']}^(s-1), step s > 1 fed the previous label and the previous step's output), init {t['init']},
bfloat16 autocast {t['autocast_bf16']}. Loss per step: {_loss_words(t.get('soft', 0.0))}.

Time (s): {json.dumps(r['time_s'])} on {r['host']}.

Validation (greedy chaining over the held-apart replies):

- top-1 (step 1): {v['top1']}
- step-2 top-1 (given step 1 right): {v['top1_step2']}; step 3: {v['top1_step3']}; step 4: {v['top1_step4']}
- expected accepted drafts per verification: {ea}
- validation loss (step 1): {v['loss']} over {v['rows']} rows
"""
