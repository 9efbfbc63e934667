"""The engine: a transformers model over a paged KV pool, running ragged batches of passes.

A step is three calls, in the manner of nano-vllm: `prepare` (bookkeeping, no device work
beyond page copies), `run` (one model call for every pass), `apply_fold` (advance each
working set's frozen length by its fold). `forward` does all three for passes whose fold is known.
"""

from __future__ import annotations

import enum

import itertools
import mmap
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..errors import ContextOverflow, InvalidArgument, PieError
from . import attention, kernels
from .compute import on_compute_thread
from .linear import PackedLinears
from .pages import PagePool, Quota
from .prefix_cache import PrefixCache
from .readout import Readout
from .stack import LayerStack
from .suffix_index import SUFFIX_TOKENS, SuffixStore
from .working_set import WorkingSet


@dataclass
class ModelInfo:
    name: str
    architecture: str
    vocab_size: int
    eos_ids: list[int]
    context_len: int
    hidden_size: int
    num_layers: int
    dtype: str
    device: str
    drafters: list[str] = field(default_factory=list)


class Fold(enum.Enum):
    """A fold that is not a constant count of rows."""

    ALL = "all"  # the whole window
    EPILOGUE = "epilogue"  # what the pass's epilogue sets (a device loop)
    CHANNEL = "channel"  # cell 0 of the loop's fold channel, read after the epilogue (a device loop)


@dataclass
class Pass:
    """One window of rows written at `ws`'s frozen end.

    tokens: the window's ids (a list, or an int64 tensor on the model's device).
    readout: window rows whose logits (and hidden state) are returned.
    fold: rows frozen after the pass: a count, or Fold.ALL.
    choose(logits, draw_position): picks a token per readout row (argmax, a sampler) on the
    compute thread, right after the model call, before the caller is woken (PassOutput.tokens);
    draw_position: the absolute position of the last readout row (Pass.draw_position).
    """

    ws: WorkingSet
    tokens: list[int] | torch.Tensor
    readout: list[int]
    fold: int | Fold = Fold.ALL
    hidden: bool = False
    # layers whose inputs (the residual stream entering each; num_layers: `hidden`) the readout rows
    # also return, side by side (PassOutput.features): an EAGLE-3 head's fused features
    features: tuple[int, ...] = ()
    logits: bool = True  # False: the readout rows' hidden states only (no lm_head: a head's prompt pass)
    spare: int = 0  # rows past the window whose pages are prepared too (a draft head's chain)
    choose: Callable[[torch.Tensor, int], list[int]] | None = None
    window: int = field(init=False)  # len(tokens), read many times a step (a tensor's len is slow)

    def __post_init__(self):
        self.window = len(self.tokens)

    def draw_position(self, first: int) -> int:
        """Where the pass's random draws are keyed (its window starting at `first`): the position of
        its last readout row, the row whose token a one-row readout draws."""
        return first + (self.readout[-1] if self.readout else self.window - 1)


def check_shape(window: int, readout: list[int] | None, fold: int | Fold) -> None:
    """The rules of a pass's shape, for a pass (Engine.check_pass) and a device loop's window
    (DeviceLoop): at least one row, readout rows inside the window (None: every row), and a
    constant fold of at most the window."""
    if window < 1:
        raise InvalidArgument("a pass needs a window of at least one row")
    bad_rows = [r for r in readout or () if not 0 <= r < window]
    if bad_rows:
        raise InvalidArgument(f"readout row {bad_rows[0]} is outside the window of {window} rows")
    if not isinstance(fold, Fold) and not 0 <= fold <= window:
        raise InvalidArgument(f"fold {fold} is outside 0..{window} (the window length)")


@dataclass
class PassOutput:
    logits: torch.Tensor | None  # [len(readout), vocab] float32; None for a pass with logits=False
    # [len(readout), hidden_size] f32, the last layer's output before the final norm; with EAGLE-3
    # heads attached, the inputs of their layers side by side (Engine.head_layers)
    hidden: torch.Tensor | None = None
    tokens: list[int] | None = None  # the pass's `choose` applied to the logits
    features: torch.Tensor | None = None  # [len(readout), len(features) * hidden_size] f32 (Pass.features)


@dataclass
class Batch:
    passes: list[Pass]
    first_positions: list[int]
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    meta: attention.BatchMeta
    readout_index: torch.Tensor
    readout_splits: list[int]


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 (or float16) on CUDA; float32 on the CPU, even one with native bf16.

    In bf16 a matrix product's rounding depends on how many rows it has, so a pass that verifies
    k drafted rows at once can flip a near-tie that one-row decoding resolves the other way: on
    a bf16-native CPU, greedy cacheback, ngram-proposer and HF's own prompt lookup each differed
    from greedy decoding, and the same runs in float32 were identical and faster for the default
    model (text-completion 25.2 against 21.8 tok/s, `python -m bench.spec --ids 81,111,242
    --dtype float32` against `--dtype bfloat16`)."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidArgument("--device cuda asked for, but torch sees no CUDA device; use --device cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return default_dtype(device)
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise InvalidArgument(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return table[dtype]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on the CPU an anonymous mapping, whose pages the OS zeroes as they are
    first written, so a KV pool sized for many clients costs memory as it fills (torch.zeros writes
    every page: 2,048 pages of the default model were 1.5 GB resident before the first token).
    Not numpy's zeros: it advises huge pages, and each 4 KiB KV page touched would make 2 MiB resident."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    with warnings.catch_warnings():  # the mapping is writable; torch warns for any buffer it wraps
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)[:nbytes].view(dtype).view(shape)


class Engine:
    def __init__(self, model, tokenizer, *, name: str = "model", kv_pages: int = 2048, page_size: int = 16,
                 context_len: int | None = None, heads: dict | None = None, prefix_caching: bool | None = None,
                 suffix_tokens: int = SUFFIX_TOKENS):
        """heads: draft heads by name (host/drafter MtpHead), each given one more KV layer.
        prefix_caching: reuse cached prompt blocks (prefix_cache.py); None: where a row's result
        does not depend on the rows computed beside it (see `rows_independent`).
        suffix_tokens: the tokens the suffix index of released texts holds (suffix_index.py), over
        every namespace; 0: none kept (suffix_draft drafts nothing)."""
        attention.register()
        self.model = model.eval()
        self.model.config._attn_implementation = attention.NAME
        self.tokenizer = tokenizer
        cfg = model.config
        self.device = next(model.parameters()).device
        self.device_type = self.device.type  # read per round: a torch.device's type is a torch call
        self.dtype = next(model.parameters()).dtype
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.pool = PagePool(kv_pages, page_size)
        heads = dict(heads or {})
        self.kv = _zeros((cfg.num_hidden_layers + len(heads), 2, cfg.num_key_value_heads, kv_pages * page_size, head_dim),
                         self.dtype, self.device)
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos = eos if eos is not None else tokenizer.eos_token_id
        eos_ids = sorted({eos} if isinstance(eos, int) else set(eos or []))
        self.info = ModelInfo(
            name=name, architecture=type(model).__name__, vocab_size=model.get_output_embeddings().out_features,
            eos_ids=eos_ids, context_len=context_len or getattr(cfg, "max_position_embeddings", 2048),
            hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers, dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device), drafters=list(heads),
        )
        self._decoder = model.get_decoder()
        self._lm_head = Readout(model.get_output_embeddings())
        self.linears = PackedLinears(self._decoder)
        # short windows' attention reads the paged pool in place (kernels.py) on CPU float32; None
        # runs SDPA over gathered contexts, the other devices' path (tests and benchmarks compare)
        cpu32 = self.device_type == "cpu" and self.dtype == torch.float32
        self.attention_kernel = kernels.paged_attention() if cpu32 and head_dim % 16 == 0 else None
        # the layers without transformers' per-layer Python, where the architecture allows (stack.py),
        # their loop in C++ where the kernels are; None runs transformers' forward (a baseline may)
        self.stack = LayerStack.of(model, self.linears, kernels.layer_stack() if self.attention_kernel else None,
                                   kernels.row_ops() if cpu32 else None)
        # the readout's hidden state is the last layer's output before the final norm (what MTP
        # heads take): on transformers' path, kept from the norm's input
        self._prenorm: torch.Tensor | None = None
        self._decoder.norm.register_forward_pre_hook(self._keep_prenorm)
        from .drafting import HeadRunner  # here: a model without heads never loads it

        # what the readout's hidden state is: the last layer's output (MTP heads), or the inputs of an
        # EAGLE-3 head's layers side by side; one readout for every head of the model
        layer_sets = {tuple(getattr(h, "layers", ())) for h in heads.values()}
        if len(layer_sets) > 1:
            raise ValueError(f"a model's draft heads share one hidden readout; these read layers {sorted(layer_sets)}")
        self.head_layers: tuple[int, ...] = next(iter(layer_sets), ())

        self.heads = {n: HeadRunner(self, n, h.to(self.device, self.dtype), cfg.num_hidden_layers + i)
                      for i, (n, h) in enumerate(heads.items())}
        self._softcap = getattr(cfg, "final_logit_softcapping", None)
        # A cached row is exact only where a row's KV and logits are the same bits whatever else its
        # pass computes: the engine's own products and the paged kernel (CPU float32). Elsewhere
        # (SDPA, bf16 products) a prompt computed in two parts can round otherwise than in one.
        self.rows_independent = self.attention_kernel is not None and self.stack is not None
        if prefix_caching is None:
            prefix_caching = self.rows_independent
        self.prefix = PrefixCache(self.pool) if prefix_caching else None
        self.suffix = SuffixStore(suffix_tokens) if suffix_tokens > 0 else None
        self._ids = itertools.count(1)
        self.lock = threading.RLock()  # bookkeeping is shared by every inferlet thread
        self.model_time_s = 0.0
        # host ids of a CPU batch go through one reused buffer (see _Staging)
        self._staging = _Staging() if self.device_type == "cpu" else None

    def _keep_prenorm(self, module, args) -> None:
        self._prenorm = args[0]

    def check_drafters(self, names) -> None:
        """Raise unless the model has a draft head of each name (an epilogue's drafter ops)."""
        missing = [n for n in names if n not in self.heads]
        if missing:
            have = ", ".join(self.heads) or "none is attached"
            raise InvalidArgument(f"the epilogue uses drafter {missing[0]!r}, which the model does not have ({have}; "
                                  "attach one with `pie model import MODEL --drafter NAME`)")

    def bind_drafters(self, names, ws: WorkingSet) -> dict:
        """Env.drafters for a working set's passes: each named head bound to it."""
        self.check_drafters(names)
        return {n: self.heads[n].bind(ws) for n in names}

    # ---- working sets -------------------------------------------------------------
    def new_working_set(self, quota: Quota | None = None, scores=None, namespace: str = "",
                        prefix_caching: bool = True) -> WorkingSet:
        """quota: the pages its instance may hold (PagePool.quota); None: the whole pool.
        scores: a logprobs.RowScores to keep its rows for its run's logprobs; None: none kept.
        namespace: where its blocks are cached and looked up, and its text indexed for drafts (an
        API key's); prefix_caching: False to neither use nor list them, nor draft from nor join
        the suffix index."""
        with self.lock:
            return WorkingSet(next(self._ids), self.pool, quota=quota, scores=scores, namespace=namespace,
                              cacheable=prefix_caching, indexed=prefix_caching)

    def suffix_source(self, ws: WorkingSet):
        """The suffix index a pass over `ws` drafts from (Env.suffix), or None."""
        return self.suffix.index(ws.namespace) if self.suffix is not None and ws.indexed else None

    def fork(self, ws: WorkingSet) -> WorkingSet:
        with self.lock:
            ws.check_alive()
            return ws.fork(next(self._ids))

    def release(self, ws: WorkingSet) -> None:
        """Free its pages; its text joins its namespace's suffix index (outside the engine's lock:
        listing a long text takes milliseconds)."""
        with self.lock:
            text = ws.tokens if self.suffix is not None and ws.indexed and not ws.released else None
            ws.release()
        if text:
            self.suffix.index(ws.namespace).insert(text)

    def truncate(self, ws: WorkingSet, n: int) -> None:
        with self.lock:
            ws.check_alive()
            ws.truncate(n)

    def commit(self, ws: WorkingSet, n: int) -> None:
        """Freeze n scratch rows of the last pass (WorkingSet.commit)."""
        with self.lock:
            ws.check_alive()
            ws.commit(n)
            if self.prefix is not None:
                self.prefix.publish(ws)

    @on_compute_thread  # it copies KV rows: torch work
    def evict(self, ws: WorkingSet, start: int, end: int) -> None:
        with self.lock:
            ws.check_alive()
            copies = ws.evict(start, end)
            if copies:
                src, dst = zip(*copies)
                self._copy_slots(list(src), list(dst))

    def _copy_slots(self, src: list[int], dst: list[int]) -> None:
        s = torch.tensor(src, device=self.device)
        d = torch.tensor(dst, device=self.device)
        self.kv[:, :, :, d] = self.kv[:, :, :, s]

    def _copy_pages(self, copies: list[tuple[int, int]]) -> None:
        p = self.pool.page_size
        src = [s * p + i for s, _ in copies for i in range(p)]
        dst = [d * p + i for _, d in copies for i in range(p)]
        self._copy_slots(src, dst)

    # ---- validation -----------------------------------------------------------------
    def check_ids(self, tokens: list[int]) -> None:
        bad = [t for t in tokens if not 0 <= t < self.info.vocab_size]
        if bad:
            raise InvalidArgument(f"token id {bad[0]} is outside the vocabulary [0, {self.info.vocab_size})")

    def check_pass(self, ps: Pass) -> None:
        """Raise a PieError if the pass cannot run; changes nothing."""
        ps.ws.check_alive()
        w = ps.window
        if ps.ws.frozen + w > self.info.context_len:
            raise ContextOverflow(
                f"window of {w} rows at frozen length {ps.ws.frozen} exceeds the model's context of "
                f"{self.info.context_len} rows; truncate or evict rows first")
        if isinstance(ps.tokens, list):
            self.check_ids(ps.tokens)
        check_shape(w, ps.readout, ps.fold)
        if any(not 0 <= c <= self.info.num_layers for c in ps.features):
            raise InvalidArgument(f"feature layers must be in 0..{self.info.num_layers}, not {list(ps.features)}")

    # ---- the step -------------------------------------------------------------------
    @on_compute_thread
    def forward(self, passes: list[Pass]) -> list[PassOutput | PieError]:
        """Run passes with known folds in one model call; a failing pass gets its error, the rest run.
        Runs on the compute thread (compute.py); the caller must not hold `self.lock`."""
        results: list[PassOutput | PieError | None] = [None] * len(passes)
        with self.lock:
            batch, ok = self.prepare(passes, results)
            if batch is None:
                return results  # type: ignore[return-value]
            outs = self.run(batch)
            for i, first, out in zip(ok, batch.first_positions, outs):
                self.apply_known_fold(passes[i], first)
                results[i] = out
        return results  # type: ignore[return-value]

    @staticmethod
    def _host_tokens(tokens) -> list[int]:
        return tokens if isinstance(tokens, list) else tokens.tolist()

    def prepare(self, passes: list[Pass], errors: list) -> tuple[Batch | None, list[int]]:
        """Validate and place each pass; failures are written into `errors` by index."""
        seen: set[int] = set()
        ok = []
        copies = []
        for i, ps in enumerate(passes):
            try:
                if ps.ws.attached and ps.ws.id not in seen:  # attached for a pass that never ran
                    self._detach(ps.ws)
                self.check_pass(ps)
                if ps.ws.id in seen:
                    raise InvalidArgument(f"working set {ps.ws.id} has two passes in one batch")
                spare = min(ps.spare, self.info.context_len - ps.ws.frozen - ps.window)
                self._attach(ps)
                try:
                    copies += ps.ws.prepare_write(ps.window - ps.ws.attached + max(spare, 0))
                except PieError:
                    self._detach(ps.ws)
                    raise
                seen.add(ps.ws.id)
                ok.append(i)
            except PieError as e:
                errors[i] = e
        if copies:
            self._copy_pages(copies)
        if not ok:
            return None, ok
        return self._build([passes[i] for i in ok]), ok

    def _attach(self, ps: Pass) -> None:
        """A pass over an empty working set takes the cached pages of its window's leading blocks
        (prefix_cache.py); every readout row, and at least the last row, is still computed."""
        ws = ps.ws
        if self.prefix is None or ws.frozen or ws.pages or not ws.cacheable:
            return
        if isinstance(ps.tokens, list):
            tokens = ps.tokens
        elif self.device_type == "cpu":
            tokens = ps.tokens.tolist()
        else:
            return
        self.prefix.attach(ws, tokens, min(min(ps.readout, default=ps.window), ps.window - 1))

    def _detach(self, ws: WorkingSet) -> None:
        """Undo an attach whose pass did not run: the empty working set lets its pages go."""
        ws.cached_tokens -= ws.attached
        self.pool.release(ws.pages)
        ws.pages, ws.chain, ws.attached = [], [], 0

    @staticmethod
    def _computed(ps: Pass) -> tuple[int, int]:
        """The rows of the pass the model computes (its window less the rows attached from the
        prefix cache) and the context before them."""
        a = ps.ws.attached
        return ps.window - a, ps.ws.frozen + a

    def _build(self, passes: list[Pass]) -> Batch:
        dev = self.device
        firsts = [ps.ws.next_position for ps in passes]
        pos, slots, readout, splits = [], [], [], []
        offset = 0
        for ps, first in zip(passes, firsts):
            a = ps.ws.attached
            w, f = self._computed(ps)
            pos.extend(range(first + a, first + a + w))
            slots.extend(ps.ws.slots(f, f + w))
            readout.extend(offset + r - a for r in ps.readout)
            splits.append(len(ps.readout))
            offset += w
        n, t = len(readout), len(pos)
        if self._staging is not None and all(isinstance(ps.tokens, list) for ps in passes):
            input_ids, positions, slot_map, rows = self._staging.write(
                [x for ps in passes for x in ps.tokens[ps.ws.attached:]] + pos + slots + readout, t, n)
        else:
            tok = [torch.tensor(ps.tokens[ps.ws.attached:], dtype=torch.long, device=dev) if isinstance(ps.tokens, list)
                   else ps.tokens[ps.ws.attached:] if ps.tokens.dtype == torch.long and ps.tokens.device == dev
                   else ps.tokens[ps.ws.attached:].to(dev, torch.long) for ps in passes]
            # Ids on the device are checked on the host after the pass (the scheduler, from the
            # readback): until then none may index outside the embedding, where CUDA would fail
            # the whole device context instead of this one pass.
            input_ids = (torch.cat(tok) if len(tok) > 1 else tok[0]).clamp(0, self.info.vocab_size - 1)
            idx = torch.tensor(pos + slots + readout, device=dev)  # one host->device copy
            positions, slot_map, rows = idx[:t], idx[t:2 * t], idx[2 * t:2 * t + n]
        meta = attention.BatchMeta(self.kv, slot_map, self._groups(passes), self.attention_kernel)
        return Batch(passes, firsts, input_ids, positions, meta, rows, splits)

    def _groups(self, passes: list[Pass]) -> list[attention.Group]:
        rows = [self._computed(ps) for ps in passes]  # (window, context before it)
        starts = list(itertools.accumulate((w for w, _ in rows), initial=0))[:-1]
        if len(passes) == 1 or self.attention_kernel is not None:  # a lone pass, or the kernel's ragged batch
            return [self._group(passes, rows, list(range(len(passes))), starts, True)]
        small = [i for i, (w, _) in enumerate(rows) if w <= attention.SMALL_WINDOW]
        sets = ([small] if small else []) + [[i] for i, (w, _) in enumerate(rows) if w > attention.SMALL_WINDOW]
        return [self._group(passes, rows, idx, [starts[i] for i in idx], len(sets) == 1) for idx in sets]

    def _group(self, passes: list[Pass], rows: list[tuple[int, int]], idx: list[int], starts: list[int],
               whole: bool) -> attention.Group:
        ends = [rows[i][1] + rows[i][0] for i in idx]  # each pass's context length
        return attention.make_group(self.device, starts, [rows[i][0] for i in idx], [rows[i][1] for i in idx], ends,
                                    [passes[i].ws for i in idx], whole, self.attention_kernel is not None)

    def run(self, batch: Batch) -> list[PassOutput]:
        if not torch.is_inference_mode_enabled():  # the scheduler's steps run in it already
            with torch.inference_mode():
                return self.run(batch)
        t0 = time.perf_counter()
        wants_hidden = any(ps.hidden for ps in batch.passes)
        capture = sorted({c for ps in batch.passes for c in ps.features} | set(self.head_layers if wants_hidden else ()))
        prenorm, last, captured = self._layers(batch, capture)
        want = [ps.logits for ps in batch.passes]
        rows = batch.readout_index
        if not all(want):  # the lm_head only over the rows of passes that read logits
            keep = [r for ps, idx in zip(batch.passes, self._row_ranges(batch)) if ps.logits for r in idx]
            rows = rows[torch.tensor(keep, dtype=torch.long, device=rows.device)] if keep else None
        logits = None
        if rows is not None:
            logits = self._lm_head(last.index_select(0, rows)).float()
            if self._softcap:
                logits = torch.tanh(logits / self._softcap) * self._softcap
        # the captured layers' readout rows, selected once for the heads' hidden and the passes' features
        picked = [c.index_select(0, batch.readout_index).float() for c in captured]
        hidden = None
        if wants_hidden:
            hidden = (torch.cat([picked[capture.index(c)] for c in self.head_layers], -1) if self.head_layers
                      else prenorm.index_select(0, batch.readout_index).float())
        self.model_time_s += time.perf_counter() - t0
        if len(batch.passes) == 1:  # nothing to split (each torch op costs ~10 us after a model call)
            outs = [PassOutput(logits, hidden if batch.passes[0].hidden else None)]
        else:
            splits = batch.readout_splits
            lgs = iter(logits.split([n for n, w in zip(splits, want) if w]) if logits is not None else ())
            hiddens = hidden.split(splits) if hidden is not None else [None] * len(splits)
            outs = [PassOutput(next(lgs) if ps.logits else None, hd if ps.hidden else None)
                    for ps, hd in zip(batch.passes, hiddens)]
        if any(ps.features for ps in batch.passes):
            self._features(batch, outs, capture, picked)
        for ps, first, out in zip(batch.passes, batch.first_positions, outs):
            if ps.ws.scores is not None and out.logits is not None:  # its run reports logprobs
                ps.ws.scores.record(first, ps.readout, out.logits)
        return outs

    def _layers(self, batch: Batch, capture: list[int] = ()) -> tuple[torch.Tensor, torch.Tensor, list]:
        """The batch through the decoder: the last layer's output before and after the final norm,
        and the inputs of the `capture` layers ([T, hidden] each; LayerStack.run)."""
        with self.linears.active():
            if self.stack is not None:
                return self.stack(batch.input_ids, batch.position_ids, batch.meta, tuple(capture))
            out = self._decoder(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None],
                                use_cache=False, pie_batch=batch.meta, output_hidden_states=bool(capture))
        prenorm, self._prenorm = self._prenorm, None
        # hidden_states[i] is layer i's input for i < layers (the last one is after the final norm)
        captured = [prenorm[0] if c == self.info.num_layers else out.hidden_states[c][0] for c in capture]
        return prenorm[0], out.last_hidden_state[0], captured

    def _features(self, batch: Batch, outs: list[PassOutput], capture: list[int], picked: list) -> None:
        """Each pass's PassOutput.features: its readout rows (`picked`, per captured layer) of its
        layers' inputs, side by side."""
        parts = [r.split(batch.readout_splits) for r in picked]
        for b, (ps, out) in enumerate(zip(batch.passes, outs)):
            if ps.features:
                out.features = torch.cat([parts[capture.index(c)][b] for c in ps.features], -1)

    @staticmethod
    def _row_ranges(batch: Batch) -> list[range]:
        """Each pass's positions in the batch's readout rows."""
        out, at = [], 0
        for n in batch.readout_splits:
            out.append(range(at, at + n))
            at += n
        return out

    def apply_fold(self, ps: Pass, first_position: int, fold: int, tokens: list[int]) -> None:
        ps.ws.apply_fold(tokens, fold, first_position)
        if self.prefix is not None:
            self.prefix.publish(ps.ws)

    def apply_known_fold(self, ps: Pass, first_position: int) -> None:
        """Apply the fold of a pass whose fold was given up front."""
        fold = ps.window if ps.fold is Fold.ALL else ps.fold
        self.apply_fold(ps, first_position, fold, self._host_tokens(ps.tokens))


class _Staging:
    """A CPU batch's ids, positions, slots and readout rows, written into one reused host buffer
    that the batch's tensors view. Made fresh per batch, those tensors cost more than the rest
    of the batch's build right after a model call (torch's tensor creation runs cold, its code
    evicted by the model's weights), and a decode round makes the same shapes every time.
    The views are valid until the next batch is built: the engine runs each batch before it
    prepares the next (both under its lock, on the compute thread)."""

    MAX_SHAPES = 64  # (rows, readout) shapes whose views are kept

    def __init__(self):
        self._buf = np.zeros(64, dtype=np.int64)
        self._views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def write(self, values: list[int], t: int, n: int) -> tuple[torch.Tensor, ...]:
        """values: t ids, t positions, t slots, n rows, in that order (len 3t + n)."""
        views = self._views.get((t, n))
        if views is None:
            if len(values) > self._buf.shape[0]:  # views of the old buffer stay valid for their batch
                self._buf = np.zeros(max(len(values), 2 * self._buf.shape[0]), dtype=np.int64)
                self._views.clear()
            if len(self._views) >= self.MAX_SHAPES:
                self._views.clear()
            b = self._buf
            views = self._views[(t, n)] = tuple(torch.from_numpy(b[i:j]) for i, j in (
                (0, t), (t, 2 * t), (2 * t, 3 * t), (3 * t, 3 * t + n)))
        self._buf[:len(values)] = values
        return views
