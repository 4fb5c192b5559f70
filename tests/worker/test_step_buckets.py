"""Step-graph shapes, torch-free: buckets, the bucket a step runs in, table widths, padding rows."""

from __future__ import annotations

import pytest

from infer.worker.engine.config import EngineConfig
from infer.worker.engine.step_buckets import DecodeRow, batch_buckets, bucket_for, pad_decode, table_width


@pytest.mark.parametrize(
    "max_num_seqs, max_bucket, expected",
    [
        (256, 256, (1, 2, 4, 8, 16, 32, 64, 128, 256)),
        (256, 4, (1, 2, 4)),
        (48, 256, (1, 2, 4, 8, 16, 32, 48)),  # the limit itself closes the list
        (1, 256, (1,)),
        (5, 3, (1, 2, 3)),
    ],
)
def test_batch_buckets(max_num_seqs, max_bucket, expected):
    assert batch_buckets(max_num_seqs, max_bucket) == expected


def test_batch_buckets_rejects_nonpositive_limits():
    with pytest.raises(ValueError, match="must be >= 1"):
        batch_buckets(0, 8)


@pytest.mark.parametrize(
    "num_seqs, bucket",
    [
        (1, 1),
        (2, 2),
        (3, 4),
        (4, 4),
        (5, 8),
        (8, 8),
        (9, 16),
        (33, 48),
        (47, 48),
        (48, 48),
        (49, None),
        (0, None),
    ],
)
def test_bucket_for_each_boundary(num_seqs, bucket):
    assert bucket_for(num_seqs, batch_buckets(48, 256)) == bucket


@pytest.mark.parametrize(
    "longest, max_width, granularity, width",
    [
        (1, 128, 4, 4),
        (4, 128, 4, 4),
        (5, 128, 4, 8),
        (127, 128, 4, 128),
        (128, 128, 4, 128),
        (1, 128, 1, 2),  # never below 2 (a compiled dynamic dimension is never 0 or 1)
        (3, 3, 4, 3),  # never above the longest table a sequence can have
        (1, 1, 4, 2),  # ... except that 2 wins when a whole context fits one block
    ],
)
def test_table_width(longest, max_width, granularity, width):
    assert table_width(longest, max_width, granularity) == width


def test_table_width_rejects_a_table_that_cannot_fit():
    with pytest.raises(ValueError, match="does not fit"):
        table_width(9, 8, 4)


def test_pad_decode_lays_out_real_rows_then_padding():
    rows = [
        DecodeRow(token_id=11, position=5, block_table=[7, 3]),  # block 3, offset 1 (block size 4)
        DecodeRow(token_id=12, position=0, block_table=[9]),
    ]
    padded = pad_decode(rows, bucket=4, width=3, block_size=4, scratch_block=99)
    assert (padded.num_seqs, padded.bucket, padded.width) == (2, 4, 3)
    assert padded.input_ids == [11, 12, 0, 0]
    assert padded.positions == [5, 0, 0, 0]
    assert padded.slot_mapping == [3 * 4 + 1, 9 * 4 + 0, -1, -1]
    assert padded.seq_lens == [6, 1, 1, 1]
    assert padded.block_tables == [7, 3, 99, 9, 99, 99] + [99] * 6


def test_pad_decode_full_bucket_has_no_padding():
    rows = [DecodeRow(i, 2, [i]) for i in range(4)]
    padded = pad_decode(rows, bucket=4, width=2, block_size=4, scratch_block=50)
    assert -1 not in padded.slot_mapping and padded.seq_lens == [3] * 4


@pytest.mark.parametrize(
    "rows, bucket, width, message",
    [
        ([], 4, 2, "do not fit a bucket"),
        ([DecodeRow(1, 0, [0])] * 5, 4, 2, "do not fit a bucket"),
        ([DecodeRow(1, 0, [0, 1, 2])], 4, 2, "does not fit a table"),
        ([DecodeRow(1, 8, [0, 1])], 4, 2, "does not fit a table"),  # position past the table's blocks
    ],
)
def test_pad_decode_rejects_rows_that_do_not_fit(rows, bucket, width, message):
    with pytest.raises(ValueError, match=message):
        pad_decode(rows, bucket, width, block_size=4, scratch_block=9)


def test_worker_and_serve_flags_reach_the_engine_config():
    from infer.client.serve import build_parser as serve_parser
    from infer.client.serve import worker_args
    from infer.worker.service.cli import build_parser, engine_config

    args = build_parser().parse_args(
        ["--coordinator", "tcp://127.0.0.1:1", "--enforce-eager", "--max-graph-batch-size", "16"]
    )
    config = engine_config(args)
    assert config.enforce_eager is True and config.max_graph_batch_size == 16
    on = engine_config(build_parser().parse_args(["--coordinator", "tcp://127.0.0.1:1", "--no-enforce-eager"]))
    assert on.enforce_eager is False
    served = worker_args(serve_parser().parse_args(["--no-enforce-eager", "--max-graph-batch-size", "8"]), [])
    assert "--no-enforce-eager" in served and served[served.index("--max-graph-batch-size") + 1] == "8"


@pytest.mark.parametrize(
    "enforce_eager, device_type, eager",
    [
        (None, "cpu", True),
        (None, "cuda", False),  # the default chooses by device
        (True, "cuda", True),
        (False, "cpu", False),  # a given value wins everywhere
    ],
)
def test_step_graphs_default_to_on_with_cuda_and_off_on_a_cpu(enforce_eager, device_type, eager):
    assert EngineConfig(enforce_eager=enforce_eager).eager_on(device_type) is eager


def test_enforce_eager_must_be_a_bool_or_none():
    with pytest.raises(ValueError, match=r"enforce_eager must be a bool or None \(by device\), got 'yes'"):
        EngineConfig(enforce_eager="yes")
