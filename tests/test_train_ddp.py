"""Two CPU processes (gloo, DDP through accelerate) on the tiny Wan: alternation with no_sync'd DMD
backward, checkpoints with per-rank RNG files, a kill and resume of both processes, replicas identical at the end."""

import json
import os

from rcm_diffusers.checkpoints import verify_checkpoint
from train_helpers import REPO, make_dataset, make_tiny_wan, run_trainer


def test_two_process_gloo(tmp_path):
    pipe = make_tiny_wan(str(tmp_path / "pipe"))
    data = make_dataset(str(tmp_path / "data"), "wan")
    out = tmp_path / "run"
    args = ["--config", os.path.join(REPO, "training", "configs", "tiny-wan-test.yaml"), "--pretrained", pipe,
            "--data_dir", data, "--output_dir", str(out), "--max_steps", "14", "--checkpoint_every", "7"]
    p = run_trainer([*args, "--exit_after_step", "8"], num_processes=2, timeout=150, check=False)
    assert p.returncode != 0 and "exit_after_step 8: hard exit" in p.stdout, p.stderr[-3000:]
    run_trainer([*args, "--resume", "latest"], num_processes=2, timeout=150)  # both ranks resume from step 7
    env = json.load(open(out / "env.json"))
    assert env["world_size"] == 2 and [s["start_step"] for s in env["sessions"]] == [0, 7]
    final = json.load(open(out / "final.json"))
    sums = final["student_checksum_per_rank"]
    assert len(sums) == 2 and sums[0] == sums[1]
    ck = out / "checkpoints" / "step-00000007"
    man = verify_checkpoint(str(ck))  # every rank's random state is in the manifest
    assert {"rng-rank0.safetensors", "rng-rank1.safetensors", "trainable.safetensors"} <= set(man["files"])
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(recs) == 14 and any("loss_dmd" in r for r in recs) and any(r["net"] == "fake" for r in recs)
    assert (out / "pytorch_lora_weights.safetensors").exists()
