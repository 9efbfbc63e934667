"""Trace an epilogue written as ordinary Python into the host's program IR (JSON).

Pure Python: runs inside the componentize-py component (no numpy, no host imports).
Values are symbolic; operators record ops. The host validates and compiles the
result (see wit/epilogue-ir.md); checks here only catch mistakes early.

    p = Program(window=5)
    logits = p.logits()                       # [R, V] f32
    tok = logits.argmax()                     # [R] i64
    p.put("out", tok[-1:])
    p.set("window", tok[-1:])
    p.fold(p.const(1))
    p.stop_if((tok[-1] == eos) | (p.round() >= limit))
    text = p.to_json()

A window that changes size per round, with readout on every row: Program(readout="window")
declares R == W, so verify_greedy(p.window()[1:], p.logits().argmax()) type-checks.
"""

import json

VERSION = 1
_DTYPES = ("i64", "f32", "bool")


class TraceError(Exception):
    """A mistake found while tracing (the host would reject the program too)."""


class Value:
    """A symbolic tensor: an SSA value of the program being traced."""

    __slots__ = ("prog", "id", "dtype")
    __hash__ = object.__hash__

    def __init__(self, prog, vid, dtype):
        self.prog, self.id, self.dtype = prog, vid, dtype

    def __repr__(self):
        return "Value(%d, %s)" % (self.id, self.dtype)

    def __bool__(self):
        raise TraceError("a traced value has no Python truth value; use p.where(...), &, |, ~ instead of if/and/or/not")

    # arithmetic
    def __add__(self, o): return self.prog._bin("add", self, o)
    def __radd__(self, o): return self.prog._bin("add", o, self)
    def __sub__(self, o): return self.prog._bin("sub", self, o)
    def __rsub__(self, o): return self.prog._bin("sub", o, self)
    def __mul__(self, o): return self.prog._bin("mul", self, o)
    def __rmul__(self, o): return self.prog._bin("mul", o, self)
    def __truediv__(self, o): return self.prog._bin("div", self, o)
    def __rtruediv__(self, o): return self.prog._bin("div", o, self)
    def __floordiv__(self, o): return self.prog._bin("floordiv", self, o)
    def __mod__(self, o): return self.prog._bin("mod", self, o)
    def __neg__(self): return self.prog._op("neg", [self], {}, self.dtype)
    def __abs__(self): return self.prog._op("abs", [self], {}, self.dtype)
    # comparisons
    def __eq__(self, o): return self.prog._bin("eq", self, o)
    def __ne__(self, o): return self.prog._bin("ne", self, o)
    def __lt__(self, o): return self.prog._bin("lt", self, o)
    def __le__(self, o): return self.prog._bin("le", self, o)
    def __gt__(self, o): return self.prog._bin("gt", self, o)
    def __ge__(self, o): return self.prog._bin("ge", self, o)
    # logic (bool values)
    def __and__(self, o): return self.prog._bin("and", self, o)
    def __rand__(self, o): return self.prog._bin("and", o, self)
    def __or__(self, o): return self.prog._bin("or", self, o)
    def __ror__(self, o): return self.prog._bin("or", o, self)
    def __xor__(self, o): return self.prog._bin("xor", self, o)
    def __invert__(self): return self.prog._op("not", [self], {}, "bool")

    # indexing: ints, static slices, tuples of them, or an i64 value (take along axis 0)
    def __getitem__(self, key):
        if isinstance(key, Value):
            return self.prog.take(self, key)
        keys = key if isinstance(key, tuple) else (key,)
        out, axis = self, 0
        for k in keys:
            if isinstance(k, bool) or not isinstance(k, (int, slice)):
                raise TraceError("index with ints, slices or an i64 value, got %r" % (k,))
            if isinstance(k, int):
                out = out.prog._op("index", [out], {"i": k, "axis": axis}, out.dtype)
            else:
                if k.step not in (None, 1):
                    raise TraceError("slices with a step are not supported")
                if not (k.start is None and k.stop is None):
                    out = out.prog._op("slice", [out], {"start": k.start, "stop": k.stop, "axis": axis}, out.dtype)
                axis += 1
        return out

    # reductions and scans
    def _red(self, name, axis, dtype):
        return self.prog._op(name, [self], {"axis": axis}, dtype)

    def argmax(self, axis=-1): return self._red("argmax", axis, "i64")
    def argmin(self, axis=-1): return self._red("argmin", axis, "i64")
    def sum(self, axis=-1): return self._red("sum", axis, "i64" if self.dtype == "bool" else self.dtype)
    def prod(self, axis=-1): return self._red("prod", axis, self.dtype)
    def min(self, axis=-1): return self._red("min", axis, self.dtype)
    def max(self, axis=-1): return self._red("max", axis, self.dtype)
    def any(self, axis=-1): return self._red("any", axis, "bool")
    def all(self, axis=-1): return self._red("all", axis, "bool")
    def cumsum(self, axis=-1): return self._red("cumsum", axis, "i64" if self.dtype == "bool" else self.dtype)
    def cumprod(self, axis=-1): return self._red("cumprod", axis, "i64" if self.dtype == "bool" else self.dtype)

    def size(self, axis=0):
        """The (host-known) length of an axis, as an i64 scalar value."""
        return self.prog._op("size", [self], {"axis": axis}, "i64")

    def cast(self, dtype): return self.prog.cast(self, dtype)
    def exp(self): return self.prog._op("exp", [self], {}, "f32")
    def log(self): return self.prog._op("log", [self], {}, "f32")
    def softmax(self, temperature=1.0, axis=-1):
        return self.prog._op("softmax", [self], {"temperature": float(temperature), "axis": axis}, "f32")
    def top_k(self, k): return self.prog._op("top_k", [self], {"k": int(k)}, "f32")
    def top_p(self, p): return self.prog._op("top_p", [self], {"p": float(p)}, "f32")
    def min_p(self, p): return self.prog._op("min_p", [self], {"p": float(p)}, "f32")


_DIM_NAMES = {"window": "W", "readout": "R", "vocab": "V", "hidden": "H", "history": "N", "draft_depth": "K"}


class Program:
    """An epilogue being traced. dims fix symbolic sizes (window=W, readout=R, vocab=V) to
    ints, or declare one equal to another by name: Program(readout="window") is readout on
    every row of a window whose size the host binds per round (R == W)."""

    def __init__(self, window=None, readout=None, vocab=None, hidden=None, history=None, draft_depth=None):
        self._dims = {}
        for name, v in (("window", window), ("readout", readout), ("vocab", vocab), ("hidden", hidden),
                        ("history", history), ("draft_depth", draft_depth)):
            if v is None:
                continue
            if isinstance(v, str):
                if v not in _DIM_NAMES or v == name:
                    raise TraceError("%s=%r: name another dim (%s)" % (name, v, ", ".join(sorted(_DIM_NAMES))))
                self._dims[_DIM_NAMES[name]] = _DIM_NAMES[v]
            else:
                self._dims[_DIM_NAMES[name]] = int(v)
        self._channels = {}
        self._matchers = []
        self._inputs = []
        self._input_ids = {}
        self._ops = []
        self._n = 0
        self._where = []  # internal value id -> ("in", input index) or ("op", result index)
        self._n_results = 0
        self._effects = set()

    # --- plumbing ----------------------------------------------------------
    def _input(self, kind, dtype, name=None):
        key = (kind, name)
        if key in self._input_ids:
            return self._input_ids[key]
        entry = {"kind": kind}
        if name is not None:
            entry["name"] = name
        self._inputs.append(entry)
        v = Value(self, self._n, dtype)
        self._n += 1
        self._where.append(("in", len(self._inputs) - 1))
        self._input_ids[key] = v
        return v

    def _op(self, name, args, attrs, dtype, nres=1):
        ids = []
        for a in args:
            if not isinstance(a, Value) or a.prog is not self:
                raise TraceError("%s: argument %r is not a value of this program" % (name, a))
            ids.append(a.id)
        self._ops.append({"op": name, "args": ids, "attrs": attrs})
        dts = dtype if isinstance(dtype, (list, tuple)) else [dtype] * nres
        outs = []
        for dt in dts[:nres]:
            outs.append(Value(self, self._n, dt))
            self._n += 1
            self._where.append(("op", self._n_results))
            self._n_results += 1
        return outs[0] if nres == 1 else (tuple(outs) if nres else None)

    def _lift(self, x, like):
        if isinstance(x, Value):
            return x
        if isinstance(x, bool):
            return self.const(x)
        if isinstance(x, int):
            return self.const(x, "f32" if like == "f32" else "i64")
        if isinstance(x, float):
            if like == "i64":
                raise TraceError("mixing an i64 value with float %r: cast the value first" % x)
            return self.const(x, "f32")
        raise TraceError("cannot use %r in a traced expression" % (x,))

    def _bin(self, name, a, b):
        like = a.dtype if isinstance(a, Value) else (b.dtype if isinstance(b, Value) else None)
        a, b = self._lift(a, like), self._lift(b, like)
        if a.dtype != b.dtype:
            raise TraceError("%s: dtypes %s and %s differ; cast one" % (name, a.dtype, b.dtype))
        if name in ("eq", "ne", "lt", "le", "gt", "ge", "and", "or", "xor"):
            return self._op(name, [a, b], {}, "bool")
        return self._op(name, [a, b], {}, a.dtype)

    # --- inputs ------------------------------------------------------------
    def logits(self):
        """Readout logits [R, V] f32."""
        return self._input("logits", "f32")

    def hidden(self):
        """Readout hidden state [R, H] f32."""
        return self._input("hidden", "f32")

    def draft_logits(self):
        """Draft-head logits [R, K, V] f32 (models imported with a drafter)."""
        return self._input("draft_logits", "f32")

    def window(self):
        """This round's window tokens [W] i64."""
        return self._input("window", "i64")

    def history(self):
        """The working set's committed tokens [N] i64."""
        return self._input("history", "i64")

    def round(self):
        """The round index (0 for the first pass), i64 scalar."""
        return self._input("round", "i64")

    def channel(self, name, dtype="i64", capacity=1):
        """Declare a channel the epilogue reads or writes."""
        if dtype not in _DTYPES:
            raise TraceError("channel dtype must be one of %s" % (_DTYPES,))
        old = self._channels.get(name)
        if old is not None and (old["dtype"], old["capacity"]) != (dtype, int(capacity)):
            raise TraceError("channel %r declared twice with different types" % name)
        self._channels[name] = {"name": name, "dtype": dtype, "capacity": int(capacity)}
        return name

    def read(self, name):
        """A declared channel's whole buffer [capacity]."""
        return self._input("channel", self._chan(name)["dtype"], name)

    def length(self, name):
        """A declared channel's current length, i64 scalar."""
        self._chan(name)
        return self._input("channel_len", "i64", name)

    def matcher(self, name):
        """Declare a grammar matcher the epilogue uses (bound with grammars.bind-matcher)."""
        if name not in self._matchers:
            self._matchers.append(name)
        return name

    def _chan(self, name):
        if name not in self._channels:
            raise TraceError("unknown channel %r: declare it with p.channel(name, dtype, capacity)" % name)
        return self._channels[name]

    # --- constructors ------------------------------------------------------
    def const(self, value, dtype=None):
        flat = value if isinstance(value, (list, tuple)) else [value]
        if dtype is None:
            dtype = ("bool" if all(isinstance(x, bool) for x in flat)
                     else "f32" if any(isinstance(x, float) for x in flat) else "i64")
        if dtype == "f32":
            flat = [float(x) for x in flat]
        v = list(flat) if isinstance(value, (list, tuple)) else flat[0]
        return self._op("const", [], {"value": v, "dtype": dtype}, dtype)

    def full(self, shape, value, dtype):
        return self._op("full", [], {"shape": list(shape), "value": value, "dtype": dtype}, dtype)

    def arange(self, n, start=0):
        return self._op("arange", [], {"n": n, "start": start}, "i64")

    def rand(self, shape, seed=0):
        return self._op("rand", [], {"shape": list(shape), "seed": _op_seed(seed)}, "f32")

    # --- functions ---------------------------------------------------------
    def cast(self, x, dtype):
        return self._op("cast", [x], {"dtype": dtype}, dtype)

    def where(self, cond, a, b):
        like = a.dtype if isinstance(a, Value) else (b.dtype if isinstance(b, Value) else None)
        a, b = self._lift(a, like), self._lift(b, like)
        return self._op("where", [self._lift(cond, "bool"), a, b], {}, a.dtype)

    def minimum(self, a, b): return self._bin("minimum", a, b)
    def maximum(self, a, b): return self._bin("maximum", a, b)

    def take(self, x, idx, fill=None):
        """x[idx] along axis 0; out-of-range indices (e.g. -1 padding) give fill."""
        return self._op("take", [x, idx], {} if fill is None else {"fill": fill}, x.dtype)

    def gather(self, x, idx, fill=None):
        """Along the last axis: out[..., j] = x[..., idx[..., j]]."""
        return self._op("gather", [x, idx], {} if fill is None else {"fill": fill}, x.dtype)

    def scatter_add(self, x, idx, val):
        """x with val[j] added at idx[j] of the last axis, in every row."""
        return self._op("scatter_add", [x, idx, val], {}, "f32")

    def biased(self, logits, bias=None):
        """logits with a logit bias ({token id: value}) added, the one sampling rule's first step
        (it applies to greedy choice too); unchanged without one."""
        if not bias:
            return logits
        ids = sorted(bias)
        return self.scatter_add(logits, self.const([int(i) for i in ids], "i64"),
                                self.const([float(bias[i]) for i in ids], "f32"))

    def penalized(self, logits, penalties=None):
        """logits [R, V] with penalties (an args.Penalties) applied, the one sampling rule's step after
        the bias; unchanged without any. The readout rows are the window's last R rows (every row, or
        the last one): row r counts the history, then the window up to its row."""
        if penalties is None or not penalties.active:
            return logits
        return self._op("penalize", [logits, self.history(), self.window()],
                        {"start": int(penalties.output_start), "presence": float(penalties.presence),
                         "frequency": float(penalties.frequency), "repetition": float(penalties.repetition)}, "f32")

    def concat(self, a, b, axis=0):
        return self._op("concat", [a, b], {"axis": axis}, a.dtype)

    def pack(self, a, a_len, b, b_len, size, fill=None):
        """a[:a_len] followed by b[:b_len] in a [size] vector, padded with fill (-1)."""
        attrs = {"size": size}
        if fill is not None:
            attrs["fill"] = fill
        return self._op("pack", [a, self._lift(a_len, "i64"), b, self._lift(b_len, "i64")], attrs, a.dtype)

    def dyn_slice(self, x, start, length, size, fill=None):
        """x[start:start+length] in a [size] vector, padded with fill (-1)."""
        attrs = {"size": size}
        if fill is not None:
            attrs["fill"] = fill
        return self._op("dyn_slice", [x, self._lift(start, "i64"), self._lift(length, "i64")], attrs, x.dtype)

    def softmax(self, x, temperature=1.0, axis=-1):
        return x.softmax(temperature, axis)

    def filtered(self, logits, temperature=1.0, top_k=None, top_p=None, min_p=None):
        """The one sampling rule's distribution as logits (host/epilogue/ops/sampling.py
        filter_logits): temperature > 0, then top-k, min-p and top-p, each off when None (or
        0, 0, 1); its softmax is what a token is drawn from."""
        x = logits if temperature == 1.0 else logits / float(temperature)
        if top_k:
            x = x.top_k(top_k)
        if min_p:
            x = x.min_p(min_p)
        if top_p is not None and top_p < 1.0:
            x = x.top_p(top_p)
        return x

    def sample(self, logits, temperature=1.0, top_k=None, top_p=None, seed=0, min_p=None):
        """Sample over the last axis of logits by the one sampling rule (`filtered`); seeded."""
        if temperature <= 0:
            return logits.argmax()
        return self.sample_probs(self.filtered(logits, temperature, top_k, top_p, min_p).softmax(), seed)

    def sample_probs(self, probs, seed=0):
        """Sample an index over the last axis from non-negative weights."""
        return self._op("sample", [probs], {"seed": _op_seed(seed)}, "i64")

    def ngram_lookup(self, seq, k, ngram_min=1, ngram_max=3, length=None):
        """Prompt lookup over seq: returns (tokens [k] padded with -1, count)."""
        args = [seq] if length is None else [seq, self._lift(length, "i64")]
        return self._op("ngram_lookup", args, {"k": k, "ngram_min": ngram_min, "ngram_max": ngram_max},
                        ["i64", "i64"], 2)

    def suffix_draft(self, context, length, k, min_match=2, max_match=32, factor=1.0, min_prob=0.1):
        """Drafts from earlier requests' texts in this namespace (the host's suffix index):
        returns (tokens [k] padded with -1, count, score f32, match length)."""
        return self._op("suffix_draft", [context, self._lift(length, "i64")],
                        {"k": k, "min_match": min_match, "max_match": max_match, "factor": float(factor),
                         "min_prob": float(min_prob)}, ["i64", "i64", "f32", "i64"], 4)

    def verify_greedy(self, drafts, target):
        """-> (accepted, tokens [k+1] padded with -1, count = accepted + 1)."""
        return self._op("verify_greedy", [drafts, target], {}, ["i64", "i64", "i64"], 3)

    def verify_sample(self, drafts, p, q=None, seed=0):
        """Rejection sampling (Leviathan et al.) -> (accepted, tokens [k+1], count)."""
        args = [drafts, p] if q is None else [drafts, p, q]
        return self._op("verify_sample", args, {"seed": _op_seed(seed)}, ["i64", "i64", "i64"], 3)

    def lru_lookup(self, table, stamps, key, g, k):
        """The LRU n-gram table's followers of leader key [g] -> (followers [k] padded with -1, count)."""
        return self._op("lru_lookup", [table, stamps, key], {"g": g, "k": k}, ["i64", "i64"], 2)

    def lru_update(self, table, stamps, seq, length, leaders, g, k):
        """Insert/refresh the leaders seq[i:i+g], i < leaders, with their followers in
        seq[:length] -> (table', stamps')."""
        args = [table, stamps, seq, self._lift(length, "i64"), self._lift(leaders, "i64")]
        return self._op("lru_update", args, {"g": g, "k": k}, ["i64", "i64"], 2)

    # --- effects -----------------------------------------------------------
    def put(self, name, values, count=None):
        """Append values[:count] to channel name."""
        self._effect("put", name, values, count)

    def set(self, name, values, count=None):
        """Overwrite channel name with values[:count] (its length becomes count)."""
        self._effect("set", name, values, count)

    # --- grammar constraints ------------------------------------------------
    def grammar_mask(self, window, matcher):
        """bool [W, V]: row j allows what the matcher allows after window[1..j] (see the IR)."""
        self._need_matcher(matcher)
        return self._op("grammar_mask", [window], {"matcher": matcher}, "bool")

    def grammar_commit(self, tokens, count, matcher, k):
        """Commit tokens[:count] to the matcher -> (forced tokens [k] padded with -1, their number)."""
        self._need_matcher(matcher)
        return self._op("grammar_commit", [tokens, self._lift(count, "i64")], {"matcher": matcher, "k": int(k)},
                        ["i64", "i64"], 2)

    # --- draft heads ---------------------------------------------------------
    def mtp_draft(self, hidden, tokens, count, drafter, k, temperature=0.0, seed=0, limit=None, min_prob=0.0):
        """Run the MTP head `drafter` over window rows [0, count) (hidden[r] with tokens[r], the token
        after row r), then chain it to min(k, limit) drafts -> (drafts [k] padded with -1, their number);
        with min_prob > 0 the chain stops before a draft the head gives less than that probability."""
        args = [hidden, tokens, self._lift(count, "i64")] + ([] if limit is None else [self._lift(limit, "i64")])
        attrs = {"drafter": str(drafter), "k": int(k), "temperature": float(temperature), "seed": _op_seed(seed)}
        if min_prob:
            attrs["min_prob"] = float(min_prob)
        return self._op("mtp_draft", args, attrs, ["i64", "i64"], 2)

    def draft_probs(self, drafts, from_head, drafter):
        """f32 [k, V]: the head's distributions of its last sampled drafts (from_head), else one-hot."""
        return self._op("draft_probs", [drafts, self._lift(from_head, "bool")], {"drafter": str(drafter)}, "f32")

    def _need_matcher(self, name):
        if name not in self._matchers:
            raise TraceError("unknown matcher %r: declare it with p.matcher(name)" % name)

    def _effect(self, kind, name, values, count):
        self._chan(name)
        if ("channel", name) in self._effects:
            raise TraceError("channel %r is written twice" % name)
        self._effects.add(("channel", name))
        args = [values] if count is None else [values, self._lift(count, "i64")]
        self._op(kind, args, {"channel": name}, [], 0)

    def fold(self, n):
        """Rows of this pass's window that become committed state (must be <= window)."""
        self._once("fold")
        self._op("fold", [self._lift(n, "i64")], {}, [], 0)

    def stop_if(self, cond):
        """Raise the stop flag when cond (bool scalar) holds."""
        self._once("stop")
        self._op("stop", [self._lift(cond, "bool")], {}, [], 0)

    def _once(self, what):
        if what in self._effects:
            raise TraceError("%s is set twice" % what)
        self._effects.add(what)

    # --- output ------------------------------------------------------------
    def to_dict(self):
        """The IR numbers inputs first, then op results in order; inputs may be declared anywhere here."""
        n_in = len(self._inputs)
        final = [i if kind == "in" else n_in + i for kind, i in self._where]
        ops = [{"op": o["op"], "args": [final[a] for a in o["args"]], "attrs": o["attrs"]} for o in self._ops]
        doc = {"version": VERSION, "dims": dict(self._dims), "channels": list(self._channels.values()),
               "inputs": list(self._inputs), "ops": ops}
        if self._matchers:
            doc["matchers"] = list(self._matchers)
        return doc

    def to_json(self):
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))


def _op_seed(seed) -> int:
    """An op's seed attribute: 32 bits (the IR's integer attributes). A run's whole u64 seed seeds
    its epilogue call, which every draw is keyed by too; an op keeps its low 32 bits (a program
    built with a server's random 63-bit seed was refused)."""
    return int(seed) & 0xFFFFFFFF
