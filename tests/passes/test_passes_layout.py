"""Layouts: exact boxes (GQA included), full coverage per replica, byte counts."""

import itertools

import pytest

from builders import llama, place
from nereus.models import tensor_table
from nereus.passes.layout import (box_volume, gpu_shards, shard_bytes, stage_slots, tensor_entries, tp_boxes,
                                  WITH_OPTIMIZER)

# hidden 64, 16 heads of 4, 4 KV heads: qkv is [64 q | 16 k | 16 v] x 64
MODEL = llama("actor", layers=5, hidden=64, heads=16, kv_heads=4, ffn=96, vocab=128)
QKV = next(t for t in tensor_table(MODEL) if t.name == "layers.0.attn.qkv.weight")


@pytest.mark.parametrize("tp, rank, expected", [
    (2, 1, [(32, 64), (72, 80), (88, 96)]),
    (4, 3, [(48, 64), (76, 80), (92, 96)]),
    (16, 5, [(20, 24), (68, 72), (84, 88)]),   # tp > kv_heads: KV head 1 on ranks 4..7
    (16, 4, [(16, 20), (68, 72), (84, 88)]),
    (8, 7, [(56, 64), (76, 80), (92, 96)]),    # 2 ranks per KV head
])
def test_qkv_boxes_by_hand(tp, rank, expected):
    boxes = tp_boxes(QKV, tp, rank)
    assert [b[0] for b in boxes] == expected
    assert all(b[1] == (0, 64) for b in boxes)


def test_row_and_vocab_split():
    o = next(t for t in tensor_table(MODEL) if t.name == "layers.0.attn.o.weight")
    embed = next(t for t in tensor_table(MODEL) if t.name == "embed.weight")
    assert tp_boxes(o, 4, 2) == (((0, 64), (32, 48)),)
    assert tp_boxes(embed, 4, 1) == (((32, 64), (0, 64)),)


def test_stage_slots_put_embed_first_and_head_last():
    assert [stage_slots(5, 2, p) for p in range(2)] == [(0, 4), (4, 7)]
    assert stage_slots(5, 1, 0) == (0, 7)


@pytest.mark.parametrize("tp, pp", list(itertools.product([1, 2, 4, 8, 16], [1, 2, 3])))
def test_every_replica_covers_every_tensor_exactly(tp, pp):
    placement = place("actor.training", 2, tp, pp, range(2 * tp * pp))
    shapes = {name: shape for name, shape, _ in tensor_entries(MODEL, WITH_OPTIMIZER)}
    for r in range(2):
        seen: dict[str, set] = {}
        for p in range(pp):
            for t in range(tp):
                for name, boxes in gpu_shards(MODEL, placement, p, t):
                    assert all(b[1:] == boxes[0][1:] for b in boxes)  # local shard contract
                    seen.setdefault(name, set()).update(boxes)
        assert set(seen) == set(shapes)
        for name, boxes in seen.items():
            boxes = sorted(boxes)
            for x, y in itertools.combinations(boxes, 2):  # identical copies collapse, the rest is disjoint
                assert any(b <= c or d <= a for (a, b), (c, d) in zip(x, y)), (name, x, y)
            full = 1
            for n in shapes[name]:
                full *= n
            assert sum(box_volume(b) for b in boxes) == full, name


def test_shard_bytes_match_expanded_shards():
    placement = place("actor.training", 1, 4, 2, range(8))
    for p, t in itertools.product(range(2), range(4)):
        expanded = sum(box_volume(b) * (4 if "#" in name else 2) for name, boxes in gpu_shards(MODEL, placement, p, t)
                       for b in boxes)
        assert shard_bytes(MODEL, placement, p, t) == expanded
    gen = place("actor.generation", 1, 4, 1, range(4))
    train = place("actor.training", 1, 4, 1, range(4))
    assert shard_bytes(MODEL, train, 0, 1) == shard_bytes(MODEL, gen, 0, 1) * 7  # (2 + 3 x 4) bytes vs 2
