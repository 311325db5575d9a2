"""Malformed `.nir` inputs: each asserts the EXACT error text (location, message, quoted
line, caret, hint). Each case edits a valid base program by string replacement, so the
line numbers below refer to BASE after the edit."""

import pytest

import nereus.ir as ir

BASE = """cluster c {
  nodes 2
  gpus_per_node 4
  gpu { mem 80GB flops 989TFLOPS hbm 3.35TB/s }
  intra 900GB/s
  inter 25GB/s
  host_mem 1TB
}
model actor = llama { layers 4 hidden 256 heads 8 kv_heads 2 ffn 512 vocab 1024 }
model critic = actor { head value }
workload w {
  batch 8 prompt 16 response 16 microbatch 2
  generation: actor
  training: actor, critic
}
plan A {
  actor.generation dp 2 tp 4 on 0..7
  actor.training dp 2 tp 2 pp 2 on n0..n1
  critic.training dp 4 tp 2 on 0..7
}
plan B = A {
  actor.training dp 8 on 7..0
}
transition A -> B
"""

# (name, [(old, new), ...] or None for a whole text, expected error text)
CASES = [
    ('unknown_cluster_key', [('  intra 900GB/s', '  intra 900GB/s\n  intar 1GB/s')], None,
     "\n".join([
         "t.nir:6:3: error: unknown key 'intar' in cluster 'c'",
         '    6 |   intar 1GB/s',
         '      |   ^^^^^',
         "hint: did you mean 'intra'? cluster 'c' takes 'nodes', 'gpus_per_node', 'gpu', 'intra', 'inter', 'host_mem' or 'reserve'"])),
    ('duplicate_cluster_key', [('  nodes 2\n', '  nodes 2\n  nodes 3\n')], None,
     "\n".join([
         "t.nir:3:3: error: 'nodes' is given twice in cluster 'c'",
         '    3 |   nodes 3',
         '      |   ^^^^^',
         'hint: the first is at 2:3; keep one'])),
    ('missing_cluster_key', [('  host_mem 1TB\n', '')], None,
     "\n".join([
         "t.nir:1:9: error: cluster 'c' is missing 'host_mem'",
         '    1 | cluster c {',
         '      |         ^',
         'hint: add it, e.g. host_mem 2TB'])),
    ('size_without_unit', [('mem 80GB', 'mem 80')], None,
     "\n".join([
         't.nir:4:13: error: mem needs a unit',
         '    4 |   gpu { mem 80 flops 989TFLOPS hbm 3.35TB/s }',
         '      |             ^^',
         'hint: write it like 141GB or 80GiB; units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB'])),
    ('unknown_size_unit', [('mem 80GB', 'mem 80GX')], None,
     "\n".join([
         "t.nir:4:13: error: unknown unit 'GX' for mem",
         '    4 |   gpu { mem 80GX flops 989TFLOPS hbm 3.35TB/s }',
         '      |             ^^^^',
         'hint: units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB'])),
    ('unit_after_space', [('host_mem 1TB', 'host_mem 1 TB')], None,
     "\n".join([
         't.nir:7:14: error: a unit must follow its number without a space',
         '    7 |   host_mem 1 TB',
         '      |              ^^',
         'hint: write 1TB, not 1 TB'])),
    ('rate_with_size_unit', [('intra 900GB/s', 'intra 900GB')], None,
     "\n".join([
         "t.nir:5:9: error: unknown unit 'GB' for intra",
         '    5 |   intra 900GB',
         '      |         ^^^^^',
         'hint: units: B/s, KB/s, MB/s, GB/s, TB/s'])),
    ('fractional_bytes', [('host_mem 1TB', 'host_mem 1.5B')], None,
     "\n".join([
         't.nir:7:12: error: host_mem 1.5B is not a whole number of bytes',
         '    7 |   host_mem 1.5B',
         '      |            ^^^^',
         'hint: write it like host_mem 2TB'])),
    ('zero_nodes', [('nodes 2', 'nodes 0')], None,
     "\n".join([
         't.nir:2:9: error: nodes must be at least 1, found 0',
         '    2 |   nodes 0',
         '      |         ^',
         'hint: write nodes 1 or more'])),
    ('negative_gpus_per_node', [('gpus_per_node 4', 'gpus_per_node -4')], None,
     "\n".join([
         't.nir:3:17: error: gpus_per_node must be at least 1, found -4',
         '    3 |   gpus_per_node -4',
         '      |                 ^^',
         'hint: write gpus_per_node 1 or more'])),
    ('reserve_too_large', [('  host_mem 1TB\n', '  host_mem 1TB\n  reserve 100%\n')], None,
     "\n".join([
         't.nir:8:11: error: reserve must be at least 0% and below 100%, found 100%',
         '    8 |   reserve 100%',
         '      |           ^^^^',
         "hint: the share of each GPU's memory kept free, e.g. reserve 5%"])),
    ('unknown_architecture', [('= llama {', '= lama {')], None,
     "\n".join([
         "t.nir:9:15: error: unknown model or architecture 'lama'",
         '    9 | model actor = lama { layers 4 hidden 256 heads 8 kv_heads 2 ffn 512 vocab 1024 }',
         '      |               ^^^^',
         "hint: did you mean 'llama'? architectures: llama, qwen2, qwen3, qwen3_moe, tensors; models: actor, critic"])),
    ('alias_of_unknown_model', [('critic = actor', 'critic = actr')], None,
     "\n".join([
         "t.nir:10:16: error: unknown model or architecture 'actr'",
         '   10 | model critic = actr { head value }',
         '      |                ^^^^',
         "hint: did you mean 'actor'? architectures: llama, qwen2, qwen3, qwen3_moe, tensors; models: actor, critic"])),
    ('alias_cycle', [('model actor = llama { layers 4 hidden 256 heads 8 kv_heads 2 ffn 512 vocab 1024 }', 'model actor = critic')], None,
     "\n".join([
         't.nir:10:16: error: model alias cycle: actor -> critic -> actor',
         '   10 | model critic = actor { head value }',
         '      |                ^^^^^',
         'hint: one model of the cycle must be declared with an architecture (= llama {...})'])),
    ('duplicate_model', [('model critic = actor { head value }', 'model critic = actor { head value }\nmodel actor = critic')], None,
     "\n".join([
         "t.nir:11:7: error: model 'actor' is declared twice",
         '   11 | model actor = critic',
         '      |       ^^^^^',
         'hint: the first is at 9:7; rename one'])),
    ('missing_model_key', [(' ffn 512 vocab', ' vocab')], None,
     "\n".join([
         "t.nir:9:7: error: model 'actor' is missing 'ffn'",
         '    9 | model actor = llama { layers 4 hidden 256 heads 8 kv_heads 2 vocab 1024 }',
         '      |       ^^^^^',
         'hint: add it, e.g. ffn 14336'])),
    ('bad_dtype', [('vocab 1024 }', 'vocab 1024 dtype fp8 }')], None,
     "\n".join([
         "t.nir:9:87: error: dtype must be 'bf16', 'fp16' or 'fp32', found 'fp8'",
         '    9 | model actor = llama { layers 4 hidden 256 heads 8 kv_heads 2 ffn 512 vocab 1024 dtype fp8 }',
         '      |                                                                                       ^^^',
         "hint: did you mean 'fp32'?"])),
    ('hidden_not_divisible', [('hidden 256 heads 8', 'hidden 250 heads 8')], None,
     "\n".join([
         't.nir:9:39: error: hidden 250 must be divisible by heads (8)',
         '    9 | model actor = llama { layers 4 hidden 250 heads 8 kv_heads 2 ffn 512 vocab 1024 }',
         '      |                                       ^^^',
         'hint: head_dim = hidden / heads must be whole; e.g. hidden 248, or give head_dim'])),
    ('kv_heads_not_dividing', [('kv_heads 2', 'kv_heads 3')], None,
     "\n".join([
         't.nir:9:60: error: kv_heads 3 must divide heads (8)',
         '    9 | model actor = llama { layers 4 hidden 256 heads 8 kv_heads 3 ffn 512 vocab 1024 }',
         '      |                                                            ^',
         'hint: each KV head serves heads / kv_heads query heads; use one of 1, 2, 4, 8'])),
    ('unknown_stage_key', [('  generation: actor', '  generaton: actor')], None,
     "\n".join([
         "t.nir:13:3: error: unknown key 'generaton:' in workload 'w'",
         '   13 |   generaton: actor',
         '      |   ^^^^^^^^^',
         "hint: did you mean 'generation:'? workload 'w' takes 'batch', 'prompt', 'response', 'microbatch', 'recompute', 'generation:', 'inference:' or 'training:'"])),
    ('stage_twice', [('  training: actor, critic\n', '  training: actor, critic\n  training: actor\n')], None,
     "\n".join([
         "t.nir:15:3: error: 'training' is given twice in workload 'w'",
         '   15 |   training: actor',
         '      |   ^^^^^^^^',
         'hint: the first is at 14:3; keep one'])),
    ('workload_unknown_model', [('training: actor, critic', 'training: actor, critc')], None,
     "\n".join([
         "t.nir:14:20: error: unknown model 'critc' in training",
         '   14 |   training: actor, critc',
         '      |                    ^^^^^',
         'hint: models: actor, critic'])),
    ('model_twice_in_stage', [('training: actor, critic', 'training: actor, actor')], None,
     "\n".join([
         "t.nir:14:20: error: model 'actor' is listed twice in training",
         '   14 |   training: actor, actor',
         '      |                    ^^^^^',
         'hint: list it once'])),
    ('microbatch_above_batch', [('microbatch 2', 'microbatch 16')], None,
     "\n".join([
         't.nir:12:44: error: microbatch 16 is larger than batch 8',
         '   12 |   batch 8 prompt 16 response 16 microbatch 16',
         '      |                                            ^^',
         'hint: use a microbatch of at most 8'])),
    ('second_workload', [('transition A -> B\n', 'transition A -> B\nworkload v { batch 1 prompt 1 response 1 microbatch 1 }\n')], None,
     "\n".join([
         't.nir:25:1: error: a second workload is declared',
         '   25 | workload v { batch 1 prompt 1 response 1 microbatch 1 }',
         '      | ^^^^^^^^',
         "hint: a .nir file declares exactly one workload; the first, 'w', is at 11:1"])),
    ('tp_not_dividing_heads', [('actor.training dp 2 tp 2 pp 2 on n0..n1', 'actor.training dp 1 tp 3 pp 2 on 0..5')], None,
     "\n".join([
         't.nir:18:26: error: tp 3 must divide heads (8) of actor',
         '   18 |   actor.training dp 1 tp 3 pp 2 on 0..5',
         '      |                          ^',
         'hint: tp values that fit actor: 1, 2, 4, 8'])),
    ('tp_above_kv_not_multiple', [('hidden 256 heads 8 kv_heads 2 ffn 512 vocab 1024', 'hidden 384 heads 12 kv_heads 4 ffn 768 vocab 1536'), ('actor.generation dp 2 tp 4 on 0..7', 'actor.generation dp 1 tp 6 on 0..5')], None,
     "\n".join([
         't.nir:17:28: error: tp 6 is above kv_heads (4) of actor but not a multiple of it',
         '   17 |   actor.generation dp 1 tp 6 on 0..5',
         '      |                            ^',
         'hint: each KV head is replicated on tp / kv_heads ranks; tp values that fit actor: 1, 2, 4, 12'])),
    ('tp_not_dividing_kv', [('hidden 256 heads 8 kv_heads 2 ffn 512 vocab 1024', 'hidden 384 heads 12 kv_heads 4 ffn 768 vocab 1536'), ('actor.generation dp 2 tp 4 on 0..7', 'actor.generation dp 2 tp 3 on 0..5')], None,
     "\n".join([
         't.nir:17:28: error: tp 3 must divide kv_heads (4) of actor',
         '   17 |   actor.generation dp 2 tp 3 on 0..5',
         '      |                            ^',
         'hint: tp values that fit actor: 1, 2, 4, 12'])),
    ('tp_not_dividing_ffn', [('ffn 512', 'ffn 516'), ('actor.generation dp 2 tp 4 on 0..7', 'actor.generation dp 1 tp 8 on 0..7')], None,
     "\n".join([
         't.nir:17:28: error: tp 8 must divide ffn (516) of actor',
         '   17 |   actor.generation dp 1 tp 8 on 0..7',
         '      |                            ^',
         'hint: tp values that fit actor: 1, 2, 4'])),
    ('pp_above_layers', [('actor.training dp 2 tp 2 pp 2 on n0..n1', 'actor.training dp 1 tp 1 pp 8 on 0..7')], None,
     "\n".join([
         't.nir:18:31: error: pp 8 is more than the 4 layers of actor',
         '   18 |   actor.training dp 1 tp 1 pp 8 on 0..7',
         '      |                               ^',
         'hint: use a pp of at most 4'])),
    ('set_size_mismatch', [('critic.training dp 4 tp 2 on 0..7', 'critic.training dp 4 tp 2 on 0..5')], None,
     "\n".join([
         't.nir:19:32: error: the GPU set of critic.training has 6 GPUs, but dp x tp x pp = 4 x 2 x 1 = 8',
         '   19 |   critic.training dp 4 tp 2 on 0..5',
         '      |                                ^^^^',
         'hint: give 8 GPUs (e.g. on 0..7) or change dp to 3'])),
    ('gpu_does_not_exist', [('actor.generation dp 2 tp 4 on 0..7', 'actor.generation dp 2 tp 4 on 0..3, 4, 5, 6, 8')], None,
     "\n".join([
         't.nir:17:48: error: GPU 8 does not exist',
         '   17 |   actor.generation dp 2 tp 4 on 0..3, 4, 5, 6, 8',
         '      |                                                ^',
         'hint: cluster c has 2 nodes x 4 GPUs: GPU ids run 0..7'])),
    ('node_does_not_exist', [('on n0..n1', 'on n1..n2')], None,
     "\n".join([
         't.nir:18:36: error: node n2 does not exist',
         '   18 |   actor.training dp 2 tp 2 pp 2 on n1..n2',
         '      |                                    ^^^^^^',
         'hint: cluster c has 2 nodes x 4 GPUs: nodes run n0..n1'])),
    ('node_gpu_does_not_exist', [('actor.generation dp 2 tp 4 on 0..7', 'actor.generation dp 2 tp 4 on n0:0..3, n1:1..4')], None,
     "\n".join([
         't.nir:17:42: error: node n1 has no GPU 4',
         '   17 |   actor.generation dp 2 tp 4 on n0:0..3, n1:1..4',
         '      |                                          ^^^^^^^',
         'hint: cluster c has 2 nodes x 4 GPUs: GPUs of a node run 0..3'])),
    ('gpu_twice', [('critic.training dp 4 tp 2 on 0..7', 'critic.training dp 4 tp 2 on 0..3, n0:3, 5..7')], None,
     "\n".join([
         't.nir:19:38: error: GPU 3 appears twice in critic.training',
         '   19 |   critic.training dp 4 tp 2 on 0..3, n0:3, 5..7',
         '      |                                      ^^^^',
         "hint: '0..3' (19:32) already includes GPU 3"])),
    ('unknown_placement_key', [('actor.training dp 8 on 7..0', 'actor.training dp 8 zp 2 on 7..0')], None,
     "\n".join([
         "t.nir:22:23: error: unknown key 'zp' in a placement",
         '   22 |   actor.training dp 8 zp 2 on 7..0',
         '      |                       ^^',
         "hint: a placement takes 'dp', 'tp', 'pp', 'ep', 'on', 'offload', 'zero', 'mesh' or 'quant'"])),
    ('quant_on_training', [('actor.training dp 8 on 7..0', 'actor.training dp 8 on 7..0 quant fp8')], None,
     "\n".join([
         "t.nir:22:37: error: quant applies to generation only; actor.training computes in bf16",
         '   22 |   actor.training dp 8 on 7..0 quant fp8',
         '      |                                     ^^^',
         'hint: drop quant here, or put it on a .generation model-stage (the weight sync quantizes)'])),
    ('quant_unknown_format', [('actor.generation dp 2 tp 4 on 0..7', 'actor.generation dp 2 tp 4 on 0..7 quant int4')],
     None,
     "\n".join([
         "t.nir:17:44: error: unknown weight format 'int4' after quant",
         '   17 |   actor.generation dp 2 tp 4 on 0..7 quant int4',
         '      |                                            ^^^^',
         'hint: write quant fp8'])),
    ('placement_key_twice', [('actor.training dp 8 on 7..0', 'actor.training dp 8 dp 4 on 7..0')], None,
     "\n".join([
         "t.nir:22:23: error: 'dp' is given twice for actor.training in plan B",
         '   22 |   actor.training dp 8 dp 4 on 7..0',
         '      |                       ^^',
         'hint: the first is at 22:18; keep one'])),
    ('placement_key_without_value', [('actor.training dp 8 on 7..0', 'actor.training dp on 7..0')], None,
     "\n".join([
         "t.nir:22:18: error: 'dp' needs a number",
         '   22 |   actor.training dp on 7..0',
         '      |                  ^^',
         'hint: write it like dp 2'])),
    ('placement_without_set', [('actor.training dp 8 on 7..0', 'actor.training dp 8')], None,
     "\n".join([
         't.nir:22:3: error: actor.training in plan B has no GPU set',
         '   22 |   actor.training dp 8',
         '      |   ^^^^^^^^^^^^^^',
         'hint: add one, e.g. on 0..7 or on n0..n1'])),
    ('zero_dp', [('actor.training dp 8 on 7..0', 'actor.training dp 0 on 7..0')], None,
     "\n".join([
         't.nir:22:21: error: dp must be at least 1, found 0',
         '   22 |   actor.training dp 0 on 7..0',
         '      |                     ^',
         'hint: write dp 1 or more'])),
    ('model_stage_not_in_workload', [('  actor.training dp 8 on 7..0\n', '  actor.training dp 8 on 7..0\n  critic.generation dp 8 on 0..7\n')], None,
     "\n".join([
         't.nir:23:3: error: critic.generation is not in workload w',
         '   23 |   critic.generation dp 8 on 0..7',
         '      |   ^^^^^^^^^^^^^^^^^',
         'hint: workload w runs actor in generation'])),
    ('unknown_model_in_plan', [('  actor.training dp 8 on 7..0\n', '  actor.training dp 8 on 7..0\n  reward.training dp 8 on 0..7\n')], None,
     "\n".join([
         "t.nir:23:3: error: unknown model 'reward'",
         '   23 |   reward.training dp 8 on 0..7',
         '      |   ^^^^^^',
         'hint: models: actor, critic'])),
    ('unknown_stage_in_plan', [('  actor.training dp 8 on 7..0\n', '  actor.training dp 8 on 7..0\n  actor.train dp 8 on 0..7\n')], None,
     "\n".join([
         "t.nir:23:9: error: unknown stage 'train'",
         '   23 |   actor.train dp 8 on 0..7',
         '      |         ^^^^^',
         'hint: stages: generation, inference, training'])),
    ('model_stage_twice_in_plan', [('  critic.training dp 4 tp 2 on 0..7\n', '  critic.training dp 4 tp 2 on 0..7\n  critic.training dp 8 on 0..7\n')], None,
     "\n".join([
         't.nir:20:3: error: critic.training is placed twice in plan A',
         '   20 |   critic.training dp 8 on 0..7',
         '      |   ^^^^^^^^^^^^^^^',
         'hint: the first is at 19:3; keep one'])),
    ('model_stage_not_placed', [('  critic.training dp 4 tp 2 on 0..7\n', '')], None,
     "\n".join([
         't.nir:16:6: error: plan A does not place critic.training',
         '   16 | plan A {',
         '      |      ^',
         'hint: every model-stage of workload w needs a placement in every plan; add a line like critic.training dp 1 on 0'])),
    ('unknown_plan_base', [('plan B = A {', 'plan B = C {')], None,
     "\n".join([
         "t.nir:21:10: error: unknown plan 'C'",
         '   21 | plan B = C {',
         '      |          ^',
         'hint: plans: A, B'])),
    ('plan_cycle', [('plan A {', 'plan A = B {')], None,
     "\n".join([
         't.nir:21:10: error: plan inheritance cycle: A -> B -> A',
         '   21 | plan B = A {',
         '      |          ^',
         'hint: one plan of the cycle must place everything itself'])),
    ('duplicate_plan', [('plan B = A {', 'plan A = A {')], None,
     "\n".join([
         "t.nir:21:6: error: plan 'A' is declared twice",
         '   21 | plan A = A {',
         '      |      ^',
         'hint: the first is at 16:6; rename one'])),
    ('transition_unknown_plan', [('transition A -> B', 'transition A -> S2')], None,
     "\n".join([
         "t.nir:24:17: error: unknown plan 'S2'",
         '   24 | transition A -> S2',
         '      |                 ^^',
         'hint: plans: A, B'])),
    ('transition_to_itself', [('transition A -> B', 'transition B -> B')], None,
     "\n".join([
         't.nir:24:17: error: transition from plan B to itself',
         '   24 | transition B -> B',
         '      |                 ^',
         'hint: a transition goes between two different plans'])),
    ('duplicate_transition', [('transition A -> B', 'transition A -> B\ntransition A -> B')], None,
     "\n".join([
         't.nir:25:12: error: transition A -> B is declared twice',
         '   25 | transition A -> B',
         '      |            ^',
         'hint: the first is at 24:12; keep one'])),
    ('expected_gpu_set', [('on 7..0', 'on foo')], None,
     "\n".join([
         "t.nir:22:26: error: expected a GPU set (like 0..7, n1 or n2:0..3), found 'foo'",
         '   22 |   actor.training dp 8 on foo',
         '      |                          ^^^',
         'hint: GPU sets are written like on 0..7, on 0, 2, 4, on n0..n1 or on n1:0..3'])),
    ('negative_gpu_id', [('on 7..0', 'on -1..3')], None,
     "\n".join([
         "t.nir:22:26: error: expected a GPU set (like 0..7, n1 or n2:0..3), found '-1'",
         '   22 |   actor.training dp 8 on -1..3',
         '      |                          ^^',
         'hint: GPU ids are 0 or more'])),
    ('missing_close_brace', [('  actor.training dp 8 on 7..0\n}\n', '  actor.training dp 8 on 7..0\n')], None,
     "\n".join([
         "t.nir:23:1: error: expected '}' before 'transition'",
         '   23 | transition A -> B',
         '      | ^^^^^^^^^^',
         "hint: the '{' at 21:12 is not closed"])),
    ('missing_open_brace', [('workload w {', 'workload w')], None,
     "\n".join([
         "t.nir:12:3: error: expected '{', found 'batch'",
         '   12 |   batch 8 prompt 16 response 16 microbatch 2',
         '      |   ^^^^^',
         'hint: a block follows in braces: cluster c { ... }, plan A { ... }'])),
    ('bad_character', [('  nodes 2\n', '  nodes 2;\n')], None,
     "\n".join([
         "t.nir:2:10: error: unexpected character ';'; expected a key or '}'",
         '    2 |   nodes 2;',
         '      |          ^',
         "hint: comments start with '#'"])),
    ('transition_missing_arrow', [('transition A -> B', 'transition A B')], None,
     "\n".join([
         "t.nir:24:14: error: expected '->', found 'B'",
         '   24 | transition A B',
         '      |              ^',
         'hint: a transition is written: transition S1 -> S2'])),
    ('model_missing_equals', [('model critic = actor', 'model critic actor')], None,
     "\n".join([
         "t.nir:10:14: error: expected '=', found 'actor'",
         '   10 | model critic actor { head value }',
         '      |              ^^^^^',
         'hint: declarations are written: model actor = llama { ... }, plan A { ... }, plan B = A { ... }'])),
    ('stray_keyword', [('plan B = A {', 'plan plan B = A {')], None,
     "\n".join([
         "t.nir:21:11: error: expected '=' or '{', found 'B'",
         '   21 | plan plan B = A {',
         '      |           ^',
         'hint: declarations are written: model actor = llama { ... }, plan A { ... }, plan B = A { ... }'])),
    ('gpu_set_trailing_comma', [('on 7..0', 'on 7..0,')], None,
     "\n".join([
         "t.nir:23:1: error: expected a GPU set (like 0..7, n1 or n2:0..3), found '}'",
         '   23 | }',
         '      | ^',
         'hint: GPU sets are written like on 0..7, on 0, 2, 4, on n0..n1 or on n1:0..3'])),
    ('value_missing', [('  nodes 2\n', '  nodes\n')], None,
     "\n".join([
         "t.nir:3:17: error: expected a key or '}', found '4'",
         '    3 |   gpus_per_node 4',
         '      |                 ^',
         "hint: 'nodes' took 'gpus_per_node' as its value; is the value of 'nodes' missing?"])),
    ('empty_file', None, '',
     "\n".join([
         't.nir:1:1: error: empty file: nothing is declared',
         'hint: a .nir file declares a cluster, models, a workload, plans and transitions'])),
    ('only_comments', None, '# nothing here\n   # still nothing\n',
     "\n".join([
         't.nir:1:1: error: empty file: nothing is declared',
         '    1 | # nothing here',
         '      | ^',
         'hint: a .nir file declares a cluster, models, a workload, plans and transitions'])),
    ('no_cluster', None, 'workload w { batch 8 prompt 16 response 16 microbatch 2 }\n',
     "\n".join([
         't.nir:1:1: error: no cluster is declared',
         '    1 | workload w { batch 8 prompt 16 response 16 microbatch 2 }',
         '      | ^',
         'hint: a .nir file declares exactly one cluster, e.g. cluster NAME { nodes 1 gpus_per_node 8 ... }'])),
    ('tab_indented_error', [('  nodes 2\n', '\tnodes 2x\n')], None,
     "\n".join([
         "t.nir:2:8: error: nodes takes a plain number, found unit 'x'",
         '    2 |  nodes 2x',
         '      |        ^^',
         'hint: write nodes 2'])),
    ('kv_heads_above_heads', [('kv_heads 2', 'kv_heads 16')], None,
     "\n".join([
         't.nir:9:60: error: kv_heads 16 must divide heads (8)',
         '    9 | model actor = llama { layers 4 hidden 256 heads 8 kv_heads 16 ffn 512 vocab 1024 }',
         '      |                                                            ^^',
         'hint: each KV head serves heads / kv_heads query heads; use one of 1, 2, 4, 8'])),
    ('plan_set_descending_node_range', [('on n0..n1', 'on n1..n0, n1')], None,
     "\n".join([
         't.nir:18:44: error: GPU 4 appears twice in actor.training',
         '   18 |   actor.training dp 2 tp 2 pp 2 on n1..n0, n1',
         '      |                                            ^^',
         "hint: 'n1..n0' (18:36) already includes GPU 4"])),
    ('offload_with_value', [('actor.training dp 8 on 7..0', 'actor.training dp 8 on 7..0 offload 1')], None,
     "\n".join([
         "t.nir:22:39: error: 'offload' takes no value",
         '   22 |   actor.training dp 8 on 7..0 offload 1',
         '      |                                       ^',
         'hint: write offload alone'])),
    ('unknown_dtype_value_number', [('vocab 1024 }', 'vocab 1024 dtype 16 }')], None,
     "\n".join([
         "t.nir:9:87: error: dtype must be 'bf16', 'fp16' or 'fp32', found '16'",
         '    9 | model actor = llama { layers 4 hidden 256 heads 8 kv_heads 2 ffn 512 vocab 1024 dtype 16 }',
         '      |                                                                                       ^^',
         "hint: did you mean 'fp16'?"])),
    ('int_with_unit', [('layers 4', 'layers 4GB')], None,
     "\n".join([
         "t.nir:9:30: error: layers takes a plain number, found unit 'GB'",
         '    9 | model actor = llama { layers 4GB hidden 256 heads 8 kv_heads 2 ffn 512 vocab 1024 }',
         '      |                              ^^^',
         'hint: write layers 4'])),
    ('alias_without_body_on_architecture', [('model critic = actor { head value }', 'model critic = llama')], None,
     "\n".join([
         "t.nir:10:16: error: model 'critic' needs its architecture's sizes",
         '   10 | model critic = llama',
         '      |                ^^^^^',
         'hint: write it like llama { layers 32 hidden 4096 heads 32 kv_heads 8 ffn 14336 vocab 128256 }'])),
    ('model_named_llama', [('model critic = actor { head value }', 'model llama = actor')], None,
     "\n".join([
         "t.nir:10:7: error: 'llama' names an architecture and cannot name a model",
         '   10 | model llama = actor',
         '      |       ^^^^^',
         'hint: choose another name, e.g. actor'])),
    ('comment_with_slashes', [('  nodes 2\n', '  nodes 2 // two nodes\n')], None,
     "\n".join([
         "t.nir:2:11: error: unexpected character '/'; expected a key or '}'",
         '    2 |   nodes 2 // two nodes',
         '      |           ^',
         "hint: comments start with '#'"])),
    ('reserve_wrong_unit', [('  host_mem 1TB\n', '  host_mem 1TB\n  reserve 5GB\n')], None,
     "\n".join([
         "t.nir:8:11: error: reserve takes a percentage, found unit 'GB'",
         '    8 |   reserve 5GB',
         '      |           ^^^',
         'hint: write it like reserve 5%'])),
    ('gpu_block_missing_key', [(' hbm 3.35TB/s', '')], None,
     "\n".join([
         "t.nir:4:3: error: the gpu block of cluster 'c' is missing 'hbm'",
         '    4 |   gpu { mem 80GB flops 989TFLOPS }',
         '      |   ^^^',
         'hint: add it, e.g. hbm 4.8TB/s'])),
    ('gpu_not_a_block', [('gpu { mem 80GB flops 989TFLOPS hbm 3.35TB/s }', 'gpu 80GB')], None,
     "\n".join([
         "t.nir:4:3: error: 'gpu' takes a block",
         '    4 |   gpu 80GB',
         '      |   ^^^',
         'hint: write it like gpu { mem 141GB flops 989TFLOPS hbm 4.8TB/s }'])),
    ('stage_list_as_value', [('  host_mem 1TB\n', '  host_mem 1TB\n  training: actor\n')], None,
     "\n".join([
         "t.nir:8:3: error: unknown key 'training:' in cluster 'c'",
         '    8 |   training: actor',
         '      |   ^^^^^^^^',
         "hint: cluster 'c' takes 'nodes', 'gpus_per_node', 'gpu', 'intra', 'inter', 'host_mem' or 'reserve'"])),
    ('value_as_list', [('batch 8', 'batch: 8')], None,
     "\n".join([
         "t.nir:12:10: error: expected a name, found '8'",
         '   12 |   batch: 8 prompt 16 response 16 microbatch 2',
         '      |          ^',
         "hint: a value follows its key without ':', like batch 8 (a ':' lists models: training: actor, critic)"])),
    ('eof_inside_block', [('  actor.training dp 8 on 7..0\n}\ntransition A -> B\n', '  actor.training dp 8 on 7..0\n')], None,
     "\n".join([
         "t.nir:22:30: error: unexpected end of input; expected a placement key (dp, tp, pp, ep, on, offload, zero, mesh, quant), the next model-stage or '}'",
         '   22 |   actor.training dp 8 on 7..0',
         '      |                              ^',
         "hint: the '{' at 21:12 is not closed"])),
    ('eof_after_key', [('transition A -> B\n', 'transition A ->')], None,
     "\n".join([
         't.nir:24:16: error: unexpected end of input; expected a name',
         '   24 | transition A ->',
         '      |                ^',
         "hint: names start with a letter or '_': actor, plan_b, S1"])),
    ('second_cluster', [('transition A -> B\n', 'transition A -> B\ncluster d { nodes 1 }\n')], None,
     "\n".join([
         't.nir:25:1: error: a second cluster is declared',
         '   25 | cluster d { nodes 1 }',
         '      | ^^^^^^^',
         "hint: a .nir file declares exactly one cluster; the first, 'c', is at 1:1"])),
    ('misspelled_declaration', [('workload w {', 'workloa w {')], None,
     "\n".join([
         "t.nir:11:1: error: expected a declaration (cluster, model, workload, plan or transition), found 'workloa'",
         '   11 | workloa w {',
         '      | ^^^^^^^',
         "hint: did you mean 'workload'?"])),
    ('gpu_block_unclosed', [('hbm 3.35TB/s }', 'hbm 3.35TB/s')], None,
     "\n".join([
         "t.nir:9:1: error: expected '}' before 'model'",
         '    9 | model actor = llama { layers 4 hidden 256 heads 8 kv_heads 2 ffn 512 vocab 1024 }',
         '      | ^^^^^',
         "hint: the '{' at 1:11 is not closed"])),
    ('model_body_unclosed', [('vocab 1024 }', 'vocab 1024')], None,
     "\n".join([
         "t.nir:10:1: error: expected '}' before 'model'",
         '   10 | model critic = actor { head value }',
         '      | ^^^^^',
         "hint: the '{' at 9:21 is not closed"])),
    ('cluster_without_name', [('cluster c {', 'cluster {')], None,
     "\n".join([
         "t.nir:1:9: error: expected a name, found '{'",
         '    1 | cluster {',
         '      |         ^',
         "hint: names start with a letter or '_': actor, plan_b, S1"])),
]


def _source(edits, whole):
    if edits is None:
        return whole
    text = BASE
    for old, new in edits:
        assert old in text, f"test bug: {old!r} not in the program"
        text = text.replace(old, new, 1)
    return text


def test_base_program_is_valid():
    module = ir.parse_source(BASE, "t.nir")
    assert [plan.name for plan in module.plans] == ["A", "B"]


def test_enough_cases():
    assert len(CASES) >= 30
    assert len({name for name, *_ in CASES}) == len(CASES)


@pytest.mark.parametrize("name,edits,whole,expected", CASES, ids=[case[0] for case in CASES])
def test_error_text(name, edits, whole, expected):
    with pytest.raises(ir.NereusError) as caught:
        ir.parse_source(_source(edits, whole), "t.nir")
    assert caught.value.format() == expected


def test_no_internal_token_names_in_syntax_errors():
    for name, edits, whole, expected in CASES:
        for internal in ("__ANON", "RBRACE", "LBRACE", "QUANTITY", "MODEL_STAGE", "GPU_ID", "$END", "Token("):
            assert internal not in expected, (name, internal)


def test_zero_0_the_documented_default_may_be_written():
    """docs/ir.md: `zero 0|1|3`, default 0; writing the default is the same plan, on any
    model-stage, and a negative value is an error at the value."""
    written = ir.parse_source(_source([("actor.training dp 2 tp 2 pp 2 on n0..n1",
                                        "actor.training dp 2 tp 2 pp 2 zero 0 on n0..n1"),
                                       ("actor.generation dp 2 tp 4 on 0..7",
                                        "actor.generation dp 2 tp 4 zero 0 on 0..7")], None), "t.nir")
    assert written.plans == ir.parse_source(BASE, "t.nir").plans
    with pytest.raises(ir.NereusError) as caught:
        ir.parse_source(_source([("actor.training dp 2 tp 2 pp 2 on n0..n1",
                                  "actor.training dp 2 tp 2 pp 2 zero -1 on n0..n1")], None), "t.nir")
    assert caught.value.format().splitlines()[0] == "t.nir:18:38: error: zero must be at least 0, found -1"


def test_lone_carriage_returns_end_lines():
    """A file saved with CR line ends (old Mac) is the same program; a comment ends at its
    CR instead of swallowing the rest of the file, and errors name the right line."""
    assert ir.parse_source(BASE.replace("\n", "\r"), "t.nir").plans == ir.parse_source(BASE, "t.nir").plans
    with pytest.raises(ir.NereusError) as caught:
        ir.parse_source(_source([("actor.training dp 8 on 7..0", "actor.training dp 0 on 7..0")], None)
                        .replace("\n", "\r"), "t.nir")
    with pytest.raises(ir.NereusError) as plain:  # the same text and location as with LF ends
        ir.parse_source(_source([("actor.training dp 8 on 7..0", "actor.training dp 0 on 7..0")], None), "t.nir")
    assert caught.value.format() == plain.value.format()
    assert ir.format_source("# first\r" + BASE.replace("\n", "\r"), "t.nir") == ir.format_source("# first\n" + BASE,
                                                                                                 "t.nir")


@pytest.mark.parametrize("char", ["\f", "\v", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"],
                         ids=["FF", "VT", "FS", "GS", "RS", "NEL", "LS", "PS"])
def test_only_newlines_end_lines_for_errors_and_comments(char):
    """The grammar ends a line at LF (CRLF, CR) only; Python's `splitlines` also breaks at
    FF, VT, FS, GS, RS, NEL, LS and PS. Error displays and comment anchoring count lines
    as the parser does: inside a comment such a character is comment text (kept by fmt),
    and an error quotes the line it names."""
    commented = BASE.replace("\n", f"  # one{char} two\n", 1)
    assert ir.parse_source(commented, "t.nir").plans == ir.parse_source(BASE, "t.nir").plans
    formatted = ir.format_source(commented, "t.nir")
    assert f"# one{char} two" in formatted
    assert ir.format_source(formatted, "t.nir") == formatted
    broken = _source([("actor.training dp 8 on 7..0", "actor.training dp 0 on 7..0")], None)
    with pytest.raises(ir.NereusError) as plain:
        ir.parse_source(broken, "t.nir")
    with pytest.raises(ir.NereusError) as caught:
        ir.parse_source(broken.replace("\n", f"  # a{char}b\n", 1), "t.nir")
    shown, want = caught.value.format().splitlines(), plain.value.format().splitlines()
    assert shown[0] == want[0] and shown[2:] == want[2:]  # same place, caret and hint
    assert shown[1].endswith(want[1].split("| ", 1)[1])  # the quoted line is the one named


def test_blocks_nested_past_the_limit_are_an_error_not_a_recursion_error():
    from nereus.ir.syntax import MAX_NESTING

    deep = "cluster c { gpu " + "{ a " * 1000 + "{ }" + " }" * 1000 + " }\n"
    with pytest.raises(ir.NereusError) as caught:
        ir.parse_source(deep, "deep.nir")
    column = len("cluster c { gpu ") + 4 * (MAX_NESTING - 1) + 1  # the brace one level too deep
    assert caught.value.format().splitlines()[0] == \
        f"deep.nir:1:{column}: error: blocks nest more than {MAX_NESTING} deep"
    # braces in comments and strings do not count
    ok = '# ' + "{" * 500 + '\ncluster c { nodes 1 }\n'
    with pytest.raises(ir.NereusError) as other:  # (an incomplete cluster: any other error)
        ir.parse_source(ok, "ok.nir")
    assert "nest" not in other.value.message


@pytest.mark.parametrize("derived, key", [
    ("model judge = actor { heads 3 }", "heads 3"),
    ("model judge = actor { heads 16 }", "heads 16"),  # kv_heads 2 inherited: divides 16, fine below
    ("model judge = actor { kv_heads 3 }", "kv_heads 3"),
])
def test_a_rule_a_derived_model_breaks_points_at_the_key_it_writes(derived, key):
    """A rule that ties two keys (hidden / heads, heads / kv_heads) is reported at the one
    the derived model writes, not at its name (the other is its base's)."""
    source = BASE.replace("transition A -> B\n", "") + derived + "\n"
    if key == "heads 16":  # a valid change: no error
        ir.parse_source(source, "t.nir")
        return
    with pytest.raises(ir.NereusError) as caught:
        ir.parse_source(source, "t.nir")
    line = source.splitlines().index(derived) + 1
    head = caught.value.format().splitlines()[0]
    assert head.startswith(f"t.nir:{line}:{derived.index(key.split()[1]) + 1}: error: "), head


def test_a_reserve_below_100_only_past_float_precision_is_named_as_written():
    source = BASE.replace("host_mem 1TB", "host_mem 1TB\n  reserve 99.999999999999999999%")
    with pytest.raises(ir.NereusError) as caught:
        ir.parse_source(source, "t.nir")
    text = caught.value.format()
    assert "reserve 99.999999999999999999% is below 100% only past a float's precision" in text
    assert "found 100%" not in text


def test_an_exponent_before_a_unit_is_named_as_an_exponent():
    source = BASE.replace("host_mem 1TB", "host_mem 1e3GB")
    with pytest.raises(ir.NereusError) as caught:
        ir.parse_source(source, "t.nir")
    assert caught.value.message == "host_mem is written with digits, not an exponent: found 1e3GB"
    assert caught.value.hint == "write host_mem 1000GB"
