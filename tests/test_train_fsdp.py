"""FSDP2 as users scale out, on 2 CPU processes (gloo): ``accelerate launch --config_file
training/accelerate/fsdp2_2cpu.yaml training/rcm.py`` on the tiny Wan in shared-base LoRA mode.

accelerate builds FSDP only on GPUs (``AcceleratorState``: MULTI_CPU never becomes
``DistributedType.FSDP``), so the trainer takes the FSDP request and shards the frozen base itself
with ``torch.distributed.fsdp.fully_shard`` (``rcm_diffusers/distill/fsdp.py``) -- the code path of the GPU
config. Checked: the base is sharded, only the trainable LoRA is saved (full tensors that
``load_lora_weights`` takes), a killed run resumes bit-exactly, and the LoRA equals a DDP run with
the same global batch and the same per-rank noise streams.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import REPO, kill_after, make_dataset, make_tiny_wan, run_trainer

from rcm_diffusers.distill.launch import free_port

pytestmark = pytest.mark.slow
STEPS = ["--max_steps", "4", "--checkpoint_every", "2", "--tangent_warmup", "1", "--student_update_freq", "2"]


def launch_fsdp(args, check=True, timeout=300, env=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        os.path.join(REPO, "training", "accelerate", "fsdp2_2cpu.yaml"),
        "--main_process_port",
        str(free_port()),
        os.path.join(REPO, "training", "rcm.py"),
        *args,
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"FSDP trainer failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return p


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    pipe = make_tiny_wan(str(root / "pipe"))
    data = make_dataset(str(root / "data"), "wan")
    base = [
        "--config",
        os.path.join(REPO, "training", "configs", "tiny-wan-test.yaml"),
        "--pretrained",
        pipe,
        "--data_dir",
        data,
    ]
    out = {"pipe": pipe}
    # FSDP2 runs with selective activation checkpointing, DDP without checkpointing: the recompute must not change a
    # gradient, so the comparison below also checks the policy under FSDP2
    sac = ["--gradient_checkpointing", "true", "--checkpointing_policy", "selective"]
    out["fsdp"] = root / "fsdp"
    launch_fsdp(base + ["--output_dir", str(out["fsdp"]), *STEPS, *sac])
    out["ddp"] = root / "ddp"
    run_trainer(base + ["--output_dir", str(out["ddp"]), *STEPS], num_processes=2, timeout=300)
    # killed right after iteration 2 (the checkpoint at step 2 was written after iteration 1), then resumed
    out["resumed"] = root / "resumed"
    p = launch_fsdp(base + ["--output_dir", str(out["resumed"]), *STEPS, *sac], check=False, env=kill_after(2))
    assert p.returncode != 0 and not (out["resumed"] / "final.json").exists()
    assert "exit_after_step 2: hard exit" in p.stdout, p.stdout[-3000:] + p.stderr[-6000:]
    assert sorted(os.listdir(out["resumed"] / "checkpoints")) == ["step-00000002"]
    launch_fsdp(base + ["--output_dir", str(out["resumed"]), *STEPS, *sac, "--resume", "latest"])
    return out


def lora(run):
    return load_file(str(run / "pytorch_lora_weights.safetensors"))


def test_fsdp2_run_shards_and_saves_only_full_lora(runs):
    env = json.load(open(runs["fsdp"] / "env.json"))
    assert env["world_size"] == 2 and env["fsdp"] == {
        "layer_classes": ["WanTransformerBlock"],
        "reshard_after_forward": True,
    }
    final = json.load(open(runs["fsdp"] / "final.json"))
    assert final["step"] == 4 and final["student_checksum_per_rank"][0] == final["student_checksum_per_rank"][1]
    # checkpoint: trainable weights only, each at its full (unsharded) shape
    from train_helpers import tiny_wan_transformer

    from rcm_diffusers.distill.adapters import add_rcm_adapters

    ref = tiny_wan_transformer()
    add_rcm_adapters(ref, 4, None, with_fake=True)
    want = {f"shared::{k}": tuple(p.shape) for k, p in ref.named_parameters() if p.requires_grad}
    ck = load_file(str(runs["fsdp"] / "checkpoints" / "step-00000002" / "trainable.safetensors"))
    assert {k: tuple(v.shape) for k, v in ck.items()} == want
    # the exported student LoRA loads into the stock pipeline
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(runs["pipe"], text_encoder=None, tokenizer=None)
    pipe.load_lora_weights(str(runs["fsdp"]))
    sd = lora(runs["fsdp"])
    assert sd and all(v.dtype == torch.float32 for v in sd.values())
    assert any(float(v.abs().max()) > 0 for k, v in sd.items() if "lora_B" in k)  # it trained


def test_fsdp2_resume_is_bit_exact(runs):
    a, b = lora(runs["fsdp"]), lora(runs["resumed"])
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ema_a = load_file(str(runs["fsdp"] / "ema" / "pytorch_lora_weights.safetensors"))
    ema_b = load_file(str(runs["resumed"] / "ema" / "pytorch_lora_weights.safetensors"))
    assert all(torch.equal(ema_a[k], ema_b[k]) for k in ema_a)


def test_fsdp2_equals_ddp_same_global_batch(runs):
    """Same global batch (2 ranks x batch_size 2) and per-rank noise: FSDP2 (sharded base, replicated
    LoRA, averaged grads, selective activation checkpointing) and DDP (no checkpointing) must give the same LoRA up to
    float32 round-off. Tolerance: AdamW with
    beta1 = 0 moves each weight by about lr * g / sqrt(v) (about lr = 1e-3 in the first steps), so an
    element whose gradient is near zero can flip its update on round-off alone (seen: 101 of 3968 elements
    above 4e-6, max 9.1e-5, median 1.9e-7). The typical element must agree to round-off (median below
    1e-6, i.e. 0.1 % of one update); a missing or wrong gradient average changes typical updates by O(lr)
    and fails. No element may differ by more than Adam's bound 2 * lr * steps."""
    a, b = lora(runs["fsdp"]), lora(runs["ddp"])
    assert a.keys() == b.keys()
    diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    assert float(diff.median()) <= 1e-6, float(diff.median())
    assert float(diff.max()) <= 2 * 1e-3 * 4
    assert max(float(v.abs().max()) for v in b.values()) > 1e-3  # the LoRA moved by more than the tolerance
    ma = [json.loads(x) for x in open(runs["fsdp"] / "metrics.jsonl")]
    mb = [json.loads(x) for x in open(runs["ddp"] / "metrics.jsonl")]
    assert [r["net"] for r in ma] == [r["net"] for r in mb]
    for ra, rb in zip(ma, mb):
        for key in ("loss_scm", "loss_dmd", "loss_fake"):
            if key in rb:
                assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-8)


# ----------------------------------------------------------------------------- in-process pieces


def test_take_fsdp_request_parses_and_refuses():
    from rcm_diffusers.distill.fsdp import take_fsdp_request

    assert take_fsdp_request({}) is None
    env = {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "FSDP_TRANSFORMER_CLS_TO_WRAP": "FluxTransformerBlock,FluxSingleTransformerBlock",
        "FSDP_RESHARD_AFTER_FORWARD": "false",
        "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
        "OTHER": "x",
    }
    assert take_fsdp_request(env) == {
        "layer_classes": ["FluxTransformerBlock", "FluxSingleTransformerBlock"],
        "reshard_after_forward": False,
    }
    assert env == {"OTHER": "x"}  # accelerate must not see the FSDP request (it would wrap the model itself)
    for bad, msg in [
        ({"FSDP_VERSION": "1"}, "FSDP2 only"),
        ({"FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true"}, "offload"),
        ({"FSDP_VERSION": "2", "FSDP_ACTIVATION_CHECKPOINTING": "true"}, "gradient_checkpointing"),
    ]:
        with pytest.raises(SystemExit, match=msg):
            take_fsdp_request({"ACCELERATE_USE_FSDP": "true", **bad})


def test_fsdp2_wrapped_transformer_keeps_its_velocity(tmp_path):
    """FSDP2 renames the class (``FSDPWanTransformer3DModel``); ``velocity_fn`` must still find the Wan
    timestep scale (old code: ValueError 'unsupported transformer class'), and the sharded model's output
    equals the plain one; adapters are left unsharded (plain tensors), the base is DTensor."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from train_helpers import tiny_wan_transformer

    from rcm_diffusers.distill.adapters import Networks
    from rcm_diffusers.distill.fsdp import all_reduce_grads, shard_frozen_base
    from rcm_diffusers.models import velocity_fn

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        plain = tiny_wan_transformer()
        Networks.build(plain, "shared", with_fake=True, lora_rank=4)
        sharded = tiny_wan_transformer()
        Networks.build(sharded, "shared", with_fake=True, lora_rank=4)
        sharded.load_state_dict(plain.state_dict())
        shard_frozen_base(sharded, ["WanTransformerBlock"])
        assert type(sharded).__name__.startswith("FSDP")
        assert all(isinstance(p, DTensor) != p.requires_grad for p in sharded.parameters())
        g = torch.Generator().manual_seed(0)
        x, ctx = torch.randn(1, 4, 1, 4, 4, generator=g), torch.randn(1, 4, 16, generator=g)
        r = torch.tensor([0.3])
        with torch.no_grad():
            assert torch.equal(
                velocity_fn(sharded)(x, r, encoder_hidden_states=ctx),
                velocity_fn(plain)(x, r, encoder_hidden_states=ctx),
            )
        p = next(p for p in sharded.parameters() if p.requires_grad)
        p.grad = torch.ones_like(p)
        all_reduce_grads([p])  # world 1: unchanged
        assert torch.equal(p.grad, torch.ones_like(p))
    finally:
        dist.destroy_process_group()


def test_switch_run_both_calls_both_experts_with_zero_effect():
    """``WanExpertSwitch.run_both`` (FSDP2): with every sample on the high-noise expert, the low-noise one still runs
    (on sample 0, unrecorded), its output enters times zero: the result equals the plain switch's exactly, and the
    low expert's parameters get zero gradients (not none), so every rank joins the same collectives."""
    from train_helpers import tiny_wan_transformer

    from rcm_diffusers.distill.experts import HIGH, WanExpertSwitch

    hi, lo = tiny_wan_transformer(), tiny_wan_transformer()
    sw = WanExpertSwitch(hi, lo, 0.5)
    x, ehs = torch.randn(2, 4, 1, 4, 4), torch.randn(2, 4, 16)
    ts = torch.tensor([900.0, 700.0])
    ref = sw(x, ts, ehs, return_dict=False)[0]
    sw.run_both, sw.calls = True, []
    out = sw(x, ts, ehs, return_dict=False)[0]
    assert torch.equal(out, ref) and sw.calls == [(HIGH, [900.0, 700.0])]
    out.square().sum().backward()
    assert all(p.grad is not None and float(p.grad.abs().max()) == 0 for p in lo.parameters())
    assert any(float(p.grad.abs().max()) > 0 for p in hi.parameters())


def lora_difference(root, sub: str, label: str) -> tuple[float, float]:
    """``(max |dW|, max |W|)`` between the LoRA files ``root/fsdp/sub`` and ``root/ddp/sub`` (same keys, not empty)."""
    a, b = (load_file(str(root / n / sub / "pytorch_lora_weights.safetensors")) for n in ("fsdp", "ddp"))
    assert a.keys() == b.keys() and a
    diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    scale = max(float(v.double().abs().max()) for v in b.values())
    print(f"fsdp vs ddp, {label}: max |dW| {diff:.3g}, max |W| {scale:.3g}")
    return diff, scale


def test_fsdp2_dcm_with_fixed_angle_dmd_equals_ddp(tmp_path):
    """The JVP-free recipe (dCM + DMD on fixed angles) scales out as sCM does: on 2 gloo processes DDP keeps the
    replicas identical through the CM backward (no_sync'd after the DMD one) and the fake-score steps, and FSDP2 with
    selective checkpointing exports the same student LoRA and EMA. Tolerance as for two experts below: 1e-6 of the
    largest weight (``--adam_eps 1e-3`` keeps an element with a near-zero gradient from turning round-off into a
    whole update)."""
    pipe, data = make_tiny_wan(str(tmp_path / "pipe")), make_dataset(str(tmp_path / "data"), "wan")
    args = [
        "--config",
        os.path.join(REPO, "training", "configs", "tiny-wan-test.yaml"),
        "--pretrained",
        pipe,
        "--data_dir",
        data,
        "--max_steps",
        "6",
        "--tangent_warmup",
        "2",
        "--student_update_freq",
        "2",
        "--checkpoint_every",
        "0",
        "--cm_type",
        "dcm",
        "--dmd_fix_timesteps",
        "true",
        "--adam_eps",
        "1e-3",
        "--ema_rate",
        "0.3",
    ]
    run_trainer([*args, "--output_dir", str(tmp_path / "ddp")], num_processes=2, timeout=300)
    sums = json.load(open(tmp_path / "ddp" / "final.json"))["student_checksum_per_rank"]
    assert len(sums) == 2 and sums[0] == sums[1]
    recs = [json.loads(line) for line in open(tmp_path / "ddp" / "metrics.jsonl")]
    assert any("loss_dcm" in r and "loss_dmd" in r for r in recs) and any(r["net"] == "fake" for r in recs)
    assert not any("loss_scm" in r for r in recs)
    launch_fsdp(
        [
            *args,
            "--output_dir",
            str(tmp_path / "fsdp"),
            "--gradient_checkpointing",
            "true",
            "--checkpointing_policy",
            "selective",
        ]
    )
    for sub in ("", "ema"):
        diff, scale = lora_difference(tmp_path, sub, f"dCM + fixed DMD, {sub or 'live'}")
        assert scale > 1e-3 and diff <= 1e-6 * scale, (sub, diff, scale)


def test_fsdp2_two_experts_equals_ddp(tmp_path):
    """Two experts (Wan 2.2 style, both trained in one run) with FSDP2 on 2 processes export the same two LoRAs and
    EMAs as DDP on 2 processes (same per-rank data and noise), within float32 round-off: 1e-6 of the largest weight
    (measured 7.5e-9 at weights of 0.2; ``--adam_eps 1e-3`` as tests/test_train_ddp.py, exact JVP)."""
    from train_helpers import make_tiny_wan2

    pipe, data = make_tiny_wan2(str(tmp_path / "pipe")), make_dataset(str(tmp_path / "data"), "wan")
    args = [
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
        "2",
        "--checkpoint_every",
        "0",
        "--adam_eps",
        "1e-3",
        "--ema_rate",
        "0.3",
        "--fd_type",
        "0",
        "--batch_size",
        "2",
    ]
    launch_fsdp([*args, "--output_dir", str(tmp_path / "fsdp")])
    run_trainer([*args, "--output_dir", str(tmp_path / "ddp")], num_processes=2, timeout=300)
    assert json.load(open(tmp_path / "fsdp" / "env.json"))["fsdp"]["layer_classes"] == ["WanTransformerBlock"]
    for sub in ("", "ema", "transformer_2", os.path.join("ema", "transformer_2")):
        diff, scale = lora_difference(tmp_path, sub, f"two experts, {sub or 'high'}")
        assert diff <= 1e-6 * scale, (sub, diff, scale)
