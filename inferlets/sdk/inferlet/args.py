"""The standard generation arguments every generation inferlet accepts.

--prompt TEXT or --prompt-ids 1,2,3 (the prompt's token ids, for a client that tokenized it),
--chat, --max-tokens N, --temperature T (0 = greedy), --top-p P, --top-k K (0: off), --min-p P
(0: off), --logit-bias ID:B,ID:B, --presence-penalty P, --frequency-penalty F (0: off),
--repetition-penalty R (1: off), --seed S: the one sampling rule's fields (the logit bias, the
penalties, then temperature, top-k, min-p, top-p; bias and penalties apply to greedy choice too).
A small hand-written parser: argparse would print and exit, which a guest cannot do well.
"""


class UsageError(Exception):
    pass


class Penalties:
    """The one sampling rule's penalties (the WIT's `penalties` record): repetition over the whole
    context, then frequency x count and presence over the output, the working set's tokens from
    index output_start on."""

    def __init__(self, presence=0.0, frequency=0.0, repetition=1.0, output_start=0):
        self.presence, self.frequency, self.repetition = float(presence), float(frequency), float(repetition)
        self.output_start = int(output_start)

    @property
    def active(self) -> bool:
        return self.presence != 0 or self.frequency != 0 or self.repetition != 1


class GenerationArgs:
    def __init__(self):
        self.prompt = ""
        self.prompt_ids = None  # a list of token ids instead of the prompt's text
        self.chat = False
        self.max_tokens = 32
        self.temperature = 0.0
        self.top_p = 1.0
        self.top_k = 0  # 0: off
        self.min_p = 0.0  # 0: off
        self.logit_bias = {}  # token id -> a value added to its logit, before everything else
        self.presence_penalty = 0.0
        self.frequency_penalty = 0.0
        self.repetition_penalty = 1.0
        self.seed = 0
        self.extra = {}  # inferlet-specific --name value pairs

    def penalties(self, output_start: int):
        """The penalties with the output starting at working-set index output_start, or None when off."""
        pen = Penalties(self.presence_penalty, self.frequency_penalty, self.repetition_penalty, output_start)
        return pen if pen.active else None


def _ids(text: str) -> list:
    ids = [int(t) for t in text.split(",")]
    if any(i < 0 for i in ids):
        raise ValueError(text)
    return ids


_ids.__name__ = "comma-separated list of token ids"


def _bias(text: str) -> dict:
    out = {}
    for item in text.split(","):
        tok, _, value = item.partition(":")
        v = float(value)
        if int(tok) < 0 or v != v or v in (float("inf"), float("-inf")):
            raise ValueError(text)
        out[int(tok)] = v
    return out


_bias.__name__ = "comma-separated list of ID:BIAS (finite biases)"


def _finite(text: str) -> float:
    v = float(text)
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError(text)
    return v


_finite.__name__ = "finite number"

_TYPES = {"--prompt": ("prompt", str), "--prompt-ids": ("prompt_ids", _ids), "--max-tokens": ("max_tokens", int), "--temperature": ("temperature", float),
          "--top-p": ("top_p", float), "--top-k": ("top_k", int), "--min-p": ("min_p", float),
          "--logit-bias": ("logit_bias", _bias), "--presence-penalty": ("presence_penalty", _finite),
          "--frequency-penalty": ("frequency_penalty", _finite), "--repetition-penalty": ("repetition_penalty", _finite),
          "--seed": ("seed", int)}


def parse_generation_args(argv, extra: dict = None) -> GenerationArgs:
    """Parse argv; `extra` maps more options (e.g. '--draft-len') to (default, type)."""
    extra = extra or {}
    out = GenerationArgs()
    for name, (default, _) in extra.items():
        out.extra[name.lstrip("-").replace("-", "_")] = default
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, _, inline = arg.partition("=")
        if name == "--chat":
            out.chat = True
            i += 1
            continue
        if name not in _TYPES and name not in extra:
            raise UsageError(f"unknown argument {arg!r}")
        if inline:
            value = inline
            i += 1
        elif i + 1 < len(argv):
            value = argv[i + 1]
            i += 2
        else:
            raise UsageError(f"{name} needs a value")
        attr, typ = _TYPES[name] if name in _TYPES else (name.lstrip("-").replace("-", "_"), extra[name][1])
        try:
            parsed = typ(value)
        except ValueError:
            shown = repr(value) if len(value) <= 60 else f"{value[:40]!r}... ({len(value)} characters)"
            raise UsageError(f"{name}: {shown} is not a valid {typ.__name__}") from None
        if name in _TYPES:
            setattr(out, attr, parsed)
        else:
            out.extra[attr] = parsed
    if out.prompt_ids is not None and (out.prompt or out.chat):
        raise UsageError("--prompt-ids is the whole prompt: it takes neither --prompt nor --chat")
    if out.max_tokens < 0:
        raise UsageError("--max-tokens must be >= 0")
    if out.temperature < 0:
        raise UsageError("--temperature must be >= 0")
    if not 0 < out.top_p <= 1:
        raise UsageError("--top-p must be in (0, 1]")
    if out.top_k < 0:
        raise UsageError("--top-k must be >= 0 (0: off)")
    if not 0 <= out.min_p <= 1:
        raise UsageError("--min-p must be in [0, 1] (0: off)")
    if not out.repetition_penalty > 0:
        raise UsageError("--repetition-penalty must be > 0 (1: off)")
    return out
