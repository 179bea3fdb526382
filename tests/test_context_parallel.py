"""Ulysses context parallelism (rcm_diffusers.attention.ulysses) on real CPU processes over gloo, against the
unsplit run on one process.

Tolerances come from float32 round-off. With the sequence split the per-token arithmetic (projections, norms,
MLP, RoPE at each shard's true positions) is the same, and attention of a head over all tokens is the same
whichever rank runs it, so the output, the exact JVP and the finite-difference tangent come out equal (measured:
bit for bit); a parameter gradient is the sum of the two ranks' shares, a float32 sum in another order
(measured: at most 3.1e-7 of the largest entry, about 2.6 float32 units of 1.2e-7). Tolerance: 2e-6 of the
largest entry of each tensor (about 16 units)."""

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from rcm_diffusers.distill.runs import free_port
from train_helpers import REPO, run_script, run_trainer, tiny_wan_run

TOL = 2e-6
WAN = os.path.join(REPO, "training", "configs", "tiny-wan-test.yaml")


def _compare(ref: dict, other: dict, keys) -> dict:
    out = {}
    for k in keys:
        a, b = ref[k].double(), other[k].double()
        assert a.shape == b.shape, k
        out[k] = (float((a - b).abs().max()), float(a.abs().max()))
    return out


@pytest.mark.slow
def test_transformer_output_jvp_and_gradients_split_over_two_processes(tmp_path):
    """Tiny Wan T2V with a LoRA (16 video tokens, 2 heads): on 2 processes with CP 2 (8 tokens each, checked, and
    the all-to-all really exchanged) the transformer output, the exact JVP (fd_type 0), the finite-difference
    tangent (fd_type 2), both sCM losses and the LoRA gradients of their sum equal the one-process run; a model with
    3 heads and a sample of 3 tokens are refused with one line each."""
    script = os.path.join(REPO, "tests", "cp_check.py")
    for n in (1, 2):
        run_trainer([], num_processes=n, timeout=240, script=script, env={"CP_OUT": str(tmp_path)})
    ref = load_file(str(tmp_path / "world1-rank0.safetensors"))
    assert ref["tokens"].tolist() == [16] and int(ref["exchanges"]) == 0
    keys = ["output", "jvp", "fd", "loss_jvp", "loss_fd"] + [k for k in ref if k.startswith("grad.")]
    assert len(keys) > 5
    for r in (0, 1):
        got = load_file(str(tmp_path / f"world2-rank{r}.safetensors"))
        assert got["tokens"].tolist() == [8] and int(got["exchanges"]) > 0
        for k, (diff, scale) in _compare(ref, got, keys).items():
            assert scale > 0 and diff <= TOL * scale, (r, k, diff, scale)
        worst = max(d / s for d, s in _compare(ref, got, keys).values())
        print(f"rank {r}: largest difference / largest entry over {len(keys)} tensors: {worst:.3g}")
        refusals = json.load(open(tmp_path / f"refusals2-rank{r}.json"))
        assert "does not divide the 3 attention heads" in refusals["heads"], refusals
        assert "3 video tokens, not divisible by 2" in refusals["tokens"], refusals


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    return tiny_wan_run(tmp_path_factory, "cp")


@pytest.mark.slow
def test_rcm_context_parallel_two_processes_equals_one(wan):
    """training/rcm.py (student with sCM by exact JVP and DMD, fake score, EMA; 4 iterations) on 2 processes with
    --context_parallel_size 2 exports the same LoRA and EMA LoRA as 1 process with the same config, batch size and
    seed, and logs the same losses; so does the same on 2 processes with FSDP2 (fsdp2_2cpu.yaml). Also 2 DDP processes with batch 1 and per-sample noise equal 1 process with
    batch 2 (this runs torch.func.jvp through the DDP wrapper: trainer.ddp_jvp_bypass)."""
    common = ["--config", WAN, "--pretrained", wan[0], "--data_dir", wan[1], "--max_steps", "4", "--tangent_warmup", "0",
              "--student_update_freq", "2", "--lr_warmup_steps", "2", "--checkpoint_every", "0", "--adam_eps", "1e-3",
              "--ema_rate", "0.3", "--fd_type", "0"]
    runs = {"one": (1, ["--batch_size", "2"]), "cp2": (2, ["--batch_size", "2", "--context_parallel_size", "2"]),
            "ddp2": (2, ["--batch_size", "1", "--noise_seeding", "sample"]),
            "one_sample": (1, ["--batch_size", "2", "--noise_seeding", "sample"])}
    for name, (procs, extra) in runs.items():
        run_trainer([*common, *extra, "--output_dir", str(wan[2] / name)], num_processes=procs, timeout=300)
    # FSDP2 (the frozen base sharded over both processes) with CP 2, launched as users do with an accelerate config
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           os.path.join(REPO, "training", "accelerate", "fsdp2_2cpu.yaml"), "--main_process_port", str(free_port()),
           os.path.join(REPO, "training", "rcm.py"), *common, "--batch_size", "2", "--context_parallel_size", "2",
           "--output_dir", str(wan[2] / "fsdp_cp2")]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    assert json.load(open(wan[2] / "fsdp_cp2" / "env.json"))["fsdp"]["layer_classes"] == ["WanTransformerBlock"]
    for a, b in (("one", "cp2"), ("one_sample", "ddp2"), ("one", "fsdp_cp2")):
        assert json.load(open(wan[2] / b / "env.json"))["world_size"] == 2
        ra, rb = ([json.loads(line) for line in open(wan[2] / n / "metrics.jsonl")] for n in (a, b))
        assert [(r["net"], r["lr"]) for r in ra] == [(r["net"], r["lr"]) for r in rb] and len(ra) == 4
        for x, y in zip(ra, rb) if b != "ddp2" else ():  # DDP logs rank 0's own samples only
            for k in [k for k in x if k.startswith("loss")]:
                assert y[k] == pytest.approx(x[k], rel=1e-5), (b, k, x, y)
        for sub in ("", "ema"):
            wa, wb = (load_file(str(wan[2] / n / sub / "pytorch_lora_weights.safetensors")) for n in (a, b))
            assert wa.keys() == wb.keys() and wa
            diff = max(float((wa[k].double() - wb[k].double()).abs().max()) for k in wa)
            scale = max(float(v.double().abs().max()) for v in wa.values())
            print(f"{b} vs {a} {sub or 'student'}: max |dW| {diff:.3g}, max |W| {scale:.3g}")
            # 1e-6 of the largest weight: round-off grown over 4 Adam steps (tests/test_grad_accumulation.py)
            assert diff <= 1e-6 * scale, (b, sub, diff, scale)


def test_context_parallel_refusals(wan, tmp_path):
    """One line each: a CP size the process count does not divide (here 1 process), sample grids with CP."""
    p = run_script(["--config", WAN, "--pretrained", wan[0], "--data_dir", wan[1], "--output_dir", str(tmp_path / "a"),
                    "--context_parallel_size", "2", "--max_steps", "1"])
    assert p.returncode != 0 and "error: context_parallel_size 2 needs 2 x k processes, this run has 1" in p.stderr, p.stderr[-2000:]
    p = run_script(["--config", WAN, "--pretrained", wan[0], "--data_dir", wan[1], "--output_dir", str(tmp_path / "b"),
                    "--context_parallel_size", "2", "--sample_every", "5"])
    assert p.returncode != 0 and "sample_every" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
