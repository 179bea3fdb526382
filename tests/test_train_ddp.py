"""Two CPU processes (gloo, DDP through accelerate) on the tiny Wan: alternation with no_sync'd DMD
backward, checkpoints with per-rank RNG files, a kill and resume of both processes, replicas identical at the end."""

import json
import os

import torch
from train_helpers import REPO, kill_after, make_dataset, make_tiny_wan, run_trainer

from rcm_diffusers.distill.checkpoints import verify_checkpoint


def test_two_process_gloo(tmp_path):
    pipe = make_tiny_wan(str(tmp_path / "pipe"))
    data = make_dataset(str(tmp_path / "data"), "wan")
    out = tmp_path / "run"
    args = [
        "--config",
        os.path.join(REPO, "training", "configs", "tiny-wan-test.yaml"),
        "--pretrained",
        pipe,
        "--data_dir",
        data,
        "--output_dir",
        str(out),
        "--max_steps",
        "14",
        "--checkpoint_every",
        "7",
    ]
    p = run_trainer([*args], num_processes=2, timeout=150, check=False, env=kill_after(8))
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


def test_ddp_gradient_equals_one_process_replaying_both_ranks(tmp_path):
    """Two real DDP processes (batch 2 each) and one process that replays both ranks (batch 4: rank r's rows of the
    global batch, rank r's noise generator, each term scaled by 1/2; ``tests/ddp_replay.py``) take the same
    optimizer steps: the same logged learning rate at every iteration (accelerate would step a prepared
    scheduler once per process; the trainers ask it not to) and the same gradient at each of 4 iterations
    (student with DMD at 1 and 2 simulation steps and the ODE-pair regression on each rank's own pairs, fake score
    twice, alternating from ``--tangent_warmup 0``).
    Tolerance: relative gradient difference 1e-5, float32 round-off (1.2e-7) from summing the two halves in another
    order, with room for its growth over the steps (measured: at most 2.5e-7). ``--adam_eps 1e-3`` keeps Adam
    from turning round-off in the many zero gradients (lora_B starts at zero, so lora_A's first gradient is zero)
    into ``lr``-sized steps; ``--fd_h 1e-2`` keeps the finite-difference tangent from dividing the weights' round-off
    by the default h = 1e-4 (with it the third iteration differed by 3.8e-5, and the replay from itself with the
    ranks in reverse order by 4e-6; with 1e-2, 1.3e-7). Not further than 4 iterations: at the 5th the replay alone,
    with its two halves summed in the other order, already differs from itself by 4e-4 (a step that amplifies
    round-off).
    The learning-rate bug this guards against changed the digits gradient by 6e-3 within 4 iterations."""
    from safetensors.torch import load_file

    pipe = make_tiny_wan(str(tmp_path / "pipe"))
    data = make_dataset(str(tmp_path / "data"), "wan")
    pairs = make_dataset(str(tmp_path / "pairs"), "wan", n=11, noise=True)
    script = os.path.join(REPO, "tests", "ddp_replay.py")
    common = [
        "--config",
        os.path.join(REPO, "training", "configs", "tiny-wan-test.yaml"),
        "--pretrained",
        pipe,
        "--data_dir",
        data,
        "--max_steps",
        "4",
        "--tangent_warmup",
        "0",
        "--student_update_freq",
        "2",
        "--lr_warmup_steps",
        "4",
        "--checkpoint_every",
        "0",
        "--adam_eps",
        "1e-3",
        "--regression_weight",
        "0.5",
        "--regression_data_dir",
        pairs,
        "--fd_h",
        "1e-2",
    ]
    runs = {"ddp": (2, "2", {}), "replay": (1, "4", {"REPLAY_WORLD": "2"})}
    for name, (procs, batch, env) in runs.items():
        run_trainer(
            [*common, "--batch_size", batch, "--output_dir", str(tmp_path / name)],
            num_processes=procs,
            timeout=200,
            script=script,
            env={"GRAD_OUT": str(tmp_path / f"grads-{name}"), **env},
        )
    lrs = {
        n: [(r["step"], r["net"], r["lr"]) for r in map(json.loads, open(tmp_path / n / "metrics.jsonl"))] for n in runs
    }
    assert lrs["ddp"] == lrs["replay"] and len(lrs["ddp"]) == 4, lrs
    assert json.load(open(tmp_path / "ddp" / "env.json"))["world_size"] == 2
    for step in range(4):
        g = {n: load_file(str(tmp_path / f"grads-{n}" / f"rank0-step{step}.safetensors")) for n in runs}
        assert g["ddp"].keys() == g["replay"].keys() and g["ddp"]
        assert all(
            torch.equal(v, load_file(str(tmp_path / "grads-ddp" / f"rank1-step{step}.safetensors"))[k])
            for k, v in g["ddp"].items()
        )  # DDP's replicas see the same averaged gradient
        diff = sum(float((g["ddp"][k].double() - g["replay"][k].double()).norm() ** 2) for k in g["ddp"]) ** 0.5
        norm = sum(float(v.double().norm() ** 2) for v in g["replay"].values()) ** 0.5
        assert norm > 0 and diff <= 1e-5 * norm, (step, diff, norm)
