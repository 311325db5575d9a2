"""What a rank's own checks of its part cost (issue 41, nereus.runtime.part_check), against
what the rank pays for that part anyway: compiling the transition and emitting its part
(`nereusc FILE --transition S1:S2 --emit json --rank R`), and lowering the part into its
work list (`nereus.runtime.program.rank_program`, which runs the checks).

    python benchmarks/part_check_cost.py examples/moe-235b-256.nir --rank 0 [--repeat 3]

Per repeat, with every lru cache of the lowering and of the checks cleared first (a
part's first lowering in a process): CPU seconds (time.process_time, one thread) of
`check_writes` on the part (every element of the rank's new shards written once), of
`pair_digests` on its lowered work list (the messages' digests the agreement compares),
and of `rank_program` with both checks replaced by no-ops (the lowering alone). The
compile and emit run once. Medians of the repeats.

Last stdout line: {"name": "part_check_cost", "file", "transition", "rank", "segments",
"pieces", "part_bytes", "compile_emit_s", "lower_s", "check_writes_s", "pair_digests_s",
"check_fraction_of_lower", "check_fraction_of_compile_emit", "repeats"}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import nereus.ir as ir
from nereus.backends.rank_json import canonical_json
from nereus.ir.program import expand_ranges, expand_segment_units
from nereus.runtime import part_check, pieces, program


def _clear_caches() -> None:
    for cached in (part_check._box_hash, part_check._power, part_check._box_text, part_check._range_sum,
                   part_check._names_text, pieces.geometry, pieces.shape):
        cached.cache_clear()


def _cpu(fn, *args):
    started = time.process_time()
    value = fn(*args)
    return time.process_time() - started, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", help="a .nir file")
    parser.add_argument("--transition", help="S1:S2 (default: the file's first transition)")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    from nereus.backends.proof import rank_part
    from nereus.passes import compile_transition

    module = ir.parse_file(args.file)
    if args.transition:
        source, target = args.transition.split(":")
    else:
        source, target = module.transitions[0].source, module.transitions[0].target
    compile_s, part = _cpu(lambda: rank_part(compile_transition(module, source, target), args.rank))
    text = canonical_json(part)
    expanded = expand_segment_units(expand_ranges(json.loads(text)))  # as rank_program reads it
    figures: dict = {"check_writes_s": [], "pair_digests_s": [], "lower_s": []}
    checks = program.check_writes, program.pair_digests
    for _ in range(args.repeat):
        _clear_caches()
        seconds, _ = _cpu(part_check.check_writes, expanded, args.rank)
        figures["check_writes_s"].append(seconds)
        _clear_caches()
        program.check_writes, program.pair_digests = (lambda *a: None), (lambda *a: ())
        try:
            seconds, work = _cpu(program.rank_program, json.loads(text), args.rank)
        finally:
            program.check_writes, program.pair_digests = checks
        figures["lower_s"].append(seconds)
        _clear_caches()
        seconds, _ = _cpu(part_check.pair_digests, work.rounds, args.rank)
        figures["pair_digests_s"].append(seconds)
    out = {name: statistics.median(values) for name, values in figures.items()}
    checks_s = out["check_writes_s"] + out["pair_digests_s"]
    print(json.dumps({
        "name": "part_check_cost", "file": args.file, "transition": f"{source}:{target}", "rank": args.rank,
        "segments": sum(len(op.get("segments", ())) for rnd in expanded["rounds"] for op in rnd["ops"]),
        "pieces": sum(len(m.pieces) for w in work.rounds for m in w.sends + w.recvs) +
        sum(len(w.copies) for w in work.rounds),
        "part_bytes": len(text), "compile_emit_s": compile_s, **out,
        "check_fraction_of_lower": checks_s / out["lower_s"], "check_fraction_of_compile_emit": checks_s / compile_s,
        "repeats": figures}))


if __name__ == "__main__":
    main()
