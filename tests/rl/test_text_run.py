"""`nereus train` on text end to end (examples/rl/arith, 2 gloo processes, 4 GRPO steps,
a plan change after step 2): samples.jsonl holds the decoded prompts and responses with
the reward function's value, the metrics go to JSONL and TensorBoard, checkpoints are
complete every 2 steps, `--resume` after deleting the last one reproduces the final
weights bit for bit, `nereus export` writes a checkpoint transformers loads and computes
the trained weights' logits with, and the reward function's failure reaches the user
with its row."""

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARITH = os.path.join(ROOT, "examples", "rl", "arith")
PLAN = os.path.join(ARITH, "arith.nir")

pytestmark = pytest.mark.multiprocess


def _nereus(*args, env=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH")))),
               **(env or {}))
    return subprocess.run([sys.executable, "-c", "from nereus.cli import nereus; nereus()", *args],
                          capture_output=True, text=True, env=env, timeout=400)


def _train(out, *extra, reward=os.path.join(ARITH, "reward.py") + ":reward"):
    return _nereus("train", PLAN, "--algo", "grpo", "--nproc", "2", "--prompts", os.path.join(ARITH, "train.jsonl"),
                   "--reward", reward, "--lr", "1e-2", "--out", str(out), "--json", *extra)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("arith") / "run"
    loggers = ["--logger", "jsonl"] + (["--logger", "tensorboard"] if _has("tensorboard") else [])
    done = _train(out, "--steps", "4", "--events", "2:S2", "--save-every", "2", "--samples-every", "2", *loggers)
    assert done.returncode == 0, done.stdout + done.stderr
    return out, json.loads(done.stdout.strip().splitlines()[-1])


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_samples_and_metrics(run):
    out, result = run
    sys.path.insert(0, ARITH)
    from reward import reward

    answers = {json.loads(line)["prompt"]: json.loads(line)["answer"] for line in open(os.path.join(ARITH, "train.jsonl"))}
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert {s["step"] for s in samples} == {2, 4} and len(samples) == 2 * 32
    for s in samples:  # the reward function's value of the decoded text, with the dataset's answer
        assert s["reward"] == pytest.approx(reward([s["prompt"]], [s["response"]], [answers[s["prompt"]]])[0])
    steps = [json.loads(line) for line in open(out / "metrics.jsonl") if '"step"' in line]
    rewards = {m["step"]: m["train/reward"] for m in steps if m["event"] == "step"}
    assert rewards == {s["step"]: pytest.approx(s["reward"]) for s in result["steps"]}
    assert any(m["event"] == "transition" and m["transition/bytes"] > 0 for m in steps)
    assert [m["step"] for m in steps if m["event"] == "checkpoint"] == [2, 4]
    if _has("tensorboard"):
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(out / "tensorboard"))
        events.Reload()
        assert [e.step for e in events.Scalars("train/reward")] == [1, 2, 3, 4]
        assert "time/actor.generation" in events.Tags()["scalars"]


def test_checkpoints_and_resume(run, tmp_path):
    out, result = run
    from nereus.rl.checkpoint import complete_steps
    from nereus.rl.checkpoint_read import manifest

    assert complete_steps(str(out)) == [2, 4]
    assert manifest(str(out / "checkpoints" / "step_4"))["plan"] == "S2"
    again = tmp_path / "again"
    shutil.copytree(out, again)
    shutil.rmtree(again / "checkpoints" / "step_4")
    resumed = _nereus("train", "--resume", str(again), "--json")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    last = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert [s["step"] for s in last["steps"]] == [3, 4] and last["resumed"]["step"] == 2
    assert last["final_weights_sha256"] == result["final_weights_sha256"]
    assert [s["reward"] for s in last["steps"]] == [s["reward"] for s in result["steps"][2:]]
    steps = [json.loads(line)["step"] for line in open(again / "samples.jsonl")]
    assert sorted(set(steps)) == [2, 4] and len(steps) == 64  # step 4's samples once, not twice


def test_export_loads_in_transformers(run, tmp_path):
    out, _ = run
    transformers = pytest.importorskip("transformers")
    import torch

    import nereus.ir as ir
    from nereus.models import logits
    from nereus.models.hf import nereus_to_hf
    from nereus.rl.export import export_hf

    written = export_hf(str(out), str(tmp_path / "hf"))
    assert written["step"] == 4 and "tokenizer.json" in written["tokenizer_files"]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    source = json.load(open(os.path.join(ARITH, "tiny-arith", "config.json")))
    config = json.load(open(tmp_path / "hf" / "config.json"))
    for key in ("rms_norm_eps", "tie_word_embeddings", "num_key_value_heads", "eos_token_id", "bos_token_id"):
        assert config[key] == source[key], key
    actor = ir.parse_file(PLAN).model("actor")
    trained = torch.load(out / "run" / "final_state.pt")
    ids = torch.tensor([[14, 3, 12, 5, 13, 7, 1]])
    with torch.no_grad():
        theirs = model(ids).logits
    ours = logits(actor, nereus_to_hf(actor, {k: v for k, v in trained.items() if k.startswith("actor/")}), ids)
    assert (theirs - ours).abs().max().item() < 1e-4
    # shards: several safetensors files and their index, loaded alike
    sharded = export_hf(str(out), str(tmp_path / "sharded"), max_shard_bytes=100_000)
    assert len(sharded["files"]) > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    with torch.no_grad():
        again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "sharded"))(ids).logits
    assert torch.equal(again, theirs)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tokenizer.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False) == "Q1+2="


def test_a_failing_reward_function_names_its_row(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def reward(prompts, responses, answer, **row):\n"
                   "    return [1.0 / (int(a) - 4) for a in answer]\n")
    done = _train(tmp_path / "out", "--steps", "3", reward=f"{bad}:reward")
    assert done.returncode == 2, done.stdout + done.stderr
    error = json.loads(done.stdout.strip().splitlines()[-1])["error"]
    assert "ZeroDivisionError" in error["message"] and "answer='4'" in error["message"], error
    assert "Traceback" not in error["message"]


def test_text_options_are_checked_before_launch(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1="}\n{"prompt": 1+1}\n')
    done = _nereus("train", PLAN, "--algo", "grpo", "--prompts", str(bad), "--reward", "x:y", "--out", str(tmp_path / "o"))
    assert done.returncode == 2 and f"{bad}:2:" in done.stderr and "not JSON" in done.stderr, done.stderr
    done = _nereus("train", PLAN, "--algo", "grpo", "--prompts", os.path.join(ARITH, "train.jsonl"),
                   "--out", str(tmp_path / "o"))
    assert done.returncode == 2 and "--prompts needs --reward" in done.stderr
    assert not (tmp_path / "o").exists()
