"""`nereus train` on models read from Hugging Face checkpoints (2 gloo processes).

The actor (a tiny random Llama-3.1-shaped model written by transformers), its reference
and a critic declared `actor { head value }` start from the actor's checkpoint; the
reward model (a tiny Qwen2.5 sequence classifier, one label) from its own. Checked: the loop's log-probs at the start
equal the single-process reference `nereus.models.logits` on the same files, the critic
predicts 0, training stages start from an fp32 master and zeroed Adam, and after a plan
change the shards gathered back equal the files byte for byte, for the Nereus runtime and
the restart baseline; `nereus train --steps 2` with a transition runs, and with lr 0 its
final weights are the checkpoint's bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl_harness import run_world

pytestmark = pytest.mark.multiprocess
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

TESTS = Path(__file__).parents[1]
ROOT = TESTS.parent
PLAN = """\
cluster c { nodes 1 gpus_per_node 2 gpu { mem 1GB flops 1TFLOPS hbm 100GB/s } intra 10GB/s inter 1GB/s host_mem 16GB }

model actor  = hf("actor") { dtype fp32 }
model ref    = actor
model critic = actor { head value }
model reward = hf("reward") { dtype fp32 head value }

workload w {
  batch 4  prompt 4  response 4  microbatch 1
  generation: actor
  inference:  ref, reward
  training:   actor, critic
}

plan S1 {
  actor.generation  dp 1 tp 2  on 0, 1
  ref.inference     dp 2 tp 1  on 0, 1
  reward.inference  dp 1 tp 2  on 0, 1
  actor.training    dp 2 tp 1  on 0, 1
  critic.training   dp 1 tp 2  on 0, 1
}

plan S2 = S1 {
  actor.generation  dp 2 tp 1  on 1, 0
  actor.training    dp 1 tp 1 pp 2  on 1, 0
  critic.training   dp 2 tp 1  on 1, 0
}

transition S1 -> S2
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf-train")
    # a fresh interpreter writes them: the test process runs no torch op before forking
    script = ("import sys; from pathlib import Path; from hf_tiny import write_checkpoint\n"
              "write_checkpoint('llama31', Path(sys.argv[1]) / 'actor', seed=1)\n"
              "write_checkpoint('qwen2', Path(sys.argv[1]) / 'reward', seed=2, value_head=True)\n")
    subprocess.run([sys.executable, "-c", script, str(root)], check=True, cwd=TESTS / "models", timeout=300)
    (root / "plan.nir").write_text(PLAN)
    return root


def _start_and_move(root: str, runtime_kind: str) -> dict:
    """On every rank: initialise the loop from the checkpoints, compare its log-probs and
    values with the reference, change plan, gather the weights back under HF names."""
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file

    import nereus.ir as ir
    from nereus.models import logits
    from nereus.rl.algorithms import RlConfig
    from nereus.rl.trainer import RlTrainer, TrainSpec
    from nereus.rl.worker import make_runtime

    path = str(Path(root) / "plan.nir")
    module = ir.parse_file(path)
    trainer = RlTrainer(module, make_runtime(runtime_kind, path, "S1", module), TrainSpec("S1", 1, rl=RlConfig()))
    trainer.initialise()
    files = {name: load_file(str(Path(root) / name / "model.safetensors")) for name in ("actor", "reward")}
    w = module.workload
    seqs = torch.randint(0, 11, (w.batch, w.prompt + w.response), generator=torch.Generator().manual_seed(3))
    reference = F.log_softmax(logits(module.model("actor"), files["actor"], seqs[:, :-1])[:, w.prompt - 1:], -1)
    reference = reference.gather(-1, seqs[:, w.prompt:, None])[..., 0]
    report = {"sources": trainer.sources}
    trainer._seqs, trainer._pad = seqs, None  # the step's sequences (no left padding), as step() sets them
    for ms, model in (("actor.training", "actor"), ("ref.inference", "ref")):
        logp = trainer._per_replica(ms, lambda role, rows: trainer._logprobs(
            model, trainer.weights(ms), rows, role), (w.batch, w.response))
        report[f"{ms} logp error"] = float((logp - reference).abs().max())
    values = trainer._per_replica("critic.training", lambda role, rows: trainer._values(
        "critic", trainer.weights("critic.training"), rows, role), (w.batch, w.response))
    report["critic values"] = float(values.abs().max())
    state = trainer.rt.state("actor.training")
    weights = [k for k in state if "#" not in k.split("/", 1)[1]]
    report["fp32 master, zero Adam"] = bool(weights) and all(
        state[f"{k}#master"].dtype == torch.float32 and torch.equal(state[f"{k}#master"], state[k].float())
        and not state[f"{k}#exp_avg"].any() and not state[f"{k}#exp_avg_sq"].any() for k in weights)
    trainer.transition(1, "S2")
    if runtime_kind == "nereus":
        gathered = {"actor": trainer.rt.gather_hf_state_dict("actor.training"),
                    "critic": trainer.rt.gather_hf_state_dict("critic.training"),
                    "reward": trainer.rt.gather_hf_state_dict("reward.inference")}
    else:  # the baseline has no HF names: compare in Nereus' names
        from nereus.models.hf import nereus_to_hf

        gathered = {m: nereus_to_hf(module.model(m), {k: v for k, v in trainer.rt.gather_state_dict(ms).items()
                                                     if "#" not in k.split("/", 1)[1]})
                    for m, ms in (("actor", "actor.training"), ("critic", "critic.training"),
                                  ("reward", "reward.inference"))}
    for name, hf in gathered.items():
        expected = dict(files["reward" if name == "reward" else "actor"])
        if module.model(name).head == "value" and "score.weight" not in expected:  # the critic from the
            # actor's causal-LM checkpoint: no score, the head starts at 0
            expected.pop("lm_head.weight")
            expected["score.weight"] = torch.zeros_like(hf["score.weight"])
        report[f"{name} bytes equal"] = set(hf) == set(expected) and all(
            hf[k].dtype == expected[k].dtype and torch.equal(hf[k].contiguous().view(torch.uint8),
                                                             expected[k].view(torch.uint8)) for k in expected)
    return report


@pytest.mark.parametrize("runtime_kind", ["nereus", "restart"])
def test_loop_starts_from_the_checkpoints(run_dir, runtime_kind):
    report = run_world(2, _start_and_move, str(run_dir), runtime_kind)
    source = str(run_dir / "actor")
    assert report.pop("sources") == {"actor": source, "ref": source, "critic": source,
                                     "reward": str(run_dir / "reward")}
    assert report.pop("actor.training logp error") < 1e-5
    assert report.pop("ref.inference logp error") < 1e-5
    assert report.pop("critic values") == 0.0
    assert all(report.values()), report


def _final_equals_checkpoint(root: str, final_state: str) -> bool:
    import torch
    from safetensors.torch import load_file

    import nereus.ir as ir
    from nereus.models.hf import hf_to_nereus

    final = torch.load(final_state)
    module = ir.parse_file(Path(root) / "plan.nir")
    expected = hf_to_nereus(module.model("actor"), load_file(str(Path(root) / "actor" / "model.safetensors")))
    return bool(expected) and all(torch.equal(final[k], v) for k, v in expected.items())


def test_nereus_train_with_a_transition_keeps_the_checkpoint_at_lr_0(run_dir, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    run = subprocess.run([sys.executable, "-c", "from nereus.cli import nereus; nereus()", "train",
                          str(run_dir / "plan.nir"), "--nproc", "2", "--steps", "2", "--events", "1:S2",
                          "--lr", "0", "--out", str(tmp_path), "--json"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert [s["step"] for s in result["steps"]] == [1, 2]
    assert [t["to"] for t in result["transitions"]] == ["S2"]
    assert result["steps"][0]["kl"] == 0.0  # ref and actor are the same checkpoint
    with open(tmp_path / "run" / "result.json") as f:
        sources = json.load(f)["initial_weights"]
    assert sources == {"actor": str(run_dir / "actor"), "ref": str(run_dir / "actor"),
                       "critic": str(run_dir / "actor"), "reward": str(run_dir / "reward")}
    # compared in a forked process: this one runs no torch op (later tests fork)
    assert run_world(1, _final_equals_checkpoint, str(run_dir), str(tmp_path / "run" / "final_state.pt"))


def _example_loads(path: str) -> list:
    from safetensors.torch import load_file

    import nereus.ir as ir
    from nereus.models import tensor_table
    from nereus.models.hf import hf_to_nereus

    module = ir.parse_file(path)
    actor = module.model("actor")
    full = hf_to_nereus(actor, load_file(str(Path(actor.checkpoint_dir) / "model.safetensors")))
    return [actor.architecture, actor.rope_scaling is not None, module.model("ref").checkpoint_dir == actor.checkpoint_dir,
            sorted(full) == sorted(f"actor/{spec.name}" for spec in tensor_table(actor))]


def test_bundled_example_reads_its_checkpoint():
    """examples/rl/grpo-hf-cpu.nir (docs/rl.md) names a checkpoint whose tensors are the actor's."""
    path = ROOT / "examples" / "rl" / "grpo-hf-cpu.nir"
    assert run_world(1, _example_loads, str(path)) == ["llama", True, True, True]


def _train_refused(root):
    """`nereus train` of PLAN in `root` (its checkpoints written there), which must be
    refused before launch: the completed process."""
    (root / "plan.nir").write_text(PLAN)
    return subprocess.run([sys.executable, "-c", "from nereus.cli import nereus; nereus()", "train",
                           str(root / "plan.nir"), "--nproc", "2", "--steps", "2", "--out", str(root / "out")],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))), timeout=120)


def test_a_checkpoint_too_small_for_the_task_is_refused_before_launch(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 8,
              "rms_norm_eps": 1e-5, "torch_dtype": "float32"}
    for name in ("actor", "reward"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    run = _train_refused(tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert 'actor has vocab 8 (vocab_size of actor) but the tasks use 11 tokens' in run.stderr
    assert "plan.nir:3:" in run.stderr and "Traceback" not in run.stderr and not (tmp_path / "out").exists()


def test_a_reward_model_without_a_score_head_is_refused_before_launch(tmp_path):
    """A causal-LM checkpoint as the reward model: its value head would start at zero and
    score every response 0 for the whole run (it did, silently)."""
    subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from hf_tiny import write_checkpoint\n"
                    "write_checkpoint('llama31', Path(sys.argv[1]) / 'actor', seed=1)\n"
                    "write_checkpoint('qwen2', Path(sys.argv[1]) / 'reward', seed=2)\n", str(tmp_path)],
                   check=True, cwd=TESTS / "models", timeout=300)
    run = _train_refused(tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert 'reward reads reward, which has no score.weight' in run.stderr
    assert "plan.nir:6:" in run.stderr and not (tmp_path / "out").exists()


def test_a_checkpoint_without_weights_is_refused_before_launch(tmp_path):
    """A folder with config.json and no weights planned and launched, and failed in every
    rank: refused first, naming the files looked for."""
    subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from hf_tiny import write_checkpoint\n"
                    "write_checkpoint('llama31', Path(sys.argv[1]) / 'actor', seed=1)\n"
                    "write_checkpoint('qwen2', Path(sys.argv[1]) / 'reward', seed=2, value_head=True)\n", str(tmp_path)],
                   check=True, cwd=TESTS / "models", timeout=300)
    (tmp_path / "actor" / "model.safetensors").unlink()
    run = _train_refused(tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "model actor: no model.safetensors or model.safetensors.index.json in" in run.stderr, run.stderr
    assert "plan.nir:3:" in run.stderr and not (tmp_path / "out").exists()
