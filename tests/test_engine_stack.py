"""The engine's layer stack (host/engine/stack.py) against transformers' forward.

Each supported architecture gets a tiny random model; one engine runs the same batches through
its layer stack and through transformers' forward (with the engine's attention hook). With the
stock layers, SDPA and torch's operators (the path CUDA takes) the logits and hidden states must
be equal exactly, not to a tolerance: the stack claims the same arithmetic. With the CPU's
kernels (packed products, the attention kernel, the row ops) the norms and SiLU round
differently from transformers' operators, so they must agree to float tolerance, and the
C++ loop must equal the Python loop exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch

from host.conformance.models import TinyTokenizer, tiny_config
from host.engine import Engine, Pass
from host.engine.stack import SUPPORTED, LayerStack


def tiny_model(model_type: str, **extra):
    import transformers

    base = tiny_config().to_dict()
    for k in ("model_type", "architectures", "transformers_version"):
        base.pop(k, None)
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),  # q/k/v with bias
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),  # q/k norms: not the stack's layer
    }[model_type]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = model_cls(cfg_cls(**{**base, **extra})).eval()
        for p in model.parameters():  # random norms and biases too, so a skipped one shows
            torch.nn.init.normal_(p, std=0.2) if p.dim() == 1 else None
    return model


def seq(n, start=3):
    return [(start + 7 * i) % 90 + 3 for i in range(n)]


def batches(eng):
    """A prefill, decodes, multi-row windows, a fork, a truncation and a long lone pass, as lists
    of passes over fresh working sets (the same for every engine built the same way)."""
    a, b, c = eng.new_working_set(), eng.new_working_set(), eng.new_working_set()
    # feature layers (the inputs of layers 0 and 1, and 2: the last output) in several orders and sets
    yield [Pass(a, seq(9, 1), list(range(9)), hidden=True, features=(0, 1, 2))]
    yield [Pass(b, seq(3, 2), [2], hidden=True, features=(2, 0)), Pass(c, seq(2, 5), [0, 1], features=(1,))]
    yield [Pass(a, [11], [0], hidden=True), Pass(b, [12, 13, 14], [0, 1, 2]), Pass(c, seq(20, 4), [0, 19])]
    d = eng.fork(a)
    eng.truncate(c, 3)
    yield [Pass(a, [20, 21], [0, 1], hidden=True, features=(1, 2)), Pass(d, [30], [0]), Pass(c, [40], [0], features=(0,))]
    yield [Pass(d, [31, 32, 33, 34], [0, 1, 2, 3], fold=2, hidden=True)]


def outputs(model, stack: bool, packed: bool, kernel: bool = True):
    eng = Engine(copy.deepcopy(model), TinyTokenizer(), name="t", kv_pages=32, page_size=4)
    eng.linears.enabled = packed
    if not kernel:  # SDPA over gathered contexts and torch's operators: what other devices run
        eng.attention_kernel = None
        if eng.stack is not None:
            eng.stack.rows = None
    elif eng.stack is not None:
        assert eng.stack.rows is not None, "the CPU's row ops should be built and used here"
    if not stack:
        eng.stack = None
    out = []
    for passes in batches(eng):
        for ps, o in zip(passes, eng.forward(passes)):
            assert not isinstance(o, Exception), o
            out.append((o.logits, o.hidden, o.features))
            check_features(ps, o)
    return eng, out


def check_features(ps, o):
    """Features come as asked: the readout rows, each asked layer's hidden size side by side, and
    the last layer's output (layer 2 of 2) is the pass's hidden state exactly."""
    if not ps.features:
        assert o.features is None
        return
    H = 64  # tiny_config's hidden size
    assert o.features.shape == (len(ps.readout), H * len(ps.features)) and o.features.dtype == torch.float32
    if ps.hidden and 2 in ps.features:
        j = ps.features.index(2)
        assert torch.equal(o.features[:, H * j:H * (j + 1)], o.hidden)


CASES = [(t, {}) for t in SUPPORTED] + [("llama", {"attention_bias": True, "mlp_bias": True})]


@pytest.mark.parametrize("model_type,extra", CASES, ids=[t + "-bias" * bool(x) for t, x in CASES])
@pytest.mark.parametrize("packed,kernel", [(True, True), (False, False)], ids=["packed-kernel", "stock-sdpa"])
def test_the_stack_computes_transformers_forward(model_type, extra, packed, kernel):
    model = tiny_model(model_type, **extra)
    eng, ours = outputs(model, stack=True, packed=packed, kernel=kernel)
    assert eng.stack is not None, f"{model_type} should run on the layer stack"
    _, theirs = outputs(model, stack=False, packed=packed, kernel=kernel)
    assert len(ours) == len(theirs) == 10
    # exact on torch's operators; the row ops' norms and SiLU round differently (~1e-7 here)
    same = torch.equal if not kernel else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    for (lo, ho, fo), (lt, ht, ft) in zip(ours, theirs):
        assert same(lo, lt)
        assert (ho is None) == (ht is None) and (ho is None or same(ho, ht))
        assert (fo is None) == (ft is None) and (fo is None or same(fo, ft))


def test_the_stack_matches_the_eager_reference_model():
    """Not only the hook's path: transformers' own eager attention, to float tolerance."""
    model = tiny_model("qwen2")
    ref = copy.deepcopy(model)
    ref.config._attn_implementation = "eager"
    eng = Engine(copy.deepcopy(model), TinyTokenizer(), name="t", kv_pages=32, page_size=4)
    ws = eng.new_working_set()
    s = seq(12)
    (o,) = eng.forward([Pass(ws, s[:8], list(range(8)))])
    (o2,) = eng.forward([Pass(ws, s[8:], list(range(4)))])
    with torch.inference_mode():
        want = ref(torch.tensor([s])).logits[0]
    assert torch.allclose(torch.cat([o.logits, o2.logits]), want, atol=1e-4)


def test_features_are_the_layer_inputs_of_the_reference_model():
    """Pass.features against transformers' output_hidden_states (the eager reference, to float
    tolerance): hidden_states[i] enters layer i; and a pass asking for a layer past the model's
    last output is refused."""
    from host.errors import InvalidArgument

    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    ref.config._attn_implementation = "eager"
    eng = Engine(copy.deepcopy(model), TinyTokenizer(), name="t", kv_pages=32, page_size=4)
    s = seq(10)
    ws = eng.new_working_set()
    (o,) = eng.forward([Pass(ws, s[:7], [6], features=(0, 1))])
    (o2,) = eng.forward([Pass(ws, s[7:], [0, 2], features=(1, 0))])
    with torch.inference_mode():
        hs = ref(torch.tensor([s]), output_hidden_states=True).hidden_states
    want = torch.cat([hs[0][0], hs[1][0]], -1)
    assert torch.allclose(o.features, want[[6]], atol=1e-5)
    assert torch.allclose(o2.features, torch.cat([hs[1][0], hs[0][0]], -1)[[7, 9]], atol=1e-5)
    with pytest.raises(InvalidArgument, match="feature layers"):
        eng.check_pass(Pass(ws, [5], [0], features=(3,)))


def test_other_layers_run_transformers_forward():
    model = tiny_model("qwen3")  # q_norm/k_norm: a layer the stack does not compute
    assert LayerStack.of(model, None) is None
    eng = Engine(model, TinyTokenizer(), name="t", kv_pages=32, page_size=4)
    assert eng.stack is None
    ws = eng.new_working_set()
    (o,) = eng.forward([Pass(ws, seq(5), [4])])
    assert o.logits.shape == (1, 97)


@pytest.mark.parametrize("model_type,extra", CASES, ids=[t + "-bias" * bool(x) for t, x in CASES])
def test_the_cpp_loop_equals_the_python_loop_exactly(model_type, extra):
    """csrc/layer_stack.cpp makes stack.py's calls from C++: the same bits. It runs every batch
    on CPU float32 with packed products (prompts and mixed batches too: the attention kernel
    takes every window); stack.py runs the same batches with `native` None."""
    model = tiny_model(model_type, **extra)
    eng, _ = outputs(model, stack=True, packed=True)
    native, calls = eng.stack.native, []
    assert native is not None, "the C++ loop should be built and taken on CPU float32"

    def counted(*args):
        calls.append(1)
        return native(*args)

    eng = Engine(copy.deepcopy(model), TinyTokenizer(), name="t", kv_pages=32, page_size=4)
    eng.stack.native = counted
    ours = [(o.logits, o.hidden, o.features) for passes in batches(eng) for o in eng.forward(passes)]
    eng = Engine(copy.deepcopy(model), TinyTokenizer(), name="t", kv_pages=32, page_size=4)
    eng.stack.native = None
    theirs = [(o.logits, o.hidden, o.features) for passes in batches(eng) for o in eng.forward(passes)]
    assert len(calls) == 5, "every batch runs in C++ (batches() makes five)"
    for (lo, ho, fo), (lt, ht, ft) in zip(ours, theirs):
        assert torch.equal(lo, lt)
        assert (ho is None) == (ht is None) and (ho is None or torch.equal(ho, ht))
        assert (fo is None) == (ft is None) and (fo is None or torch.equal(fo, ft))
