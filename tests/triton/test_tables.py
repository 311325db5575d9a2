"""Host half of the kernels: box normalisation into word pieces and the tile tables
(pure integers and CPU tensors; no interpreter)."""

from __future__ import annotations

import random

import torch

from nereus.backends.triton.segments import Piece, normalize_pair
from nereus.backends.triton.tables import build_launches


def test_full_rows_of_a_contiguous_tensor_are_one_run():
    # rows 10..19 of a contiguous [64, 4096] bf16 tensor at a 16-byte aligned address
    pieces = normalize_pair([10, 4096], [4096, 1], [4096, 1], 4096 * 1000, 0, 2)
    assert pieces == [Piece(word=8, vec=2, src=512_000, dst=0, rows=1, inner=10_240, src_s=10_240, dst_s=10_240)]


def test_row_shard_box_is_strided_rows_of_words():
    # the TP4 piece of a TP2 row-sharded [4096, 2048] bf16 shard: all rows, columns 1024..2047
    base = 1 << 20
    (piece,) = normalize_pair([4096, 1024], [2048, 1], [1024, 1], base + 1024 * 2, 0, 2)
    assert (piece.word, piece.vec, piece.rows, piece.inner) == (8, 2, 4096, 256)
    assert (piece.src_s, piece.dst_s) == (512, 256)
    assert piece.src * 8 == base + 2048


def test_alignment_decides_word_and_vectors():
    (odd,) = normalize_pair([3, 5], [7, 1], [5, 1], 2, 0, 2)  # bf16, 2-byte aligned only
    assert (odd.word, odd.vec) == (2, 1)
    (eight,) = normalize_pair([4, 4], [8, 1], [4, 1], 8, 0, 4)  # fp32 rows of 16 bytes at 8
    assert (eight.word, eight.vec) == (8, 1)


def test_addresses_past_2_31_elements_are_exact():
    start = (2**31 + 12345 * 2048) * 2  # byte offset of a row past 2**31 bf16 elements
    base = 1 << 44
    (piece,) = normalize_pair([6, 1000], [2048, 1], [1000, 1], base + start + 100 * 2, 0, 2)
    assert piece.src * piece.word == base + start + 200
    launch, = build_launches([piece], anchor=base - (1 << 36), rel="dst")
    assert int(launch.segments[0, 0]) * launch.word == start + 200 + (1 << 36)


def test_strided_last_dim_and_3d_boxes_split_into_pieces():
    # a transposed view: last dim stride 7 elements -> one-element runs, one piece per row
    pieces = normalize_pair([3, 4], [1, 7], [4, 1], 0, 0, 4)
    assert len(pieces) == 3 and all(p.inner * p.word == 4 and p.rows == 4 for p in pieces)
    # a 3-D box whose dims do not merge: one piece per outermost index
    pieces = normalize_pair([2, 3, 8], [100, 10, 1], [24, 8, 1], 0, 0, 2)
    assert [p.src * p.word for p in pieces] == [0, 200]
    assert normalize_pair([2, 0, 3], [1, 1, 1], [1, 1, 1], 0, 0, 4) == []


def covered(launch) -> dict[tuple[int, int], int]:
    """Replay the kernel's indexing on the host: (piece row, word) -> times written."""
    seen: dict[tuple[int, int], int] = {}
    seg = launch.segments.tolist()
    for piece, local in launch.tiles.tolist():
        _, dst, _, rows, inner, _, dst_s, col_tiles, _ = seg[piece]
        row_tile, col_tile = divmod(local, col_tiles)
        for r in range(row_tile * launch.rows, (row_tile + 1) * launch.rows):
            for c in range(col_tile * launch.cols, (col_tile + 1) * launch.cols):
                if r < rows and c < inner:
                    word = dst + r * dst_s + c
                    seen[word] = seen.get(word, 0) + 1
    return seen


def test_tiles_write_every_destination_word_exactly_once():
    rng = random.Random(3)
    pieces, expected, at = [], set(), 0
    for _ in range(30):
        rows, inner = rng.choice([(1, rng.randint(1, 900)), (rng.randint(1, 40), rng.randint(1, 90))])
        stride = inner + rng.randint(0, 5)
        pieces.append(Piece(8, 1, 0, at, rows, inner, stride, stride))
        expected |= {at + r * stride + c for r in range(rows) for c in range(inner)}
        at += rows * stride + 3
    for tile in (None, (4, 16), (1, 64)):
        (launch,) = build_launches(pieces, anchor=0, force_tile=tile)
        seen = covered(launch)
        assert set(seen) == expected and set(seen.values()) == {1}


def test_tile_choice_fits_the_pieces():
    small = [Piece(8, 2, 0, 0, 1, 512, 512, 512)] * 100  # 4 KiB runs
    (launch,) = build_launches(small, anchor=0)
    assert launch.rows * launch.cols == 512 and launch.tiles.shape[0] == 100
    strided = [Piece(8, 2, 0, 0, 4096, 256, 512, 256)]  # 2 KiB rows
    (launch,) = build_launches(strided, anchor=0)
    assert launch.cols == 256 and launch.tiles.shape[0] == 4096 // launch.rows
    assert torch.equal(launch.tiles[:, 0], torch.zeros(launch.tiles.shape[0], dtype=torch.int32))


def test_the_python_and_torch_tile_searches_choose_alike():
    from collections import Counter

    from hypothesis import given, settings, strategies as st

    from nereus.backends.triton.tables import _choose_tile_python, _choose_tile_torch

    shape = st.tuples(st.integers(1, 5000), st.integers(1, 1 << 20))

    @settings(max_examples=200, deadline=None)
    @given(st.dictionaries(shape, st.integers(1, 1000), min_size=1, max_size=12))
    def same(counts):
        assert _choose_tile_python(Counter(counts)) == _choose_tile_torch(Counter(counts))

    same()


def test_launch_classes_name_the_launches_without_building_them():
    from hypothesis import given, settings, strategies as st

    from nereus.backends.triton.tables import launch_classes

    piece = st.builds(lambda word, vec, rows, inner, pad: Piece(word, vec, 0, 0, rows, inner, inner + pad, inner),
                      st.sampled_from((1, 2, 4, 8)), st.integers(1, 2), st.integers(1, 300), st.integers(1, 5000),
                      st.integers(0, 7))

    @settings(max_examples=100, deadline=None)
    @given(st.lists(piece, min_size=1, max_size=20), st.sampled_from((None, (4, 16))), st.integers(1, 2))
    def same(pieces, tile, max_vec):
        launches = build_launches(pieces, anchor=0, force_tile=tile, max_vec=max_vec)
        assert launch_classes(pieces, tile, max_vec) == [(x.word, x.vec, x.rows, x.cols) for x in launches]

    same()
