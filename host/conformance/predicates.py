"""Named predicates a step's result must satisfy, against the suite's own reference model
(host/conformance/models.py), never against the host under test.

Each takes (value, params, reference) and returns None when it holds, else why not.
"""

from __future__ import annotations


def _tokens(value):
    """The ids in a pass-output ({"tokens": ...}), channel cells ({"uint32": ...}) or a plain list."""
    if isinstance(value, dict):
        return value["tokens"] if "tokens" in value else next(iter(value.values()))
    return value


def prefix(value, params, ref) -> str | None:
    """The value (a list) starts with `items`."""
    items = list(params["items"])
    return None if value[:len(items)] == items else f"expected a list starting with {items}, got {value}"


def greedy_tokens(value, params, ref) -> str | None:
    """The ids in the value are the reference model's first `n` greedy tokens after `prompt`,
    less the first `skip` (default 0)."""
    want = ref.greedy(list(params["prompt"]), params["n"])[params.get("skip", 0):]
    got = _tokens(value)
    return None if got == want else f"expected the reference greedy tokens {want}, got {got}"


def greedy_continuation(value, params, ref) -> str | None:
    """The value (a list of ids, e.g. working-sets.tokens) is `prompt` followed by the reference
    model's first `n` greedy tokens."""
    prompt = list(params["prompt"])
    want = prompt + ref.greedy(prompt, params["n"])
    return None if value == want else f"expected the prompt and its reference greedy tokens {want}, got {value}"


def reference_argmax(value, params, ref) -> str | None:
    """The value's `tokens` (a pass's argmax readout) are, for each of `rows`, the reference's
    greedy next token after `context` (the whole sequence up to the window's end) cut at that row.
    `offset` is where the window starts in `context` (default 0)."""
    ctx, off = list(params["context"]), params.get("offset", 0)
    nxt = ref.next_tokens(ctx)
    want = [nxt[off + r] for r in params["rows"]]
    got = _tokens(value)
    return None if got == want else f"expected the reference argmax {want}, got {got}"


def logits_shape(value, params, ref) -> str | None:
    """A pass-output with no tokens and `rows` * `vocab` finite logits."""
    n = params["rows"] * params["vocab"]
    logits = value["logits"]
    if value["tokens"] or len(logits) != n or not all(isinstance(x, float) and abs(x) < 1e30 for x in logits):
        return f"expected no tokens and {n} finite logits, got {len(value['tokens'])} tokens and {len(logits)} logits"
    return None


def allowed_tokens(value, params, ref) -> str | None:
    """The value (grammars.allowed) is a bit set of ceil(vocab / 32) words holding exactly the
    ids `tokens` (token t is bit t % 32 of word t // 32)."""
    V = ref.model.config.vocab_size
    if len(value) != (V + 31) // 32:
        return f"expected {(V + 31) // 32} words for a vocabulary of {V}, got {len(value)}"
    got = [t for t in range(32 * len(value)) if value[t // 32] >> (t % 32) & 1]
    want = sorted(params["tokens"])
    return None if got == want else f"expected the allowed tokens {want}, got {got}"


def constrained_greedy_tokens(value, params, ref) -> str | None:
    """The ids in the value are the reference model's first `n` greedy tokens after `prompt`
    with each step restricted to the tokens the regex `regex` allows."""
    want = ref.constrained_greedy(list(params["prompt"]), params["n"], params["regex"])
    got = _tokens(value)
    return None if got == want else f"expected the reference constrained greedy tokens {want}, got {got}"


PREDICATES = {"logits-shape": logits_shape, "greedy-continuation": greedy_continuation, "greedy-tokens": greedy_tokens,
              "reference-argmax": reference_argmax, "prefix": prefix, "allowed-tokens": allowed_tokens,
              "constrained-greedy-tokens": constrained_greedy_tokens}
