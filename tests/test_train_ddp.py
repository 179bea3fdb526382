"""Two CPU processes (gloo, DDP through accelerate) on the tiny Wan: alternation with no_sync'd DMD
backward, checkpoints with per-rank RNG files, replicas identical at the end."""

import json
import os

from train_helpers import REPO, make_dataset, make_tiny_wan, run_trainer


def test_two_process_gloo(tmp_path):
    pipe = make_tiny_wan(str(tmp_path / "pipe"))
    data = make_dataset(str(tmp_path / "data"), "wan")
    out = tmp_path / "run"
    run_trainer(["--config", os.path.join(REPO, "training", "configs", "tiny-wan-test.yaml"), "--pretrained", pipe,
                 "--data_dir", data, "--output_dir", str(out), "--max_steps", "14", "--checkpoint_every", "7"], num_processes=2, timeout=150)
    env = json.load(open(out / "env.json"))
    assert env["world_size"] == 2
    final = json.load(open(out / "final.json"))
    sums = final["student_checksum_per_rank"]
    assert len(sums) == 2 and sums[0] == sums[1]
    ck = out / "checkpoints" / "step-00000007"
    assert (ck / "random_states_0.pkl").exists() and (ck / "random_states_1.pkl").exists()
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(recs) == 14 and any("loss_dmd" in r for r in recs) and any(r["net"] == "fake" for r in recs)
    assert (out / "pytorch_lora_weights.safetensors").exists()
