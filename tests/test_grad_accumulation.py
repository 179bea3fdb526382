"""Gradient accumulation: ``--batch_size B --gradient_accumulation_steps N`` is one optimizer step on the same B x N
samples, with the same noise and the same loss, as ``--batch_size (B x N)``; per-sample noise
(``rcm_diffusers.rng``)."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import REPO, run_trainer, tiny_wan_run

from rcm_diffusers import rng
from rcm_diffusers.distill.config import RCMConfig, load_config, noise_seeding_of
from rcm_diffusers.distill.data import sample_generators, step_noise
from rcm_diffusers.trigflow import sample_p_D, sample_p_G

WAN = os.path.join(REPO, "training", "configs", "tiny-wan-test.yaml")
QAD = os.path.join(REPO, "training", "configs", "qad-tiny-wan-test.yaml")


def test_per_sample_draws_do_not_depend_on_the_split():
    """A batch of 4 drawn at once equals its halves drawn apart (same generators per row), bit for bit; a plain
    generator draws exactly what torch does (the historical stream)."""

    def draws(gens, B):
        return [
            sample_p_G(B, generator=gens),
            rng.randn((B, 3, 5), generator=gens, dtype=torch.float64),
            sample_p_D(B, generator=gens),
            rng.randint(7, (B,), generator=gens),
        ]

    whole = draws(sample_generators(0, 3, 0, 4), 4)
    halves = [draws(sample_generators(0, 3, 0, 4)[a : a + 2], 2) for a in (0, 2)]
    for w, h0, h1 in zip(whole, *halves):
        assert torch.equal(w, torch.cat([h0, h1]))
    # rank 1's two rows are rows 2 and 3 of the global batch
    assert torch.equal(whole[1][2:], draws(step_noise("sample", 0, 3, 1, 2), 2)[1])
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(rng.randn((2, 3), generator=g1), torch.randn((2, 3), generator=g2))


def test_config_accumulation_options():
    base = ["--pretrained", "p", "--data_dir", "d"]
    cfg = load_config([*base, "--gradient_accumulation_steps", "4"], config_cls=RCMConfig)
    assert cfg.gradient_accumulation_steps == 4 and noise_seeding_of(cfg) == "sample"
    assert noise_seeding_of(load_config(base)) == "rank"
    with pytest.raises(ValueError, match="noise_seeding"):
        load_config([*base, "--gradient_accumulation_steps", "2", "--noise_seeding", "rank"])
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        load_config([*base, "--gradient_accumulation_steps", "0"])


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    return tiny_wan_run(tmp_path_factory, "accum")


def _max_rel(a: dict, b: dict):
    """max |a - b| and max |b| over every tensor of two exports with the same keys."""
    assert a.keys() == b.keys() and a
    return (
        max(float((a[k].double() - b[k].double()).abs().max()) for k in a),
        max(float(b[k].double().abs().max()) for k in b),
    )


# The two runs do the same arithmetic per sample; what differs is float32 round-off: a matmul over 2 rows or 1 may
# block its sums differently, and the gradient is summed over the micro-batches in another order (relative 6e-8, the
# float32 unit round-off, per operation). Tolerance: 1e-6 of the largest weight (about 8 float32 units), room for that
# round-off over 4 Adam steps (``--adam_eps 1e-3`` keeps Adam from dividing round-off in a zero gradient by a zero
# second moment, as tests/test_train_ddp.py); measured: 1.1e-8 at weights of 0.2 (under one unit). ``--fd_type 0``
# (exact JVP): the finite-difference tangent (fd_type 2, h = 1e-4) divides round-off by h and the two runs' first
# gradients then differ by 3e-3 relative. A wrong normalisation (sum vs mean, a factor 2) or other noise moves the
# weights by about lr = 1e-3.
TOL = 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_rcm_accumulation_equals_larger_batch(wan, reduction):
    """rCM (student with DMD, fake score, EMA; alternating from iteration 0): batch 1 x 2 micro-batches exports the same
    LoRA and EMA LoRA as batch 2, and logs the same learning rates and losses."""
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
        "--loss_reduction",
        reduction,
        "--fd_type",
        "0",
    ]
    runs = {
        "accum": ["--batch_size", "1", "--gradient_accumulation_steps", "2"],
        "batch": ["--batch_size", "2", "--noise_seeding", "sample"],
    }
    for name, extra in runs.items():
        run_trainer([*common, *extra, "--output_dir", str(wan[2] / f"{reduction}-{name}")], timeout=300)
    out = {n: wan[2] / f"{reduction}-{n}" for n in runs}
    recs = {n: [json.loads(line) for line in open(out[n] / "metrics.jsonl")] for n in runs}
    assert [(r["net"], r["lr"]) for r in recs["accum"]] == [(r["net"], r["lr"]) for r in recs["batch"]]
    assert {r["net"] for r in recs["batch"]} == {"student", "fake"} and any("loss_dmd" in r for r in recs["batch"])
    for ra, rb in zip(recs["accum"], recs["batch"]):
        for k in [k for k in rb if k.startswith("loss")]:
            assert ra[k] == pytest.approx(rb[k], rel=1e-4), (k, ra, rb)
    for sub in ("", "ema"):
        a = load_file(str(out["accum"] / sub / "pytorch_lora_weights.safetensors"))
        b = load_file(str(out["batch"] / sub / "pytorch_lora_weights.safetensors"))
        diff, scale = _max_rel(a, b)
        print(f"rcm {reduction} {sub or 'student'}: max |dW| {diff:.3g}, max |W| {scale:.3g}")
        assert diff <= TOL * scale, (sub, diff, scale)


@pytest.mark.slow
def test_qad_accumulation_equals_larger_batch(wan):
    """QAD (scope lora, NVFP4 weights, EMA): batch 1 x 2 micro-batches ends with the same trained weights and EMA as
    batch 2. Compared: the final checkpoint's float32 weights (the export rounds to bf16, where a round-off difference
    can flip a rounding). ``--target fake`` (weight-only): ``comfyui`` quantizes activations to NVFP4 as well, a step
    function whose codes round-off can flip (measured: 6.4e-4 apart in the bf16 export)."""
    common = [
        "--config",
        QAD,
        "--pretrained",
        wan[0],
        "--data_dir",
        wan[1],
        "--max_steps",
        "4",
        "--warm_start_batches",
        "0",
        "--checkpoint_every",
        "0",
        "--adam_eps",
        "1e-3",
        "--lr",
        "1e-3",
        "--ema_rate",
        "0.3",
        "--target",
        "fake",
    ]
    runs = {
        "accum": ["--batch_size", "1", "--gradient_accumulation_steps", "2"],
        "batch": ["--batch_size", "2", "--noise_seeding", "sample"],
    }
    for name, extra in runs.items():
        run_trainer([*common, *extra, "--output_dir", str(wan[2] / f"qad-{name}")], timeout=300, script="qad.py")
    for f in ("trainable", "ema"):
        a, b = (
            load_file(str(wan[2] / f"qad-{n}" / "checkpoints" / "step-00000004" / f"{f}.safetensors")) for n in runs
        )
        diff, scale = _max_rel(a, b)
        print(f"qad {f}: max |dW| {diff:.3g}, max |W| {scale:.3g}")
        assert diff <= TOL * scale, (f, diff, scale)


@pytest.mark.slow
def test_rcm_accumulation_on_two_processes_equals_one_batch(wan):
    """2 DDP processes x batch 1 x 2 micro-batches (DDP's all-reduce skipped on the first micro-batch) export the same
    LoRA and EMA as 1 process with batch 4: per-sample noise is keyed by the position in the global batch, so the
    split over processes and micro-batches does not change a sample's noise."""
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
        "ddp_accum": (2, ["--batch_size", "1", "--gradient_accumulation_steps", "2"]),
        "batch4": (1, ["--batch_size", "4", "--noise_seeding", "sample"]),
    }
    for name, (procs, extra) in runs.items():
        run_trainer([*common, *extra, "--output_dir", str(wan[2] / name)], num_processes=procs, timeout=300)
    assert json.load(open(wan[2] / "ddp_accum" / "env.json"))["world_size"] == 2
    for sub in ("", "ema"):
        a, b = (load_file(str(wan[2] / n / sub / "pytorch_lora_weights.safetensors")) for n in runs)
        diff, scale = _max_rel(a, b)
        print(f"ddp x accumulation {sub or 'student'}: max |dW| {diff:.3g}, max |W| {scale:.3g}")
        assert diff <= TOL * scale, (sub, diff, scale)
