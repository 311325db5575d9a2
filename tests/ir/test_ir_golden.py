"""Golden tests: the canonical print of tests/ir/golden/sample.nir (sample.canonical.nir),
and its formatted text with comments kept (sample.formatted.nir, what `nereusc fmt` writes).

Rewrite the golden file after an intended printer change with
`pytest tests/ir --update-golden` or `NEREUS_UPDATE_GOLDEN=1 pytest tests/ir`."""

from pathlib import Path

import nereus.ir as ir

GOLDEN = Path(__file__).parent / "golden"


def test_canonical_print_matches_golden(update_golden):
    module = ir.parse_file(GOLDEN / "sample.nir")
    printed = ir.print_module(module)
    expected_path = GOLDEN / "sample.canonical.nir"
    if update_golden:
        expected_path.write_text(printed, encoding="utf-8")
    assert printed == expected_path.read_text(encoding="utf-8")


def test_formatted_source_keeps_comments_matches_golden(update_golden):
    source = (GOLDEN / "sample.nir").read_text(encoding="utf-8")
    formatted = ir.format_source(source, "sample.nir")
    expected_path = GOLDEN / "sample.formatted.nir"
    if update_golden:
        expected_path.write_text(formatted, encoding="utf-8")
    assert formatted == expected_path.read_text(encoding="utf-8")
    assert ir.format_source(formatted) == formatted
    assert ir.parse_source(formatted) == ir.parse_source(source)
    # no comment is lost or invented
    def comments(text):
        return sorted(line[line.index("#"):].rstrip() for line in text.splitlines() if "#" in line)
    assert comments(formatted) == comments(source)


def test_golden_is_a_fixed_point_and_means_the_same():
    canonical = (GOLDEN / "sample.canonical.nir").read_text(encoding="utf-8")
    original = ir.parse_file(GOLDEN / "sample.nir")
    reparsed = ir.parse_source(canonical, "sample.canonical.nir")
    assert reparsed == original
    assert ir.print_module(reparsed) == canonical


def test_sample_resolves_every_gpu_set_form():
    module = ir.parse_file(GOLDEN / "sample.nir")
    s1 = module.plan("S1")
    assert s1.placement("ref.inference").gpus == tuple(range(16))  # n0..n1, n2:0..3, n3
    assert s1.placement("critic.inference").gpus == tuple(range(15, -1, -1))  # 15..0
    assert s1.placement("ref2.inference").gpus == (3, 2, 1, 0, 7, 6, 5, 4)
    assert s1.placement("tiny.inference").gpus == (15,)  # n3:3 with 4 GPUs a node
    assert s1.placement("critic.training").gpus == tuple(g for n in (3, 2, 1, 0) for g in range(4 * n, 4 * n + 4))


def test_sample_aliases_and_inheritance():
    module = ir.parse_file(GOLDEN / "sample.nir")
    ref2, actor, critic = module.model("ref2"), module.model("actor"), module.model("critic")
    assert (ref2.base, ref2.dtype, ref2.layers, ref2.head) == ("ref", "fp16", 32, "lm")
    assert (critic.base, critic.dtype, critic.head, critic.ffn) == ("actor", "bf16", "value", actor.ffn)
    s1, s2, s3 = module.plan("S1"), module.plan("S2"), module.plan("S3")
    assert [str(p.model_stage) for p in s2.declared] == ["actor.training"]
    assert s2.placement("actor.training").dp == 2 and s1.placement("actor.training").dp == 1
    assert s3.declared == () and s3.placements == s2.placements
    # placements follow workload order: generation, inference (as listed), training
    assert [str(p.model_stage) for p in s1.placements] == [
        "actor.generation", "ref.inference", "critic.inference", "ref2.inference", "tiny.inference",
        "actor.training", "critic.training"]
    assert module.cluster.reserve == 0.075 and module.cluster.gpu.mem_bytes == 80 * 2**30
    assert module.workload.recompute == "full"
