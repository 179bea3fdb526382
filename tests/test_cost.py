"""The FLOP and time model (``rcm_diffusers.distill.cost``) against torch's own FLOP counter and closed forms, the
one-product forward-mode rule of the linear layers (``attention.linear_jvp``), and the trainer's start-up line."""

from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from rcm_diffusers.arch import build_transformer
from rcm_diffusers.distill import cost
from rcm_diffusers.distill.adapters import Networks

LINEAR_OPS = ("mm", "addmm", "convolution")
ATTENTION_OPS = ("bmm",)  # the math SDPA path and the CPU JVP attention are batched products


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _counted(run) -> tuple[int, int]:
    """``(linear, attention)`` FLOPs torch's FlopCounterMode sees while ``run()`` runs, on the math SDPA path."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        run()
    c = {str(k).split(".")[1]: v for k, v in fc.get_flop_counts()["Global"].items()}
    return sum(c.get(k, 0) for k in LINEAR_OPS), sum(c.get(k, 0) for k in ATTENTION_OPS)


def _model(pf, role, kind):
    return pf[role][kind] - pf[role][kind + "/attention"], pf[role][kind + "/attention"]


def _wan(rank=4):
    over = dict(num_layers=2, num_attention_heads=2, ffn_dim=512)
    m = build_transformer("wan2.1-t2v-1.3b", **over)
    nets, _ = Networks.build(m, "shared", with_fake=True, lora_rank=rank)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(n)))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 2, 4, 4, dtype=torch.float64, generator=g)  # 8 video tokens
    cond = {"encoder_hidden_states": torch.randn(1, 8, 4096, generator=g)}  # 8 text tokens
    return m, nets, cost.Arch.from_arch("wan2.1-t2v-1.3b", **over), x, cond, 8, 8


def test_wan_forward_and_backward_flops_equal_torch_counter():
    """Every matrix product of a Wan forward (teacher without adapters, student with) and of the student's backward
    (input gradients where the input carries one, LoRA gradients; attention backward 2x on the math path)."""
    m, nets, arch, x, cond, L, T = _wan()
    pf = cost.pass_flops(arch, L, T, lora_rank=4, attention_backward=2.0)
    t = torch.tensor([0.7], dtype=torch.float64)
    for role in ("teacher", "student"):
        with torch.no_grad():
            got = _counted(lambda: nets.F(role, x, t, cond))
        assert got == _model(pf, role, "forward")
    with sdpa_kernel(SDPBackend.MATH):  # the math path's backward: attention as batched products
        out = nets.F("student", x, t, cond)
    assert _counted(lambda: out.double().square().sum().backward()) == _model(pf, "student", "backward")


def test_flux_forward_and_backward_flops_equal_torch_counter():
    from rcm_diffusers.distill.data import model_inputs

    over = dict(num_layers=1, num_single_layers=1, num_attention_heads=2)
    m = build_transformer("flux.1-dev", **over)
    nets, _ = Networks.build(m, "shared", with_fake=False, lora_rank=4)
    g = torch.Generator().manual_seed(0)
    batch = {
        "latents": torch.randn(1, 16, 8, 8, generator=g),
        "prompt_embeds": torch.randn(1, 8, 4096, generator=g),
        "pooled_prompt_embeds": torch.randn(1, 768, generator=g),
    }
    x0, cond, _ = model_inputs("flux", batch, "cpu", torch.float32, 3.5)
    pf = cost.pass_flops(cost.Arch.from_arch("flux.1-dev", **over), x0.shape[1], 8, lora_rank=4, attention_backward=2.0)
    t = torch.tensor([0.7], dtype=torch.float64)
    for role in ("teacher", "student"):
        with torch.no_grad():
            assert _counted(lambda: nets.F(role, x0, t, cond)) == _model(pf, role, "forward")
    with sdpa_kernel(SDPBackend.MATH):
        out = nets.F("student", x0, t, cond)
    assert _counted(lambda: out.double().square().sum().backward()) == _model(pf, "student", "backward")


def test_jvp_flops_with_the_one_product_linear_rule_and_with_the_stock_rule():
    """The sCM tangent pass through the JVP attention processors: with ``enable_linear_jvp`` every linear layer whose
    input carries a tangent costs two products (the model's count, exactly); PyTorch's own rule adds a third, on a
    zero weight tangent, to each of them."""
    from rcm_diffusers.attention import enable_jvp_attention
    from rcm_diffusers.attention.linear_jvp import disable_linear_jvp, enable_linear_jvp
    from rcm_diffusers.distill import losses as L_

    m, nets, arch, x, cond, L, T = _wan()
    enable_jvp_attention(m)
    pf = cost.pass_flops(arch, L, T, lora_rank=4)
    t, F_T = torch.tensor([0.7], dtype=torch.float64), torch.randn_like(x)

    def jvp():
        with torch.no_grad():
            L_.scm_dF(nets.F_fn("student", cond), x, t, F_T, fd_type=0)

    stock = _counted(jvp)
    enable_linear_jvp(m)
    ours = _counted(jvp)
    disable_linear_jvp(m)
    assert ours == _model(pf, "student", "jvp")
    tangent_linear = ours[0] - (pf["student"]["forward"] - pf["student"]["forward/attention"])  # the tangent products
    assert stock[1] == ours[1] and stock[0] == ours[0] + tangent_linear


@pytest.mark.parametrize("autocast", [False, True])
def test_one_product_linear_rule_gives_the_stock_tangent_bit_for_bit(autocast):
    """The same primal and tangent, bit for bit, through the tiny Wan student with LoRA (float32, and under CPU bf16
    autocast as ``mixed_precision: bf16`` runs it); grad-enabled forwards keep the stock path and its gradient."""
    from rcm_diffusers.attention import enable_jvp_attention
    from rcm_diffusers.attention.linear_jvp import disable_linear_jvp, enable_linear_jvp
    from rcm_diffusers.distill import losses as L_

    m, nets, _, x, cond, _, _ = _wan()
    enable_jvp_attention(m)
    t, F_T = torch.tensor([0.9], dtype=torch.float64), torch.randn_like(x)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), torch.no_grad():
            return L_.scm_dF(nets.F_fn("student", cond), x, t, F_T, fd_type=0)

    def grad():
        for p in m.parameters():
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            nets.F("student", x, t, cond).double().square().sum().backward()
        return [p.grad.clone() for n, p in m.named_parameters() if p.grad is not None]

    F0, dF0 = run()
    g0 = grad()
    assert enable_linear_jvp(m) > 0 and enable_linear_jvp(m) == 0  # idempotent
    F1, dF1 = run()
    g1 = grad()
    disable_linear_jvp(m)
    assert torch.equal(F0, F1) and torch.equal(dF0, dF1) and dF1.abs().max() > 0.1
    assert len(g0) == len(g1) > 0 and all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert all("forward" not in mod.__dict__ for mod in m.modules() if isinstance(mod, torch.nn.Linear))


def test_wan_1_3b_forward_flops_at_480p_closed_form():
    """One teacher forward of Wan2.1-T2V-1.3B on 81 frames at 480p (32 760 video tokens, 512 text tokens): per block
    q, k, v, out and the cross-attention's q, out on the video tokens, its k, v on the text, the feed-forward, the
    two attentions; the patch embedding, output projection, text and time embedders once."""
    D, F, Lb, L, T = 1536, 8960, 30, 21 * 30 * 52, 512
    block = 2 * L * (6 * D * D + 2 * D * F) + 2 * T * 2 * D * D + 4 * L * L * D + 4 * L * T * D
    outside = 2 * L * 64 * D * 2 + 2 * T * (4096 * D + D * D) + 2 * (256 * D + D * D + 6 * D * D)
    pf = cost.pass_flops(cost.Arch.from_arch("wan2.1-t2v-1.3b"), L, T)
    assert pf["teacher"]["forward"] == Lb * block + outside
    assert round(pf["teacher"]["forward"] / 1e12, 1) == 283.0
    assert pf["teacher"]["forward/attention"] == Lb * (4 * L * L * D + 4 * L * T * D)


def test_stated_utilisation_is_what_the_published_forward_times_imply():
    """``DEFAULT_UTILISATION``: this model's FLOPs of 100 forwards over the published FlashAttention-2 denoising
    times on one H200 give 30 % (1.3B, 480p) and 38 % (14B, 720p); the assumption is the lower."""
    u = {}
    for arch, (latent, seconds) in cost.PUBLISHED_FORWARDS.items():
        pf = cost.pass_flops(cost.Arch.from_arch(arch), cost.wan_tokens(*latent), cost.TEXT_TOKENS)
        u[arch] = 100 * pf["teacher"]["forward"] / seconds / cost.GPUS["H200 SXM (141 GB)"]
    assert round(u["wan2.1-t2v-1.3b"], 2) == 0.30 and round(u["wan2.1-t2v-14b"], 2) == 0.38
    assert cost.DEFAULT_UTILISATION == round(min(u.values()), 2)


def test_run_cost_of_the_shipped_1_3b_config():
    """training/configs/wan2.1-t2v-1.3b.yaml: 10 000 iterations, 1 000 of tangent warm-up (sCM only), then one
    student iteration in 5: 2 800 student and 7 200 fake-score iterations; the run's FLOPs are the sum of each
    iteration's passes times their FLOPs, and the hours follow at the stated utilisation."""
    import os

    from rcm_diffusers.distill.config import RCMConfig

    cfg = RCMConfig.from_yaml(
        os.path.join(os.path.dirname(os.path.dirname(__file__)), "training", "configs", "wan2.1-t2v-1.3b.yaml")
    )
    arch, L = cost.Arch.from_arch("wan2.1-t2v-1.3b"), cost.wan_tokens(21, 60, 104)
    run = cost.run_cost(cfg, arch, L)
    assert run["iterations"] == {"student": 2800, "fake": 7200}
    pf, r = run["pass_flops"], cost.Recipe.from_config(cfg)
    warm = cost.iteration_flops(cost.student_passes(r, 1, dmd=False), pf)
    stu = sum(cost.iteration_flops(cost.student_passes(r, n, dmd=True), pf) for n in (1, 2, 3, 4)) / 4
    fake = sum(cost.iteration_flops(cost.fake_passes(r, n), pf) for n in (1, 2, 3, 4)) / 4
    assert run["flops"] == pytest.approx(1000 * warm + 1800 * stu + 7200 * fake, rel=1e-12)
    h = cost.hours(run["flops"], cost.GPUS["H100 SXM (80 GB)"])
    assert h == pytest.approx(run["flops"] / (989e12 * 0.30) / 3600, rel=1e-12)
    assert round(8 * h) == 188  # GPU-hours of the run on 8 H100s (docs/benchmarks.md)


def test_trainer_startup_line_on_the_tiny_wan(tmp_path):
    """The start-up line names the FLOPs the cost model gives for the run's teacher and data, and its time."""
    from train_helpers import make_dataset, make_tiny_wan

    from rcm_diffusers.distill.config import RCMConfig

    pipe, data = make_tiny_wan(str(tmp_path / "wan")), make_dataset(str(tmp_path / "data"), "wan")
    common = dict(
        pretrained=pipe,
        data_dir=data,
        output_dir=str(tmp_path / "o"),
        fd_type=2,
        tangent_warmup=10,
        student_update_freq=3,
        guidance_scale=2.0,
    )
    cfg = RCMConfig(**common, max_steps=30).validate()
    line = cost.startup_report(cfg, world=2)
    import json
    import os

    with open(os.path.join(pipe, "transformer", "config.json")) as f:
        config = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    run = cost.run_cost(cfg, cost.Arch.from_config(config), 4, 4)  # latent 1 x 4 x 4, patch 1 x 2 x 2: 4 tokens; 4 text
    assert run["iterations"] == {"student": 10 + 7, "fake": 13}
    assert line.startswith(f"compute: predicted {run['student_flops'] / 1e12:.3g} TFLOP per student iteration, ")
    h = cost.hours(run["flops"], cost.GPUS["H100 SXM (80 GB)"])
    assert f"{h:.3g} h for the run, {2 * h:.3g} GPU-hours over 2 process(es)" in line
    assert cost.startup_report(SimpleNamespace(pretrained=str(tmp_path / "none"), experts="auto")).startswith(
        "compute: no prediction"
    )
    # a regression warm-up: its iterations cost the regression term's one grad pass each and shift the schedule
    cfg_w = RCMConfig(
        **common, max_steps=35, regression_weight=1.0, regression_data_dir=data, regression_warmup=5
    ).validate()
    run_w = cost.run_cost(cfg_w, cost.Arch.from_config(config), 4, 4)
    assert run_w["iterations"] == {"student": 10 + 7, "fake": 13, "regression": 5}
    reg = cost.iteration_flops({"student": {"forward_grad": 1, "backward": 1}}, run_w["pass_flops"])
    assert run_w["regression_flops"] == pytest.approx(reg, rel=1e-12)
    parts = sum(run_w["iterations"][r] * run_w[f"{r}_flops"] for r in ("student", "fake", "regression"))
    assert run_w["flops"] == pytest.approx(parts, rel=1e-12)
    assert cost.iteration_passes(cfg_w, 4, run_w["recipe"]) == (
        "regression",
        {"student": {"forward_grad": 1, "backward": 1}},
    )
    assert cost.iteration_passes(cfg_w, 5, run_w["recipe"]) == cost.iteration_passes(cfg, 0, run_w["recipe"])
    assert "after 5 regression warm-up iterations" in cost.startup_report(cfg_w, world=2)


def test_gpu_check_utilisation_of_timed_iterations(tmp_path, monkeypatch):
    """``benchmarks/gpu_check.py`` section 6: each timed iteration's counted FLOPs over its time and the card's peak;
    iteration 0 (compilation) is left out of the medians and the overall figure."""
    import importlib.util
    import os

    import yaml

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(repo, "benchmarks", "gpu_check.py"))
    gc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gc)
    ycfg = tmp_path / "train.yaml"
    ycfg.write_text(
        yaml.safe_dump(
            {
                "pretrained": "p",
                "data_dir": "d",
                "lora_rank": 64,
                "gradient_checkpointing": True,
                "fd_type": 0,
                "tangent_warmup": 0,
                "student_update_freq": 2,
                "max_simulation_steps": 4,
                "guidance_scale": 5.0,
            }
        )
    )
    run = {
        "arch": "wan2.1-t2v-1.3b",
        "overrides": {},
        "tokens": 32760,
        "text_tokens": 512,
        "steps": [
            {"step": 0, "step_time": 60.0},
            {"step": 1, "step_time": 10.0},
            {"step": 2, "step_time": 20.0},
            {"step": 3, "step_time": 12.0},
        ],
    }
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    u = gc.utilisation(run, str(ycfg), smoke=False)
    from rcm_diffusers.distill.config import RCMConfig

    cfg = RCMConfig.from_yaml(str(ycfg))
    pf = cost.run_pass_flops(cfg, cost.Arch.from_arch("wan2.1-t2v-1.3b"), 32760, 512)
    r = cost.Recipe.from_config(cfg)
    want = [
        cost.iteration_flops(cost.student_passes(r, 1), pf),
        cost.iteration_flops(cost.fake_passes(r, 1), pf),
        cost.iteration_flops(cost.student_passes(r, 2), pf),
        cost.iteration_flops(cost.fake_passes(r, 2), pf),
    ]
    assert [x["net"] for x in u["iterations"]] == ["student", "fake", "student", "fake"]
    assert [x["tflop"] for x in u["iterations"]] == pytest.approx([w / 1e12 for w in want], rel=1e-12)
    assert u["peak_tflop_s"] == 989.0
    assert u["median"]["student"]["tflop_s"] == pytest.approx(want[2] / 20.0 / 1e12, rel=1e-12)
    overall = sum(want[1:]) / 42.0
    assert u["overall"]["utilisation"] == pytest.approx(overall / 989e12, rel=1e-12)
