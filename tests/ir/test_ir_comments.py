"""format_source keeps comments next to what they annotate through reformatting."""

import nereus.ir as ir

SOURCE = """# header

cluster c { nodes 1 gpus_per_node 2   # two GPUs
  gpu { mem 80GB flops 1TFLOPS hbm 1TB/s }
  intra 1GB/s inter 1GB/s host_mem 1TB
  reserve 0%   # nothing kept free
}
transition a -> b   # declared before its plans
model m = llama { layers 2 hidden 64 heads 4 kv_heads 4 ffn 64 vocab 64 }
workload w {
  # counts
  batch 4 prompt 1 response 1 microbatch 1
  training: m   # only training
}
plan a {
  # the first plan
  m.training dp 2 on 0..1   # both GPUs
  # last line of plan a
}
plan b = a {
}
# trailing words
"""

EXPECTED = """# header

cluster c {
  nodes 1
  gpus_per_node 2  # two GPUs
  gpu { mem 80GB  flops 1TFLOPS  hbm 1TB/s }
  intra 1GB/s
  inter 1GB/s
  host_mem 1TB
  # nothing kept free
}

model m = llama { layers 2 hidden 64 heads 4 kv_heads 4 ffn 64 vocab 64 dtype bf16 }

workload w {
  # counts
  batch 4  prompt 1  response 1  microbatch 1
  training: m  # only training
}

plan a {
  # the first plan
  m.training  dp 2  on 0..1  # both GPUs
  # last line of plan a
}

plan b = a { }

transition a -> b  # declared before its plans

# trailing words
"""


def test_comments_follow_their_anchors():
    assert ir.format_source(SOURCE) == EXPECTED


def test_formatting_is_idempotent_and_keeps_meaning():
    assert ir.format_source(EXPECTED) == EXPECTED
    assert ir.parse_source(EXPECTED) == ir.parse_source(SOURCE)


def test_print_module_has_no_comments():
    printed = ir.print_module(ir.parse_source(SOURCE))
    assert "#" not in printed
    assert ir.format_source(printed) == printed


def test_overrides_with_comments():
    text = ir.format_source(SOURCE, overrides=["workload.batch=8"])
    assert "  # counts\n  batch 8  prompt 1" in text


MODEL_BLOCK = """cluster c { nodes 1 gpus_per_node 2 gpu { mem 80GB flops 1TFLOPS hbm 1TB/s }
  intra 1GB/s inter 1GB/s host_mem 1TB }
model actor = llama {
  layers 4
  # actor: 8 heads, GQA
  hidden 64 heads 8 kv_heads 2 ffn 128 vocab 256
}
model critic = actor { head value }
workload w { batch 4 prompt 1 response 1 microbatch 1 training: actor, critic }
plan a { actor.training dp 2 on 0..1  critic.training dp 2 on 0..1 }
"""


def test_a_comment_inside_a_model_block_stays_with_that_model():
    """A model prints on one line, so a comment on a line of its own inside its block goes
    above it, not above the next declaration (it would seem to describe that one)."""
    text = ir.format_source(MODEL_BLOCK)
    lines = text.splitlines()
    at = lines.index("# actor: 8 heads, GQA")
    assert lines[at + 1].startswith("model actor ") and "= llama {" in lines[at + 1]
    assert ir.format_source(text) == text


def test_a_header_comment_stays_at_the_top_when_the_first_declaration_moves():
    """The canonical order puts transitions last: a file's header comment above a first
    `transition` stays the file's header."""
    source = "# file header: the ppo plans\n\ntransition a -> b\n" + MODEL_BLOCK + "plan b = a { }\n"
    text = ir.format_source(source)
    assert text.startswith("# file header: the ppo plans\n\ncluster c {")
    assert text.rstrip().endswith("transition a -> b")
    assert ir.format_source(text) == text
