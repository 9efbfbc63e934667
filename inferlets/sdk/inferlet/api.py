"""Model, WorkingSet, ForwardPass, StateGeometry, Channel, Sampler, Grammar and Matcher over the WIT imports.

Each method is one guest->host crossing unless its docstring says otherwise; a decode step
with `ForwardPass.next_token` plus `emit` is two.
"""

from componentize_py_types import Err
from wit_world.imports import channels as _ch
from wit_world.imports import forward as _fw
from wit_world.imports import grammars as _gr
from wit_world.imports import runtime as _rt
from wit_world.imports import tokenizer as _tok
from wit_world.imports import working_sets as _ws

from .args import UsageError


class PieError(Exception):
    """A host call failed; `code` is the WIT error-code name (e.g. 'bad-handle')."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def _call(fn, *args):
    try:
        return fn(*args)
    except Err as e:
        err = e.value
        raise PieError(err.code.name.lower().replace("_", "-"), err.message) from None


def arguments() -> list:
    return _rt.get_arguments()


def send(text: str) -> None:
    """Stream free text to the client."""
    _rt.send(text)


def emit(tokens) -> None:
    """Record generated token ids as the run's output; the host streams their text."""
    _call(_rt.emit, list(tokens))


def emit_channel(channel) -> None:
    """Make the host emit whatever a device loop appends to `channel`, with no guest call
    per round; wait for the loop with `channel.take()`, which returns [] once it ended."""
    _call(_rt.emit_channel, channel.handle)


class Model:
    """The target model: facts and tokenizer. Facts are fetched once."""

    def __init__(self):
        info = _rt.get_model_info()
        self.name = info.name
        self.vocab_size = info.vocab_size
        self.eos_ids = list(info.eos_ids)
        self.context_length = info.context_length
        self.drafters = list(info.drafters)

    def encode(self, text: str) -> list:
        return _tok.encode(text)

    def prompt_tokens(self, args) -> list:
        """The tokens of args.prompt (GenerationArgs), in the chat template when args.chat; or
        args.prompt_ids as given (the host checks each id against the vocabulary)."""
        if args.prompt_ids is not None:
            tokens = args.prompt_ids
        else:
            text = self.chat_prompt([("user", args.prompt)]) if args.chat else args.prompt
            tokens = self.encode(text)
        if not tokens:
            raise UsageError("the prompt is empty; pass --prompt TEXT")
        return tokens

    def decode(self, tokens) -> str:
        return _call(_tok.decode, list(tokens))

    def chat_prompt(self, messages, add_generation_prompt: bool = True) -> str:
        """messages: [(role, content), ...] or [{'role':..., 'content':...}, ...]."""
        msgs = []
        for m in messages:
            role, content = (m["role"], m["content"]) if isinstance(m, dict) else m
            msgs.append(_tok.Message(role, content))
        return _call(_tok.apply_chat_template, msgs, add_generation_prompt)

    def working_set(self, cached: bool = True) -> "WorkingSet":
        """A new, empty working set; cached=False keeps it outside the host's prefix cache."""
        return WorkingSet(_call(_ws.create if cached else _ws.create_uncached))

    def register_epilogue(self, program: str, channels: dict = None) -> "Epilogue":
        """Register a traced epilogue program (JSON text); `channels` maps its channel names to Channels."""
        bindings = [_fw.ChannelBinding(name, ch.handle) for name, ch in (channels or {}).items()]
        return Epilogue(_call(_fw.register_epilogue, program, bindings))


class Epilogue:
    """A registered device program, run after each pass that names it."""

    def __init__(self, handle: int):
        self.handle = handle

    def release(self) -> None:
        _call(_fw.release_epilogue, self.handle)


class WorkingSet:
    """One sequence's KV state; rows 0..frozen are committed."""

    def __init__(self, handle: int):
        self.handle = handle

    @property
    def frozen(self) -> int:
        return _call(_ws.frozen_length, self.handle)

    def tokens(self) -> list:
        return _call(_ws.tokens, self.handle)

    def fork(self) -> "WorkingSet":
        return WorkingSet(_call(_ws.fork, self.handle))

    def truncate(self, length: int) -> None:
        _call(_ws.truncate, self.handle, length)

    def evict(self, start: int, end: int) -> None:
        _call(_ws.evict, self.handle, start, end)

    def commit(self, rows: int) -> None:
        """Freeze the first `rows` scratch rows the last pass left (a fold decided after the pass)."""
        _call(_ws.commit, self.handle, rows)

    def release(self) -> None:
        _call(_ws.release, self.handle)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


class StateGeometry:
    """Where the window goes and how much of it is frozen after the pass.

    fold: None = the whole window; an int = that many rows; a Channel = cell 0 of that
    u32 channel, read after the pass; "epilogue" = the pass's epilogue's fold effect.
    """

    def __init__(self, window: int, fold=None):
        self.window = window
        self.fold = fold

    def _wit(self):
        if self.fold is None:
            fold = _fw.FoldCount_All()
        elif self.fold == "epilogue":
            fold = _fw.FoldCount_FromEpilogue()
        elif isinstance(self.fold, Channel):
            fold = _fw.FoldCount_FromChannel(self.fold.handle)
        else:
            fold = _fw.FoldCount_Constant(int(self.fold))
        return _fw.StateGeometry(self.window, fold)


class Sampler:
    """Sampling on the host by the one sampling rule (the logit bias, the penalties (an
    args.Penalties), temperature, top-k, min-p, top-p) with its own seeded generator.

    temperature 0 is greedy (argmax): no host sampler is created, unless a bias or penalties need one.
    """

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, top_k: int = 0,
                 min_p: float = 0.0, logit_bias=None, penalties=None):
        self.temperature = temperature
        self.top_p = top_p
        self.seed = seed
        self.handle = None
        bias = [(int(t), float(b)) for t, b in sorted((logit_bias or {}).items())]
        if penalties is not None and penalties.active:  # penalties change greedy choice too
            pen = _fw.Penalties(penalties.presence, penalties.frequency, penalties.repetition, penalties.output_start)
            self.handle = _call(_fw.create_penalized_sampler, float(temperature), float(top_p), int(top_k),
                                float(min_p), bias, pen, int(seed))
        elif logit_bias or (temperature > 0 and (top_k or min_p)):  # a bias changes greedy choice too
            self.handle = _call(_fw.create_filtered_sampler, float(temperature), float(top_p), int(top_k),
                                float(min_p), bias, int(seed))
        elif temperature > 0:
            self.handle = _call(_fw.create_sampler, float(temperature), float(top_p), int(seed))

    def _kind(self):
        if self.handle is None:
            return _fw.ReadoutKind_Argmax()
        return _fw.ReadoutKind_Sample(self.handle)

    def release(self) -> None:
        if self.handle is not None:
            _call(_fw.release_sampler, self.handle)
            self.handle = None


class ForwardPass:
    """One pass over a window at `ws`'s frozen end.

    embed: a list of token ids, or a u32 Channel (then give `geometry` with the window).
    readout: window rows that return outputs (default: the last row).
    """

    def __init__(self, ws: WorkingSet, embed, geometry: StateGeometry = None, readout=None, epilogue=None,
                 seed: int = 0):
        if isinstance(embed, Channel):
            if geometry is None:
                raise ValueError("a channel embed needs a StateGeometry with the window length")
            wit_embed = _fw.Embed_FromChannel(embed.handle)
        else:
            embed = list(embed)
            wit_embed = _fw.Embed_Tokens(embed)
            geometry = geometry or StateGeometry(len(embed))
        self.ws = ws
        self.geometry = geometry
        self.rows = [geometry.window - 1] if readout is None else list(readout)
        self._embed = wit_embed
        self._epilogue = None if epilogue is None else _fw.EpilogueCall(epilogue.handle, seed)

    def _pass(self, kind):
        return _fw.Pass(self.ws.handle, self._embed, self.geometry._wit(), _fw.Readout(self.rows, kind),
                        self._epilogue)

    def execute(self):
        """Run with no readout; returns the frozen length after the pass."""
        return _call(_fw.execute, self._pass(_fw.ReadoutKind_None_())).frozen

    def tokens(self, sampler: Sampler = None) -> list:
        """One token per readout row: argmax, or drawn by `sampler`. Logits stay on the host."""
        kind = sampler._kind() if sampler is not None else _fw.ReadoutKind_Argmax()
        return _call(_fw.execute, self._pass(kind)).tokens

    def next_token(self, sampler: Sampler = None) -> int:
        return self.tokens(sampler)[-1]

    def run_loop(self, rounds: int) -> None:
        """Start the pass on the device for up to `rounds` rounds; read tokens with Channel.take()."""
        _call(_fw.run_loop, self._pass(_fw.ReadoutKind_None_()), rounds)

    def logits(self) -> list:
        """The readout rows' float32 logits, flattened (rows * vocab). Expensive: avoid per token."""
        return _call(_fw.execute, self._pass(_fw.ReadoutKind_Logits())).logits


_ELEMENT = {"u32": (_ch.ElementType.UINT32, _ch.Cells_Uint32), "i32": (_ch.ElementType.INT32, _ch.Cells_Int32),
            "f32": (_ch.ElementType.FLOAT32, _ch.Cells_Float32), "bool": (_ch.ElementType.BOOLEAN, _ch.Cells_Boolean)}


class Channel:
    """A typed device buffer: dtype is 'u32', 'i32', 'f32' or 'bool'."""

    def __init__(self, dtype: str, capacity: int):
        if dtype not in _ELEMENT:
            raise ValueError(f"channel dtype must be one of {sorted(_ELEMENT)}")
        self.dtype = dtype
        self._cells = _ELEMENT[dtype][1]
        self.handle = _call(_ch.create, _ELEMENT[dtype][0], capacity)

    def put(self, values) -> None:
        _call(_ch.put, self.handle, self._cells(list(values)))

    def read(self, start: int = 0, count: int = None) -> list:
        if count is None:
            count = len(self) - start
        return _call(_ch.read, self.handle, start, count).value

    def take(self) -> list:
        return _call(_ch.take, self.handle).value

    def __len__(self) -> int:
        return _call(_ch.len, self.handle)

    def close(self) -> None:
        _call(_ch.close, self.handle)

    def release(self) -> None:
        _call(_ch.release, self.handle)


class Grammar:
    """A compiled grammar. kind: 'json-schema', 'regex' or 'lark'; a bad source raises PieError
    (invalid-argument) with the grammar engine's message."""

    _KINDS = {"json-schema": "JSON_SCHEMA", "regex": "REGEX", "lark": "LARK"}

    def __init__(self, kind: str, source: str):
        if kind not in self._KINDS:
            raise UsageError("grammar kind must be one of %s" % ", ".join(self._KINDS))
        self.handle = _call(_gr.compile, getattr(_gr.GrammarKind, self._KINDS[kind]), source)

    def matcher(self) -> "Matcher":
        return Matcher(_call(_gr.create_matcher, self.handle))

    def release(self) -> None:
        _call(_gr.release_grammar, self.handle)


class Matcher:
    """One sequence's place in a grammar (see WIT `grammars`)."""

    def __init__(self, handle: int):
        self.handle = handle

    def accept(self, tokens) -> int:
        return _call(_gr.accept, self.handle, list(tokens))

    def validate(self, tokens) -> int:
        return _call(_gr.validate, self.handle, list(tokens))

    def allowed(self) -> list:
        """The allowed next tokens as bit-set words (token t: bit t % 32 of word t // 32)."""
        return _call(_gr.allowed, self.handle)

    def forced(self) -> list:
        return _call(_gr.forced, self.handle)

    def rollback(self, n: int) -> None:
        _call(_gr.rollback, self.handle, n)

    def fork(self) -> "Matcher":
        return Matcher(_call(_gr.fork, self.handle))

    def state(self):
        """(accepting, stopped, consumed)."""
        st = _call(_gr.state, self.handle)
        return st.accepting, st.stopped, st.consumed

    def bind(self, epilogue, name: str) -> None:
        """Use this matcher as the epilogue program's matcher `name`."""
        _call(_gr.bind_matcher, epilogue.handle, name, self.handle)

    def release(self) -> None:
        _call(_gr.release_matcher, self.handle)
