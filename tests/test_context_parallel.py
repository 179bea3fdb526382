"""Ulysses context parallelism (rcm_diffusers.attention.ulysses) on real CPU processes over gloo, against the
unsplit run on one process.

Tolerances come from float32 round-off. With the sequence split the per-token arithmetic (projections, norms,
MLP, RoPE at each shard's true positions) is the same, and attention of a head over all tokens is the same
whichever rank runs it, so the output, the exact JVP and the finite-difference tangent come out equal (measured:
bit for bit); a parameter gradient is the sum of the two ranks' shares, a float32 sum in another order
(measured: at most 3.1e-7 of the largest entry, about 2.6 float32 units of 1.2e-7). Tolerance: 2e-6 of the
largest entry of each tensor (about 16 units). Wan I2V (condition channels, 512 text and 3 image tokens) with two
experts: the JVP and the gradients go through cross-attention over 515 context tokens with 8 instead of 16 query
rows, another order of float32 sums; there each number may differ by 4 times what float32 round-off already moves the
unsplit one (the same computation in float64, run by the 1-process launch) plus 2 units of its largest entry
(measured: at most 1.9 times)."""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import REPO, kill_after, run_script, run_trainer, tiny_wan_run

from rcm_diffusers.distill.launch import free_port

TOL = 2e-6
F32_UNIT = 2.0**-23  # float32 spacing at 1
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
    tangent (fd_type 2), both sCM losses and the LoRA gradients of their sum equal the one-process run. The same for
    Wan I2V with image tokens as two experts (condition channels, 3 image tokens and 512 text tokens whole on every
    rank, a batch whose samples go to different experts, both experts used). Refused with one line each: a model with
    3 heads, a sample of 3 tokens, ranks of a group that route a sample to different experts."""
    script = os.path.join(REPO, "tests", "cp_check.py")
    t0 = time.perf_counter()
    for n in (1, 2):
        run_trainer([], num_processes=n, timeout=240, script=script, env={"CP_OUT": str(tmp_path)})
    print(f"2 launches: {time.perf_counter() - t0:.0f} s")
    ref = load_file(str(tmp_path / "world1-rank0.safetensors"))
    assert ref["tokens"].tolist() == [16] and ref["i2v.tokens"].tolist() == [16] and int(ref["exchanges"]) == 0
    keys = ["output", "jvp", "fd", "loss_jvp", "loss_fd"] + [k for k in ref if k.startswith("grad.")]
    i2v = [k for k in ref if k.startswith("i2v.") and ref[k].is_floating_point()]
    assert len(keys) > 5 and len(i2v) > 5 and any("add_k_proj" in k for k in i2v)
    for r in (0, 1):
        got = load_file(str(tmp_path / f"world2-rank{r}.safetensors"))
        assert got["tokens"].tolist() == [8] and got["i2v.tokens"].tolist() == [8] and int(got["exchanges"]) > 0
        assert got["i2v.experts_used"].tolist() == ref["i2v.experts_used"].tolist() == [0, 1]
        for k, (diff, scale) in _compare(ref, got, keys).items():
            assert scale > 0 and diff <= TOL * scale, (r, k, diff, scale)
        worst = max(d / s for d, s in _compare(ref, got, keys).values())
        print(f"rank {r} T2V: largest difference / largest entry over {len(keys)} tensors: {worst:.3g}")
        # I2V: the split may move a number by a few times what float32 round-off already moves the unsplit one
        # (against the same computation in float64), plus 2 float32 units of its largest entry
        err32 = {k: _compare(ref, {k: ref["i2v64." + k[4:]]}, [k])[k][0] for k in i2v}
        ratio = 0.0
        for k, (diff, scale) in _compare(ref, got, i2v).items():
            assert scale > 0 and diff <= 4 * err32[k] + 2 * F32_UNIT * scale, (r, k, diff, err32[k], scale)
            ratio = max(ratio, diff / max(err32[k], F32_UNIT * scale))
        print(
            f"rank {r} I2V two experts: largest difference / float32 error of the unsplit run over {len(i2v)} tensors: "
            f"{ratio:.3g}; output and FD tangent bit for bit: "
            f"{all(_compare(ref, got, [k])[k][0] == 0 for k in ('i2v.output', 'i2v.fd'))}"
        )
        refusals = json.load(open(tmp_path / f"refusals2-rank{r}.json"))
        assert "does not divide the 3 attention heads" in refusals["heads"], refusals
        assert "3 video tokens, not divisible by 2" in refusals["tokens"], refusals
        assert "route the batch differently" in refusals["routing"], refusals


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    return tiny_wan_run(tmp_path_factory, "cp")


@pytest.mark.slow
def test_rcm_context_parallel_two_processes_equals_one(wan):
    """training/rcm.py (student with sCM by exact JVP and DMD, fake score, EMA; 4 iterations) on 2 processes with
    --context_parallel_size 2 exports the same LoRA and EMA LoRA as 1 process with the same config, batch size and
    seed, and logs the same losses; so does the same on 2 processes with FSDP2 (fsdp2_2cpu.yaml). Also 2 DDP processes
    with batch 1 and per-sample noise equal 1 process with batch 2 (this runs torch.func.jvp through the DDP wrapper:
    trainer.ddp_jvp_bypass)."""
    common = [
        "--config",
        WAN,
        "--pretrained",
        wan[0],
        "--data_dir",
        wan[1],
        "--max_steps",
        "4",
        "--tangent_warmup",
        "0",
        "--student_update_freq",
        "2",
        "--lr_warmup_steps",
        "2",
        "--checkpoint_every",
        "0",
        "--adam_eps",
        "1e-3",
        "--ema_rate",
        "0.3",
        "--fd_type",
        "0",
    ]
    runs = {
        "one": (1, ["--batch_size", "2"]),
        "cp2": (2, ["--batch_size", "2", "--context_parallel_size", "2"]),
        "ddp2": (2, ["--batch_size", "1", "--noise_seeding", "sample"]),
        "one_sample": (1, ["--batch_size", "2", "--noise_seeding", "sample"]),
    }
    for name, (procs, extra) in runs.items():
        run_trainer([*common, *extra, "--output_dir", str(wan[2] / name)], num_processes=procs, timeout=300)
    # FSDP2 (the frozen base sharded over both processes) with CP 2, launched as users do with an accelerate config
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        os.path.join(REPO, "training", "accelerate", "fsdp2_2cpu.yaml"),
        "--main_process_port",
        str(free_port()),
        os.path.join(REPO, "training", "rcm.py"),
        *common,
        "--batch_size",
        "2",
        "--context_parallel_size",
        "2",
        "--output_dir",
        str(wan[2] / "fsdp_cp2"),
    ]
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


@pytest.mark.slow
def test_rcm_context_parallel_i2v_two_experts_dp_and_resume(tmp_path):
    """training/rcm.py on a two-expert Wan I2V teacher whose experts also cross-attend to 3 image tokens (condition
    channels on the latents, 512 text tokens; sCM by exact JVP, DMD, fake score, EMA, boundary term; 4 iterations,
    per-sample noise): 2 processes with CP 2 and 4 processes with DP 2 x CP 2 (batch 1 per group, the same global
    batch of 2) export the same LoRA and EMA LoRA for both experts as 1 process with batch 2; CP 2 logs the same
    losses. A CP 2 run killed after iteration 2 and resumed from its step-2 checkpoint ends bit for bit equal to the
    uninterrupted CP 2 run (both experts' LoRA and EMA, the logged losses)."""
    from train_helpers import make_dataset, make_tiny_wan2

    pipe = make_tiny_wan2(str(tmp_path / "pipe"), i2v=True, boundary_ratio=0.9, image_dim=8)
    data = make_dataset(str(tmp_path / "data"), "wan_i2v", image_tokens=3, image_dim=8)
    common = [
        "--config",
        WAN,
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
        "2",
        "--checkpoint_every",
        "2",
        "--adam_eps",
        "1e-3",
        "--ema_rate",
        "0.3",
        "--fd_type",
        "0",
        "--sigma_max",
        "200",
        "--noise_seeding",
        "sample",
    ]
    cp2 = ["--batch_size", "2", "--context_parallel_size", "2"]
    runs = {
        "one": (1, ["--batch_size", "2"]),
        "cp2": (2, cp2),
        "dp2cp2": (4, ["--batch_size", "1", "--context_parallel_size", "2"]),
    }
    took = {}
    for name, (procs, extra) in runs.items():
        t0 = time.perf_counter()
        run_trainer([*common, *extra, "--output_dir", str(tmp_path / name)], num_processes=procs, timeout=400)
        took[name] = time.perf_counter() - t0
    t0 = time.perf_counter()
    p = run_trainer(
        [*common, *cp2, "--output_dir", str(tmp_path / "cut")],
        num_processes=2,
        timeout=400,
        check=False,
        env=kill_after(2),
    )
    assert p.returncode != 0 and "exit_after_step 2: hard exit" in p.stdout, p.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "cut" / "checkpoints")) == ["step-00000002"]
    p = run_trainer(
        [*common, *cp2, "--output_dir", str(tmp_path / "cut"), "--resume", "latest"], num_processes=2, timeout=400
    )
    assert "at iteration 2" in p.stdout
    took["cut + resume"] = time.perf_counter() - t0
    print("launches: " + ", ".join(f"{k} {v:.0f} s" for k, v in took.items()))

    def lora(run, sub):
        return load_file(str(tmp_path / run / sub / "pytorch_lora_weights.safetensors"))

    metrics = {
        n: [json.loads(line) for line in open(tmp_path / n / "metrics.jsonl")] for n in ("one", "cp2", "dp2cp2", "cut")
    }
    assert [(r["net"], r["lr"]) for r in metrics["one"]] == [(r["net"], r["lr"]) for r in metrics["dp2cp2"]] and len(
        metrics["one"]
    ) == 4
    for x, y in zip(metrics["one"], metrics["cp2"]):  # a CP group logs its whole batch, as the one process
        for k in [k for k in x if k.startswith("loss")]:
            assert y[k] == pytest.approx(x[k], rel=1e-5), (k, x, y)
    assert metrics["cut"] == [
        {**r, **{k: c[k] for k in ("step_time", "peak_mem_mb")}} for r, c in zip(metrics["cp2"], metrics["cut"])
    ]
    for n, world in (("cp2", 2), ("dp2cp2", 4)):
        assert json.load(open(tmp_path / n / "env.json"))["world_size"] == world
    subs = ("", "ema", "transformer_2", os.path.join("ema", "transformer_2"))
    for sub in subs:
        ref = lora("one", sub)
        assert any(float(v.abs().max()) > 0 for k, v in ref.items() if "lora_B" in k), sub  # this expert trained
        assert any("add_k_proj" in k for k in ref), sub  # the image-token projections carry a LoRA too
        scale = max(float(v.double().abs().max()) for v in ref.values())
        for run in ("cp2", "dp2cp2"):
            got = lora(run, sub)
            assert got.keys() == ref.keys()
            diff = max(float((ref[k].double() - got[k].double()).abs().max()) for k in ref)
            print(f"{run} vs one {sub or 'student'}: max |dW| {diff:.3g}, max |W| {scale:.3g}")
            # 1e-6 of the largest weight: round-off grown over 4 Adam steps (tests/test_grad_accumulation.py)
            assert diff <= 1e-6 * scale, (run, sub, diff, scale)
        a, b = lora("cp2", sub), lora("cut", sub)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), sub


def test_context_parallel_refusals(wan, tmp_path):
    """One line each: a CP size the process count does not divide (here 1 process), sample grids with CP, a Flux
    teacher (before any process count is looked at)."""
    from train_helpers import make_dataset, make_tiny_flux

    flux, flux_data = make_tiny_flux(str(tmp_path / "flux")), make_dataset(str(tmp_path / "flux_data"), "flux")
    p = run_script(
        [
            "--config",
            os.path.join(REPO, "training", "configs", "tiny-flux-test.yaml"),
            "--pretrained",
            flux,
            "--data_dir",
            flux_data,
            "--output_dir",
            str(tmp_path / "c"),
            "--context_parallel_size",
            "2",
        ]
    )
    assert (
        p.returncode != 0
        and "error: context parallelism is implemented for Wan transformers, not FluxTransformer2DModel" in p.stderr
    ), p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    p = run_script(
        [
            "--config",
            WAN,
            "--pretrained",
            wan[0],
            "--data_dir",
            wan[1],
            "--output_dir",
            str(tmp_path / "a"),
            "--context_parallel_size",
            "2",
            "--max_steps",
            "1",
        ]
    )
    assert p.returncode != 0 and "error: context_parallel_size 2 needs 2 x k processes, this run has 1" in p.stderr, (
        p.stderr[-2000:]
    )
    p = run_script(
        [
            "--config",
            WAN,
            "--pretrained",
            wan[0],
            "--data_dir",
            wan[1],
            "--output_dir",
            str(tmp_path / "b"),
            "--context_parallel_size",
            "2",
            "--sample_every",
            "5",
        ]
    )
    assert p.returncode != 0 and "sample_every" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def _children(pid: int) -> list[int]:
    """Pids of the live processes whose parent is ``pid`` (Linux /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == pid and stat[0] not in "ZX":
                out.append(int(d))
    return out


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_stop_within_seconds_when_the_launcher_group_is_killed(wan):
    """SIGKILL of the launcher's process group of a 2-process context-parallel run (the workers run in sessions of
    their own): both workers are gone within 5 s, and no checkpoint appears after the kill."""
    import signal

    out = wan[2] / "orphans"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--main_process_port",
        str(free_port()),
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        os.path.join(REPO, "training", "rcm.py"),
        "--config",
        WAN,
        "--pretrained",
        wan[0],
        "--data_dir",
        wan[1],
        "--output_dir",
        str(out),
        "--context_parallel_size",
        "2",
        "--max_steps",
        "100000",
        "--checkpoint_every",
        "1",
        "--checkpoints_total_limit",
        "0",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    log = open(wan[2] / "orphans.log", "w")
    launcher = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    workers = []
    try:
        deadline = time.time() + 180
        while not (out / "checkpoints" / "step-00000002").exists():  # training and checkpointing
            assert launcher.poll() is None and time.time() < deadline, open(wan[2] / "orphans.log").read()[-3000:]
            time.sleep(0.1)
        workers = _children(launcher.pid)
        assert len(workers) == 2, workers
        os.killpg(launcher.pid, signal.SIGKILL)
        killed = time.time()
        launcher.wait()
        before = sorted(os.listdir(out / "checkpoints"))
        while any(_alive(w) for w in workers) and time.time() < killed + 5:
            time.sleep(0.02)
        took = time.time() - killed
        print(f"workers gone {took:.2f} s after the launcher's group was killed")
        assert not any(_alive(w) for w in workers), f"workers alive 5 s after the launcher was killed: {workers}"
        time.sleep(1)
        after = sorted(os.listdir(out / "checkpoints"))
        # a step-N.tmp being written at the kill may stay behind (ignored on resume); no checkpoint is completed
        assert [n for n in after if not n.endswith(".tmp")] == [n for n in before if not n.endswith(".tmp")]
    finally:
        for w in workers:  # this test's own processes, if the check above failed
            if _alive(w):
                os.kill(w, signal.SIGKILL)
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        log.close()


def test_a_refused_context_parallel_setting_on_two_processes_is_one_line_and_no_folder(wan, tmp_path):
    """2 processes with CP 2 on samples of 3 video tokens: the trainer's line is printed once (by rank 0), the
    worker's exit status is 2 (the launcher's summary shows it), and no output folder or lock is created."""
    from train_helpers import make_dataset

    data = tmp_path / "odd"
    shutil.copytree(make_dataset(str(tmp_path / "base"), "wan"), data)
    lat = load_file(data / "shard-00000.safetensors")
    lat["latents"] = lat["latents"][..., :2, :].repeat(1, 1, 1, 1, 3)[..., :6].contiguous()  # [4, 1, 2, 6]: 3 tokens
    from safetensors.torch import save_file

    save_file(lat, data / "shard-00000.safetensors")
    out = tmp_path / "run"
    p = run_trainer(
        [
            "--config",
            WAN,
            "--pretrained",
            wan[0],
            "--data_dir",
            str(data),
            "--output_dir",
            str(out),
            "--context_parallel_size",
            "2",
        ],
        num_processes=2,
        check=False,
        timeout=120,
    )
    line = (
        "error: context_parallel_size 2: a sample has 3 video tokens (1 x 2 x 6 latents, patch 1 x 2 x 2), not "
        "divisible by 2"
    )
    assert p.returncode != 0 and p.stderr.count(line) == 1, p.stderr[-3000:]
    assert re.search(r"exitcode\s*: 2 ", p.stderr), p.stderr[-3000:]
    assert not out.exists()
