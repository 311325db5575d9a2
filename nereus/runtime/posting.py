"""Posting a round's point-to-point ops: which data group each goes over, in which order,
in how many batches. Input: the executor's wires (messages with their tensors); output:
the backend's requests. Invariant: the sender and the receiver of a message derive the
same per-peer op index, tag, group and batch for it, so gloo (tags) and NCCL (order per
communicator) match every op, and batches cannot deadlock.
"""

from __future__ import annotations


import torch.distributed as dist

from nereus.ir.diagnostics import env_flag, env_number


def p2p_ops(wires: list, fn, groups) -> list:
    """[(index, op)]: the p2p ops of the direct pieces of some messages (the packed
    pieces travel in per-peer streams, see streams.py), each with its index among this
    direction's ops to the same peer. Tags are those indices, which the sender and the
    receiver enumerate identically (gloo matches on tags, NCCL on order). With several
    data groups (communicators), op `index` goes over group index % len(groups): each
    group sees a subsequence in the same order on both sides, and the groups' streams
    move their ops concurrently."""
    groups = groups if isinstance(groups, (list, tuple)) else [groups]
    ops, count = [], {}
    for w in wires:
        for t in w.direct:
            n = count.get(w.msg.peer, 0)
            count[w.msg.peer] = n + 1
            ops.append((n, dist.P2POp(fn, t, w.msg.peer, groups[n % len(groups)], n)))
    return ops


# How a round's ops are handed to the backend. P2P_BATCH > 0 posts them in batches of the
# ops whose per-peer index falls in the same block of P2P_BATCH: the matching op of a peer
# then sits in the batch of the same number there, so NCCL cannot deadlock, and the first
# batch starts moving while the host still posts the next. P2P_INTERLEAVE alternates sends
# and receives within a batch. (Environment: NEREUS_P2P_BATCH, NEREUS_P2P_INTERLEAVE.)
P2P_BATCH = env_number("NEREUS_P2P_BATCH", 0, 0)
P2P_INTERLEAVE = env_flag("NEREUS_P2P_INTERLEAVE", False)


def post(sends: list, recvs: list) -> list:
    """Post [(index, op)] sends and receives (see P2P_BATCH), one batch per (block, group)
    (a batch holds ops of one group); returns the requests."""
    if not sends and not recvs:
        return []
    block = (lambda n: n // P2P_BATCH) if P2P_BATCH > 0 else (lambda n: 0)
    if P2P_INTERLEAVE:
        merged = [x for pair in zip(sends, recvs) for x in pair]
        merged += sends[len(recvs):] + recvs[len(sends):]
    else:
        merged = sends + recvs
    batches: dict = {}
    order: dict = {}
    for n, op in merged:
        key = (block(n), order.setdefault(id(op.group), len(order)))
        batches.setdefault(key, []).append(op)
    requests = []
    for key in sorted(batches):
        requests += dist.batch_isend_irecv(batches[key])
    return requests
