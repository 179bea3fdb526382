"""Activation checkpointing policies (rcm_diffusers/distill/activation_checkpointing.py): ``selective`` and ``full``
give the gradients of no checkpointing, the JVP pass never checkpoints, the selective policy keeps what it says, and a
short two-expert training run exports the same LoRA under both policies."""

import os

import pytest
import torch
from safetensors.torch import load_file
from tiny import TEXT_DIM, tiny_wan_transformer
from train_helpers import REPO, make_dataset, make_tiny_wan2, run_trainer

from rcm_diffusers.distill import losses as L
from rcm_diffusers.distill.activation_checkpointing import SAVED_OPS, enable_checkpointing, recording, selective_policy
from rcm_diffusers.distill.adapters import Networks
from rcm_diffusers.distill.config import RCMConfig
from rcm_diffusers.distill.experts import WanExpertSwitch
from rcm_diffusers.models import velocity_fn
from rcm_diffusers.trigflow import TrigFlowDenoiser

RANK = 4
# Tolerance of the gradient comparison, relative to the largest gradient entry. Checkpointing reruns the same ops on
# the same values, and the selective policy hands back the very tensors of the forward pass, so every difference is
# float32 round-off of a kernel that blocks its sums differently for a recomputed tensor at another address: at most
# a few units u = 2^-24 = 6e-8 per op, accumulated over the ~30 ops of the backward through a block and two blocks:
# 64 u = 3.8e-6. Measured: 0 (bit-identical) on this CPU. A changed input (t + 1e-3, below) moves the gradient by
# about 1e-3 relative, 250 times this.
TOL = 64 * 2.0**-24


@pytest.fixture(scope="module")
def student():
    """Tiny Wan with student / fake LoRA adapters (rank 4, lora_B drawn so that every adapter gets a gradient), JVP
    attention installed as the trainer installs it for fd_type 0."""
    from rcm_diffusers.attention import enable_jvp_attention

    m = tiny_wan_transformer()
    nets, _ = Networks.build(m, "shared", with_fake=True, lora_rank=RANK)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    enable_jvp_attention(m)
    return m, nets


def _inputs(dt: float = 0.0):
    g = torch.Generator().manual_seed(0)
    x_t = torch.randn(2, 4, 2, 4, 8, generator=g, dtype=torch.float64)
    F_T = torch.randn(2, 4, 2, 4, 8, generator=g, dtype=torch.float64)
    cond = {"encoder_hidden_states": torch.randn(2, 5, TEXT_DIM, generator=g)}
    return x_t, torch.tensor([0.4, 1.1], dtype=torch.float64) + dt, F_T, cond


def _grads(student, policy: str, fd_type: int, dt: float = 0.0):
    """Gradients of the student LoRA under the sCM loss, and the checkpointed block calls made."""
    m, nets = student
    if policy == "none":
        m.disable_gradient_checkpointing()
    else:
        enable_checkpointing(m, policy, RANK)
    x_t, t, F_T, cond = _inputs(dt)
    den = TrigFlowDenoiser(velocity_fn(m, "float"), torch.float32)
    params = dict(nets.trainable_parameters("student"))
    for p in params.values():
        p.grad = None
    with recording() as rec:
        with nets.role("student"):
            loss, _ = L.scm_loss(
                lambda x, tt: den.F(x, tt, **cond), x_t, t, F_T, step=0, tangent_warmup=0, fd_type=fd_type
            )
        with nets.role("fake"):  # the backward runs after the trainer left the role (here: under another adapter)
            loss.sum().backward()
    m.disable_gradient_checkpointing()
    return {n: p.grad.clone() for n, p in params.items()}, len(rec)


def _rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max()) for k in a) / max(float(b[k].abs().max()) for k in b)


@pytest.mark.parametrize("fd_type", [0, 2])
def test_policies_give_the_gradients_of_no_checkpointing(student, fd_type):
    """sCM loss with the exact JVP (fd_type 0) or the finite difference (2): full and selective checkpointing give
    the gradients of none to float32 round-off; only the one grad-enabled student forward checkpoints (one call per
    block), the no-grad JVP / difference pass none."""
    ref, calls = _grads(student, "none", fd_type)
    assert calls == 0 and all(float(g.abs().max()) > 0 for g in ref.values())
    for policy in ("full", "selective"):
        g, calls = _grads(student, policy, fd_type)
        assert calls == len(student[0].blocks), (policy, calls)
        assert _rel(g, ref) <= TOL, (policy, _rel(g, ref))
    moved = _rel(_grads(student, "selective", fd_type, dt=1e-3)[0], ref)  # the comparison sees a real change
    assert moved > 100 * TOL, moved


def test_selective_keeps_products_and_attention_not_lora_up(student):
    """What the selective policy caches in a block: the base projections (addmm), the rank-wide lora_A outputs (mm)
    and both attentions (output and log-sum-exp); the lora_B up-projections (reduction over the rank) are recomputed."""
    m, nets = student
    enable_checkpointing(m, "selective", RANK)
    x_t, t, _, cond = _inputs()
    den = TrigFlowDenoiser(velocity_fn(m, "float"), torch.float32)
    with nets.role("student"), recording() as rec:
        den.F(x_t, t, **cond)
    m.disable_gradient_checkpointing()
    cache = rec[0][1].storage
    shapes = {}
    for op, per_op in cache.items():
        for e in per_op.values():
            leaves = e if isinstance(e, (tuple, list)) else [e]
            vals = [w.val for w in leaves if hasattr(w, "val")]
            if vals:
                shapes.setdefault(str(op).split(".")[1], []).append(tuple(vals[0].shape))
    assert set(shapes) <= {str(op).split(".")[1] for op in SAVED_OPS}, shapes.keys()
    # 8 adapted projections on the video tokens + 2 on the text tokens, each a biased base addmm and a lora_A mm
    assert len(shapes["addmm"]) == 10 and len(shapes["mm"]) == 10
    assert all(s[-1] == RANK for s in shapes["mm"])  # lora_A only: no lora_B output (width D) was kept
    assert sum(len(v) for k, v in shapes.items() if "scaled_dot_product" in k) == 2
    policy = selective_policy(RANK)
    a, w = torch.zeros(3, RANK), torch.zeros(RANK, 7)
    assert policy(None, torch.ops.aten.mm.default, a, w).name == "PREFER_RECOMPUTE"
    assert (
        policy(None, torch.ops.aten.mm.default, torch.zeros(3, RANK + 1), torch.zeros(RANK + 1, 7)).name == "MUST_SAVE"
    )
    assert policy(None, torch.ops.aten.gelu.default, a).name == "PREFER_RECOMPUTE"


def test_config_and_two_experts():
    """Old configs load (policy full); bad values fail with the option named; both experts get the function."""
    base = dict(pretrained="p", data_dir="d")
    assert RCMConfig(**base).validate().checkpointing_policy == "full"
    RCMConfig(**base, gradient_checkpointing=True, checkpointing_policy="selective").validate()
    with pytest.raises(ValueError, match="checkpointing_policy = 'sac': use 'full' or 'selective'"):
        RCMConfig(**base, gradient_checkpointing=True, checkpointing_policy="sac").validate()
    with pytest.raises(
        ValueError, match="checkpointing_policy = 'selective': applies with gradient_checkpointing true"
    ):
        RCMConfig(**base, checkpointing_policy="selective").validate()
    switch = WanExpertSwitch(tiny_wan_transformer(), tiny_wan_transformer(), 0.875)
    enable_checkpointing(switch, "selective", RANK)
    funcs = {id(e._gradient_checkpointing_func) for e in switch.experts.values()}
    assert all(e.gradient_checkpointing for e in switch.experts.values()) and len(funcs) == 1


@pytest.mark.slow
def test_two_expert_training_exports_the_same_lora(tmp_path_factory):
    """Two experts, fd_type 0, student (sCM + DMD + boundary term) and fake-score steps: selective and full
    checkpointing export the same LoRA pair. Tolerance: the gradients agree to round-off (above; measured equal), so
    the weights after 2 Adam steps of lr 1e-3 agree to a few float32 units of the largest weight: 1e-6 of it (a
    recompute under the wrong adapter, the bug the adapter-state guard fixes, moved them by about 2e-2 of it in 3
    steps)."""
    root = tmp_path_factory.mktemp("sac")
    pipe, data = make_tiny_wan2(str(root / "pipe")), make_dataset(str(root / "data"), "wan")
    common = [
        "--config",
        os.path.join(REPO, "training", "configs", "tiny-wan-test.yaml"),
        "--pretrained",
        pipe,
        "--data_dir",
        data,
        "--max_steps",
        "2",
        "--tangent_warmup",
        "0",
        "--student_update_freq",
        "2",
        "--checkpoint_every",
        "0",
        "--fd_type",
        "0",
        "--adam_eps",
        "1e-3",
        "--gradient_checkpointing",
        "true",
    ]
    for policy in ("full", "selective"):
        run_trainer([*common, "--checkpointing_policy", policy, "--output_dir", str(root / policy)], timeout=300)
    for sub in ("", "transformer_2"):
        a, b = (load_file(str(root / p / sub / "pytorch_lora_weights.safetensors")) for p in ("selective", "full"))
        assert a.keys() == b.keys() and a
        diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
        scale = max(float(b[k].double().abs().max()) for k in b)
        assert diff <= 1e-6 * scale, (sub, diff, scale)
