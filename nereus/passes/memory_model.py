"""memory_model: the device memory a message takes on its two GPUs during its round.

One model, shared by the scheduler (resources), the verifier (verify), the summary's
peak (cost.memory_peak), the JSON header (`memory_model`) and the runtime (its
accounting, nereus.runtime.wires.round_buffer_bytes, and rollback="auto"'s replay).
Input: a segment's bytes and whether its source shard lives in host memory (staged by a
`stage_out`, or an `offload` unit). Output: the bytes it costs on the source GPU and on
the destination GPU while its round runs. Invariant (cuda): for every round and GPU, the
device memory the CUDA runtime allocates for the round's messages (ring slots of the
packed streams, pieces read from host memory copied to the device whole, bounce tensors
of pieces written into host memory) is at most the sum of these costs.

Two kinds (`KINDS`):

- "cuda" (`CUDA`, what the compiler compiles for): every segment costs its packed bytes
  (its bytes rounded up to `ALIGN`, as the packed layout places it) on both GPUs, wherever
  its shards live. Why on the source too when the shard is in host memory: the CUDA
  runtime sends from device memory only, so a piece read from host memory either joins
  the peer's packed stream, whose ring slots are device memory, or, where it travels in
  place, is copied to the device whole first (nereus.runtime.wires.outgoing). A piece
  written into host memory lands in a ring slot or a bounce tensor likewise. Why the
  whole packed bytes and not the ring's limit (NEREUS_P2P_CHUNK_BYTES x NEREUS_P2P_DEPTH
  per peer and direction): which pieces travel in place is the runtime's lowering's
  choice (size, contiguity, both-way peers), which the compiler does not model, and a
  piece from host memory that travels in place takes its whole size. The bound holds for
  any chunk size and depth: a ring slot holds one chunk at a time, a chunk is packed
  pieces (or parts of one cut at a multiple of ALIGN bytes, nereus.runtime.streams), and
  joining the segments of a message into pieces never adds padding.
- "cpu" (`CPU`, the meaning of JSON v1 before the field; a program without it is read
  so): a segment costs its bytes on the destination, and on the source only when read
  from GPU memory (a send out of host memory packs in host memory). Exact for the gloo
  runtime, where host and device are one memory; on CUDA it undercounts every send out
  of a staged or offloaded shard.

Outside the model on a GPU (the cluster's `reserve` is for them): NCCL's own buffers
(not allocated through torch), the small tables the pack kernels upload, checksum
tensors of `verify=True`, and the caching allocator's rounding of every block to 512
bytes.
"""

from __future__ import annotations

CPU = "cpu"
CUDA = "cuda"
KINDS = (CUDA, CPU)
DEFAULT = CUDA  # what the compiler compiles for unless told otherwise
V1_DEFAULT = CPU  # what a program without the header field `memory_model` was proven for
FIELD = "memory_model"  # the JSON header field

# the packed layout aligns each piece to this many bytes (nereus.runtime.packing imports it)
ALIGN = 8


def packed(nbytes: int) -> int:
    """`nbytes` rounded up to ALIGN: a piece's room in a packed buffer."""
    return -(-nbytes // ALIGN) * ALIGN


def source_bytes(kind: str, nbytes: int, from_host: bool) -> int:
    """Device bytes a segment of `nbytes` costs on its source GPU in its round;
    `from_host`: its source shard lives in host memory (staged or offloaded)."""
    if kind == CPU:
        return 0 if from_host else nbytes
    return packed(nbytes)


def destination_bytes(kind: str, nbytes: int) -> int:
    """Device bytes a segment of `nbytes` costs on its destination GPU in its round."""
    return nbytes if kind == CPU else packed(nbytes)


def check_kind(kind) -> str:
    """`kind` when it names a model; ValueError (listing them) otherwise."""
    if kind not in KINDS:
        raise ValueError(f"unknown memory model {kind!r}: one of {', '.join(KINDS)}")
    return kind


_PADDING: dict = {}  # id(pieces) -> (pieces, model, states, per-kind padding)
_PADDING_MAX = 1 << 16


def xfer_padding(dag, x) -> int:
    """Bytes the packed layout adds to transfer `x` of `dag` (a `nereus.passes.dag.Xfer`,
    or a slice of one): the sum over its JSON segments (one per slot, piece and state)
    of `packed(bytes) - bytes`. 0 for the usual shapes (every segment a multiple of 8)."""
    per_kind = padding_per_kind(dag, x)
    if not any(per_kind):
        return 0
    from .layout import slot_counts

    counts = slot_counts(dag.stages[x.stage].model, *x.slots)
    return counts["first"] * per_kind[0] + counts["layer"] * per_kind[1] + counts["last"] * per_kind[2]


def padding_per_kind(dag, x) -> tuple:
    """(first, layer, last): the padding one slot of each kind of transfer `x` adds."""
    model = dag.stages[x.stage].model
    held = _PADDING.get(id(x.pieces))  # slices of a transfer share its pieces: one computation
    if held is None or held[0] is not x.pieces or held[1] is not model or held[2] != x.states:
        if len(_PADDING) >= _PADDING_MAX:  # a process compiling for long (the prover) keeps no old dags
            _PADDING.clear()
        held = _PADDING[id(x.pieces)] = (x.pieces, model, x.states, _padding_per_kind(model, x))
    return held[3]


_STATE_BYTES: dict = {}  # (id(model), states) -> (model, element bytes per state)


def state_bytes(dag, x) -> tuple:
    """The element bytes of each state `x` carries (one JSON segment per state)."""
    model = dag.stages[x.stage].model
    held = _STATE_BYTES.get((id(model), x.states))  # the scheduler asks per cut: ~10^5 times a compile
    if held is None or held[0] is not model:
        from nereus.ir.model import DTYPE_BYTES

        from .layout import suffix_dtype

        if len(_STATE_BYTES) >= _PADDING_MAX:
            _STATE_BYTES.clear()
        held = _STATE_BYTES[(id(model), x.states)] = (model, tuple(DTYPE_BYTES[suffix_dtype(model, s)]
                                                                   for s in x.states))
    return held[1]


def _padding_per_kind(model, x) -> tuple:
    """`padding_per_kind`, computed."""
    from nereus.ir.model import DTYPE_BYTES

    from .layout import box_volume, slot_specs, suffix_dtype

    specs = slot_specs(model)
    sizes = [DTYPE_BYTES[suffix_dtype(model, s)] for s in x.states]
    out = [0, 0, 0]
    for p in x.pieces:
        volume = box_volume(p.box)
        k = ("first", "layer", "last").index(specs[p.spec].kind)
        out[k] += sum(packed(volume * size) - volume * size for size in sizes)
    return tuple(out)


def xfer_costs(kind: str, dag, x, from_host: bool) -> tuple[int, int]:
    """(source GPU bytes, destination GPU bytes) of send `x` under model `kind` (the sum
    of `source_bytes` / `destination_bytes` over its segments)."""
    if kind == CPU:
        return (0 if from_host else x.bytes), x.bytes
    held = _DEVICE_BYTES.get(id(x))  # the scheduler asks again for a waiting send every round
    if held is None or held[0] is not x:
        if len(_DEVICE_BYTES) >= _PADDING_MAX:
            _DEVICE_BYTES.clear()
        held = _DEVICE_BYTES[id(x)] = (x, x.bytes + xfer_padding(dag, x))
    return held[1], held[1]


_DEVICE_BYTES: dict = {}  # id(transfer) -> (transfer, its device bytes under the cuda model)
