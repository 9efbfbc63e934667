"""A draft head's readout over a draft vocabulary (host/engine/drafting.py): on a target whose
readout is in its file's blocks, the head reads the draft vocabulary's rows of those blocks
(blocks.take_rows) in the target's own arithmetic, never a float32 copy: its logits are the
target readout's columns bit for bit (and, exact, a float32 copy's), a quarter of the bytes
each draft step reads."""

from __future__ import annotations

import pytest
import torch

from host.engine import blocks
from host.engine.blocks import BlockLinear
from host.engine.readout import Readout

pytestmark = pytest.mark.model


def test_the_head_reads_its_vocabulary_rows_in_the_targets_blocks(engine):
    target_out = engine.model.get_output_embeddings()
    assert isinstance(target_out, BlockLinear)
    runners = [r for r in engine.heads.values() if r.head.draft_vocab is not None and r.head.head is None]
    assert runners, "the default model ships with a head over a draft vocabulary"
    for runner in runners:
        vocab = runner.head.draft_vocab
        assert isinstance(runner._out.head, BlockLinear) and runner._out.head.format == target_out.format
        assert runner._out.head.packed.nbytes < len(vocab) * target_out.in_features * 4 / 3
        w = runner.head.output_weight(target_out.weight).detach()  # the float32 copy it replaced
        copy = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        copy.weight = torch.nn.Parameter(w.contiguous(), requires_grad=False)
        for rows in (1, 2, 3, 4, 9, 17):
            x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
            assert torch.equal(runner._out(x), Readout(copy)(x)), rows
            assert torch.equal(runner._out(x), Readout(target_out)(x)[:, vocab]), rows


def test_rows_taken_in_the_q8_arithmetic_are_the_q8_readouts_columns(engine):
    """A q8 import's head reads its rows with 8-bit activations, as the target does: the same
    logits as the target's q8 readout at the draft vocabulary's ids."""
    target_out = engine.model.get_output_embeddings()
    q8 = blocks.q8_format(blocks.ggml_of(target_out.format))
    full = blocks.take_rows(target_out.packed, target_out.format, torch.arange(target_out.out_features), into=q8)
    target_q8 = BlockLinear(full, q8, target_out.out_features, target_out.in_features)
    vocab = torch.randperm(target_out.out_features, generator=torch.Generator().manual_seed(0))[:300]
    head_q8 = BlockLinear(blocks.take_rows(full, q8, vocab), q8, len(vocab), target_out.in_features)
    for rows in (1, 3, 8):
        x = torch.randn(rows, target_out.in_features, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(Readout(head_q8)(x), Readout(target_q8)(x)[:, vocab]), rows


def test_the_heads_linears_are_in_q8_0_blocks_as_gguf_quantizes_them(engine):
    """On a target in blocks, each float linear of a head (its block's and its fc's) runs as Q8_0
    blocks (drafting.to_blocks): the weights gguf-py's reference quantizer gives, widened exactly."""
    from gguf.quants import dequantize, quantize

    from host.drafter.mtp import load_head
    from host.engine import drafting
    from host.store import drafter_path, read_record

    rec = read_record(engine.info.name)
    for name, runner in engine.heads.items():
        converted = [(n, m) for n, m in runner.head.named_modules() if isinstance(m, BlockLinear)]
        assert len(converted) >= 7 and all(m.format == drafting.HEAD_BLOCKS for _, m in converted)
        assert not any(type(m) is torch.nn.Linear for m in runner.head.block.modules())
        fresh, _ = load_head(drafter_path(rec, name), engine.model, dtype=torch.float32)
        for n, m in converted[:3]:
            w = fresh.get_submodule(n).weight.detach().numpy()
            want = torch.from_numpy(dequantize(quantize(w, 8), 8).reshape(w.shape))
            assert torch.equal(m.weight, want), n
