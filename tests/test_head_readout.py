"""A draft head's readout over a draft vocabulary (host/engine/drafting.py): on a target whose
readout is in its file's blocks, the head reads the draft vocabulary's rows of those blocks
(blocks.take_rows), never a float32 copy, and its logits have that copy's bits: the same drafts,
a quarter of the bytes each draft step reads."""

from __future__ import annotations

import pytest
import torch

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
