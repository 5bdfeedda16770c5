"""A step's inputs on the device: the staged layout CUDA uses (one host tensor filled through numpy, one
copy, views of it) holds exactly what the plain CPU path hands the model."""

from __future__ import annotations

import pytest
import torch

from engine.contract import SamplingParams, ScheduledSequence
from engine.inputs import HostStepInputs, build_host_inputs

BLOCK_SIZE = 4


def mixed_batch() -> HostStepInputs:
    """A prompt chunk that scores two prompt tokens and samples, a chunk that samples nothing, and two
    decodes with block tables of different lengths."""
    params = SamplingParams()
    return build_host_inputs(
        [
            ScheduledSequence("p", [5, 6, 7, 8, 9], 0, [3, 4], True, params, num_prompt_scored=2),
            ScheduledSequence("c", [10, 11, 12], 4, [7, 8], False, params),
            ScheduledSequence("d", [13], 9, [0, 1, 2], True, params),
            ScheduledSequence("e", [14], 0, [6], True, params),
        ],
        BLOCK_SIZE,
    )


def test_the_staged_copy_holds_what_the_plain_path_does() -> None:
    host = mixed_batch()
    plain = host.to(torch.device("cpu"))
    qsl = plain.attn_metadata.query_start_loc.tolist()
    ssl = plain.attn_metadata.seq_start_loc.tolist()
    ids, positions, slots, logits_indices, q, s, seq_lens, tables = host._staged_on(
        torch.device("cpu"), qsl, ssl
    )
    md = plain.attn_metadata
    for staged, want in [
        (ids, plain.input_ids),
        (positions, plain.positions),
        (slots, md.slot_mapping),
        (logits_indices, plain.logits_indices),
        (q, md.query_start_loc),
        (s, md.seq_start_loc),
        (seq_lens, md.seq_lens),
        (tables, md.block_tables),
    ]:
        assert staged.dtype == want.dtype
        assert staged.shape == want.shape
        assert torch.equal(staged, want)
        # Every array starts on a 16-byte boundary whatever the batch's sizes: Triton compiles a
        # kernel afresh for each pointer alignment it meets.
        assert staged.data_ptr() % 16 == 0
    # The values themselves, for the reader: three scored-or-sampled rows of p, none of c, d and e's.
    assert plain.logits_indices.tolist() == [0, 1, 4, 8, 9]
    assert qsl == [0, 5, 8, 9, 10] and ssl == [0, 5, 12, 22, 23]
    assert md.block_tables.tolist() == [[3, 4, 0], [7, 8, 0], [0, 1, 2], [6, 0, 0]]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_inputs_arrive_in_one_staged_copy() -> None:
    host = mixed_batch()
    plain = host.to(torch.device("cpu"))
    staged = host.to(torch.device("cuda"))
    md, smd = plain.attn_metadata, staged.attn_metadata
    for got, want in [
        (staged.input_ids, plain.input_ids),
        (staged.positions, plain.positions),
        (staged.logits_indices, plain.logits_indices),
        (smd.slot_mapping, md.slot_mapping),
        (smd.query_start_loc, md.query_start_loc),
        (smd.seq_start_loc, md.seq_start_loc),
        (smd.seq_lens, md.seq_lens),
        (smd.block_tables, md.block_tables),
    ]:
        assert got.device.type == "cuda" and got.dtype == want.dtype
        assert torch.equal(got.cpu(), want)
    # One device allocation holds them all: views of it.
    base = staged.input_ids.untyped_storage().data_ptr()
    assert smd.block_tables.untyped_storage().data_ptr() == base
