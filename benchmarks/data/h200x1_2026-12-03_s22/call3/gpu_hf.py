"""Session 22, call 3: checkpoints written by this image's transformers in bf16, on one GPU.
Per family: nereus.models.logits on CUDA (bf16 weights) against transformers' own forward
on CUDA in bf16 and in fp32, then `nereus train` GRPO on 1 process (NCCL) from the
checkpoint. Prints one JSON line last."""
import json, subprocess, sys, time, os
from pathlib import Path
import torch
sys.path.insert(0, "tests/models")
from hf_tiny import TINY, write_checkpoint
import nereus.ir as ir
from nereus.models import logits

root = Path("/tmp/ck"); root.mkdir(exist_ok=True)
out = {"transformers": __import__("transformers").__version__, "families": {}}
PLAN = """cluster one {{ nodes 1 gpus_per_node 1 gpu {{ mem 141GB flops 989TFLOPS hbm 4.8TB/s }} intra 900GB/s inter 25GB/s host_mem 1TB }}
model actor = hf("{ck}")
model ref = actor
workload grpo {{ batch 32 prompt 6 response 4 microbatch 8  generation: actor  inference: ref  training: actor }}
plan S1 {{ actor.generation dp 1 on 0  ref.inference dp 1 on 0  actor.training dp 1 on 0 }}
"""
for name in sorted(TINY):
    row = {}
    ck = root / name
    hf = write_checkpoint(name, ck, dtype=torch.bfloat16)
    (root / f"{name}.nir").write_text(PLAN.format(ck=name))
    model = ir.parse_file(root / f"{name}.nir").model("actor")
    row["dtype"] = model.dtype
    ids = torch.randint(0, model.vocab, (2, 40), generator=torch.Generator().manual_seed(1)).cuda()
    hf = hf.cuda()
    with torch.no_grad():
        ref_bf16 = hf(ids).logits.float()
        ref_fp32 = hf.float()(ids).logits
        sd = {k: v.to(torch.bfloat16) for k, v in hf.state_dict().items()}
        try:
            ours = logits(model, sd, ids).float()
            row["ours_device"] = str(ours.device)
            row["max_abs_vs_hf_bf16"] = (ours - ref_bf16).abs().max().item()
            row["max_abs_vs_hf_fp32"] = (ours - ref_fp32).abs().max().item()
            row["hf_bf16_vs_fp32"] = (ref_bf16 - ref_fp32).abs().max().item()
            row["logit_scale"] = ref_fp32.abs().max().item()
        except Exception as e:  # noqa: BLE001
            row["logits_error"] = repr(e)[:400]
    t0 = time.time()
    run = subprocess.run([sys.executable, "-c", "from nereus.cli import nereus; nereus()", "train", str(root / f"{name}.nir"),
                          "--algo", "grpo", "--nproc", "1", "--backend", "nccl", "--steps", "3", "--json",
                          "--out", str(root / f"run_{name}")], capture_output=True, text=True, timeout=150)
    row["train_rc"], row["train_s"] = run.returncode, round(time.time() - t0, 1)
    try:
        res = json.loads(run.stdout.strip().splitlines()[-1])
        row["rewards"] = [round(s["reward"], 4) for s in res.get("steps", [])]
        row["error"] = res.get("error", {}).get("message") if isinstance(res.get("error"), dict) else res.get("error")
    except Exception:  # noqa: BLE001
        row["stderr_tail"] = run.stderr[-800:]
    out["families"][name] = row
    print(name, row, flush=True)
print(json.dumps(out))
