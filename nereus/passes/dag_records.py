"""The records of a transition DAG (nereus.passes.dag): `Piece`, `Alloc`, `Free`, `Xfer`.

Apart from dag.py so that the builders of both kinds of model-stage (dag for the
architecture families, dag_mesh for mesh layouts) make the same records without importing
each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from .layout import Box


@dataclass(frozen=True, slots=True)
class Piece:
    """A box of the tensor pattern `spec` (index into `slot_specs(model)`), repeated for
    every slot of the op's range that holds that pattern."""

    spec: int
    box: Box


@dataclass(frozen=True, slots=True)
class Alloc:
    stage: int  # index into TransitionDag.stages
    replica: int
    pos: tuple[int, int]  # (pp stage, tp rank)
    gpu: int
    bytes: int  # shard bytes minus bytes kept in place
    shard_bytes: int


@dataclass(frozen=True, slots=True)
class Free:
    stage: int
    replica: int
    pos: tuple[int, int]
    gpu: int
    bytes: int  # shard bytes minus bytes handed over in place (kept)
    shard_bytes: int


@dataclass(frozen=True, slots=True)
class Xfer:
    kind: str  # keep | copy | send
    stage: int
    alloc: int  # index of the destination Alloc
    free: int  # index of the source Free
    src_gpu: int
    dst_gpu: int
    slots: tuple[int, int]  # half-open slot range
    pieces: tuple[Piece, ...]
    bytes: int
    volumes: tuple[int, int, int]  # elements per slot of each kind (first, layer, last), one state
    states: tuple[str, ...]  # tensor suffixes carried ("" weights, "#master", ...)
