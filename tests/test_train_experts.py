"""Wan 2.2 two-expert rCM in one run (docs/math.md §6.1) on tiny random two-expert Wan T2V and I2V pipelines.

The expert rule is diffusers' own (``WanPipeline.__call__`` / ``WanImageToVideoPipeline.__call__``: the step's
``t >= boundary_ratio * num_train_timesteps`` uses ``transformer``, else ``transformer_2``); the stock
pipelines are the reference for which expert runs at which time and for what the exported LoRA pair does.
"""

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import REPO, kill_after, make_dataset, make_tiny_wan2, run_trainer

from rcm_diffusers.distill.experts import HIGH, LOW, WanExpertSwitch, boundary_sigma, sample_p_G_experts
from rcm_diffusers.trigflow import sample_p_G, t_to_r

CONFIG = os.path.join(REPO, "training", "configs", "tiny-wan-test.yaml")
F64 = torch.float64


def _experts(in_channels=4):
    from diffusers import WanTransformer3DModel

    out = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        out.append(
            WanTransformer3DModel(
                patch_size=(1, 2, 2),
                num_attention_heads=2,
                attention_head_dim=12,
                in_channels=in_channels,
                out_channels=4,
                text_dim=16,
                freq_dim=32,
                ffn_dim=32,
                num_layers=2,
                rope_max_seq_len=32,
            ).eval()
        )
    return out


# ----------------------------------------------------------------------------- the switch


def test_switch_routes_each_sample_like_the_pipeline_and_under_jvp():
    """A batch straddling the boundary equals each expert run on its own samples (same math, another batch
    split: float32 round-off, 1e-5 at outputs of size ~1); the JVP through the switch equals each expert's JVP."""
    hi, lo = _experts()
    sw = WanExpertSwitch(hi, lo, 0.875)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 4, 1, 4, 4, generator=g)
    ehs = torch.randn(4, 3, 16, generator=g)
    ts = torch.tensor([990.0, 875.0, 874.9, 100.0])  # 875 itself is high: t >= boundary, as the pipelines compare
    sw.calls = []
    with torch.no_grad():
        out = sw(x, ts, ehs, return_dict=False)[0]
        ref_h = hi(x[:2], ts[:2], ehs[:2], return_dict=False)[0]
        ref_l = lo(x[2:], ts[2:], ehs[2:], return_dict=False)[0]
    assert (
        [c[0] for c in sw.calls] == [HIGH, LOW]
        and sw.calls[0][1] == [990.0, 875.0]
        and sw.calls[1][1] == pytest.approx([874.9, 100.0])
    )
    torch.testing.assert_close(out, torch.cat([ref_h, ref_l]), rtol=0, atol=1e-5)
    # pinned: the rule is overridden per sample
    with torch.no_grad(), sw.pinned(torch.tensor([False, False, True, True])):
        pinned = sw(x, ts, ehs, return_dict=False)[0]
        ref = torch.cat(
            [lo(x[:2], ts[:2], ehs[:2], return_dict=False)[0], hi(x[2:], ts[2:], ehs[2:], return_dict=False)[0]]
        )
    torch.testing.assert_close(pinned, ref, rtol=0, atol=1e-5)
    # forward-mode AD through the split (the sCM tangent with fd_type 0), x and t tangents
    from rcm_diffusers.attention import enable_jvp_attention

    enable_jvp_attention(sw, backend="torch")
    dx, dt = torch.randn(x.shape, generator=g), torch.tensor([1.0, -2.0, 0.5, 3.0])
    _, jv = torch.func.jvp(lambda a, t: sw(a, t, ehs, return_dict=False)[0], (x, ts), (dx, dt))
    _, jh = torch.func.jvp(lambda a, t: hi(a, t, ehs[:2], return_dict=False)[0], (x[:2], ts[:2]), (dx[:2], dt[:2]))
    _, jl = torch.func.jvp(lambda a, t: lo(a, t, ehs[2:], return_dict=False)[0], (x[2:], ts[2:]), (dx[2:], dt[2:]))
    torch.testing.assert_close(jv, torch.cat([jh, jl]), rtol=0, atol=1e-4)
    assert jv.abs().max() > 1e-2


def test_expert_p_G_is_p_G_restricted_to_each_side():
    """``sample_p_G_experts`` against rejection sampling from plain ``p_G``: quantiles of the angle agree within
    a few standard errors (n = 60k per side: SE of a central quantile in t is below 3e-3)."""
    b, nvm = 0.875, 1.0
    tb = math.atan(boundary_sigma(b))
    ref = sample_p_G(400_000, -0.8, 1.6, nvm, generator=torch.Generator().manual_seed(1))
    for side in (True, False):
        got = sample_p_G_experts(
            torch.full((60_000,), side), b, -0.8, 1.6, nvm, generator=torch.Generator().manual_seed(2)
        )
        want = ref[ref >= tb] if side else ref[ref < tb]
        assert bool((got >= tb).all()) if side else bool((got < tb).all())
        q = torch.tensor([0.1, 0.5, 0.9], dtype=F64)
        assert torch.allclose(torch.quantile(got, q), torch.quantile(want, q), atol=0.01), (
            side,
            torch.quantile(got, q),
            torch.quantile(want, q),
        )
    # with a video noise multiplier the side is decided on the multiplied sigma
    got = sample_p_G_experts(
        torch.tensor([True, False] * 500), b, -0.8, 1.6, 3.0, generator=torch.Generator().manual_seed(3)
    )
    assert bool((got[0::2] >= tb).all()) and bool((got[1::2] < tb).all())


def test_scm_term_keeps_each_sample_on_the_expert_owning_its_time(monkeypatch):
    """fd_type 2 evaluates the student at ``t - h`` too; for a sample just above the boundary that time lies below
    it, yet the tangent must be the owning (high-noise) expert's. Every student call of the sCM term goes to the
    expert of ``t``; without the pin the ``t - h`` call would go to the low-noise expert."""
    from types import SimpleNamespace

    from rcm_diffusers.distill import terms as T
    from rcm_diffusers.distill.adapters import Networks
    from rcm_diffusers.distill.alternation import StepPlan
    from rcm_diffusers.trigflow import r_to_t

    hi, lo = _experts()
    sw = WanExpertSwitch(hi, lo, 0.875)
    nets, _ = Networks.build(sw, "shared", with_fake=False, lora_rank=2, time_input="float")
    h = 1e-3
    t_own = r_to_t(torch.tensor([0.875 + 1e-5, 0.5], dtype=F64))  # just above the boundary; well below it
    assert float(t_to_r(t_own[0] - h)) < 0.875  # the finite-difference time crosses the boundary
    monkeypatch.setattr(T, "scm_times", lambda *a, **k: t_own.clone())
    cfg = SimpleNamespace(
        dmd_weight=0.0,
        scm_weight=1.0,
        tangent_warmup=0,
        fd_type=2,
        fd_h=h,
        loss_reduction="mean",
        guidance_scale=1.0,
        P_mean=-0.8,
        P_std=1.6,
        expert_sampling="balanced",
        high_noise_share=0.5,
    )
    plan = StepPlan(i=0, student=True, student_eff=5, fake_eff=0, dmd=False, n_sim=1)
    x0 = torch.randn(2, 4, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    cond = {"encoder_hidden_states": torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(1))}
    sw.calls = []
    logs = T.student_step(
        nets, x0, cond, None, plan, cfg, torch.Generator().manual_seed(0), lambda loss, last: loss.backward()
    )
    assert logs["scm_high"] == 1
    for expert, ts in sw.calls:  # sample 0 (t >= boundary, and t - h) always on the high-noise expert
        if expert == LOW:
            assert all(v < 875 - 1 for v in ts), sw.calls
    assert any(e == HIGH and len(ts) == 1 and ts[0] < 875 for e, ts in sw.calls)  # the pinned t - h call
    g_hi = [
        p.grad
        for n, p in nets.trainable_parameters("student").items()
        if n.startswith("transformer.") and "lora_B" in n
    ]
    g_lo = [
        p.grad
        for n, p in nets.trainable_parameters("student").items()
        if n.startswith("transformer_2.") and "lora_B" in n
    ]
    assert all(g is not None and g.abs().max() > 0 for g in g_hi + g_lo)


def test_dmd_and_fake_score_calls_follow_the_pipeline_rule_at_every_time():
    """Backward simulation, teacher, fake score (DMD term) and the fake-score step: every recorded call runs on
    the expert the pipeline would pick for its time (``>= 875`` high, else low), both experts are called (the
    simulation crosses the boundary), and gradients reach the adapters of the experts that were called."""
    from types import SimpleNamespace

    from rcm_diffusers.distill import terms as T
    from rcm_diffusers.distill.adapters import Networks
    from rcm_diffusers.distill.alternation import StepPlan

    hi, lo = _experts()
    sw = WanExpertSwitch(hi, lo, 0.875)
    nets, _ = Networks.build(sw, "shared", with_fake=True, lora_rank=2, time_input="bf16")
    cfg = SimpleNamespace(
        dmd_weight=1.0, scm_weight=0.0, p_D_shift=5.0, guidance_scale=1.0, loss_reduction="mean", max_simulation_steps=4
    )
    x0 = torch.randn(8, 4, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    cond = {"encoder_hidden_states": torch.randn(8, 3, 16, generator=torch.Generator().manual_seed(1))}
    sw.calls = []
    T.student_step(
        nets,
        x0,
        cond,
        None,
        StepPlan(i=0, student=True, student_eff=3, fake_eff=0, dmd=True, n_sim=4),
        cfg,
        torch.Generator().manual_seed(0),
        lambda loss, last: loss.backward(),
    )
    T.fake_step(
        nets,
        x0.shape,
        cond,
        StepPlan(i=1, student=False, student_eff=3, fake_eff=3, dmd=True, n_sim=4),
        cfg,
        torch.Generator().manual_seed(1),
        lambda loss, last: loss.backward(),
        "cpu",
    )
    assert {e for e, _ in sw.calls} == {HIGH, LOW}
    for expert, ts in sw.calls:
        assert all((v >= 875.0) == (expert == HIGH) for v in ts), (expert, ts)
    grads = {n: p.grad for n, p in nets.trainable_parameters("fake").items() if "lora_B" in n}
    assert any(g is not None and g.abs().max() > 0 for n, g in grads.items() if n.startswith("transformer."))
    assert any(g is not None and g.abs().max() > 0 for n, g in grads.items() if n.startswith("transformer_2."))


def test_dcm_step_runs_each_call_on_its_experts_and_trains_both():
    """dCM (``cm_type dcm``) with two experts: the student at ``t_0`` and ``t_N`` and the teacher's Euler steps each run
    on the expert the pipeline picks for that time (t_0 and t_N may straddle the switch), the batch covers both
    sides, the loss is finite and the student adapters of both experts get a gradient."""
    from types import SimpleNamespace

    from rcm_diffusers.distill import terms as T
    from rcm_diffusers.distill.adapters import Networks
    from rcm_diffusers.distill.alternation import StepPlan

    hi, lo = _experts()
    sw = WanExpertSwitch(hi, lo, 0.875)
    nets, _ = Networks.build(sw, "shared", with_fake=False, lora_rank=2, time_input="bf16")
    with torch.no_grad():  # student adapters off zero, so the student's own target differs from the teacher's x0
        for n, p in nets.trainable_parameters("student").items():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    cfg = SimpleNamespace(
        cm_type="dcm",
        scm_weight=1.0,
        dmd_weight=0.0,
        dcm_total_steps=48,
        dcm_skipping_interval_steps=4,
        dcm_timestep_shift=5.0,
        guidance_scale=2.0,
        loss_reduction="mean",
        boundary_weight=0.0,
    )
    x0 = torch.randn(8, 4, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    cond = {"encoder_hidden_states": torch.randn(8, 3, 16, generator=torch.Generator().manual_seed(1))}
    uncond = {"encoder_hidden_states": torch.zeros(8, 3, 16)}
    sw.calls = []
    logs = T.student_step(
        nets,
        x0,
        cond,
        uncond,
        StepPlan(i=0, student=True, student_eff=0, fake_eff=0, dmd=False, n_sim=1),
        cfg,
        torch.Generator().manual_seed(0),
        lambda loss, last: loss.backward(),
    )
    assert logs["loss_dcm"] > 0 and logs["nan_dcm"] == 0 and "loss_scm" not in logs
    assert {e for e, _ in sw.calls} == {HIGH, LOW}
    for expert, ts in sw.calls:
        assert all((v >= 875.0) == (expert == HIGH) for v in ts), (expert, ts)
    grads = {n: p.grad for n, p in nets.trainable_parameters("student").items() if "lora_B" in n}
    assert any(g is not None and g.abs().max() > 0 for n, g in grads.items() if n.startswith("transformer."))
    assert any(g is not None and g.abs().max() > 0 for n, g in grads.items() if n.startswith("transformer_2."))


def test_boundary_loss_value_and_gradient_match_float64_reference():
    """``L = ||d||^2 / (||d|| + c)^2`` per sample with ``d = F_high - F_low``, gradient ``2 d / (||d|| + c)`` on
    ``F_high`` and none on ``F_low`` (written from docs/math.md §6.1 in float64); a NaN sample gives 0."""
    from rcm_diffusers.distill.losses import boundary_loss

    g = torch.Generator().manual_seed(0)
    Fh = torch.randn(3, 2, 5, generator=g, dtype=F64).requires_grad_(True)
    Fl = torch.randn(3, 2, 5, generator=g, dtype=F64).requires_grad_(True)
    loss, info = boundary_loss(Fh, Fl, c=0.1)
    d = (Fh - Fl).detach().reshape(3, -1)
    n = d.norm(dim=1)
    torch.testing.assert_close(loss.detach(), n**2 / (n + 0.1) ** 2, rtol=1e-12, atol=0)
    loss.sum().backward()
    torch.testing.assert_close(Fh.grad.reshape(3, -1), 2 * d / (n + 0.1)[:, None], rtol=1e-12, atol=0)
    assert Fl.grad is None and info["nan"] == 0 and info["d_norm"] == pytest.approx(float(n.mean()))
    bad = Fl.detach().clone()
    bad[1, 0, 0] = float("nan")
    loss, info = boundary_loss(Fh.detach(), bad)
    assert info["nan"] == 1 and loss[1] == 0 and loss[0] > 0


def test_boundary_term_moves_only_the_high_noise_student_toward_the_low_one():
    """The boundary term (scm and DMD off) gives gradients to the high-noise expert's student adapters only; a few
    steps of it shrink ``||F_high - F_low||`` at the switch (the experts start as two different teachers)."""
    from types import SimpleNamespace

    from rcm_diffusers.distill import terms as T
    from rcm_diffusers.distill.adapters import Networks
    from rcm_diffusers.distill.alternation import StepPlan

    hi, lo = _experts()
    sw = WanExpertSwitch(hi, lo, 0.875)
    nets, _ = Networks.build(sw, "shared", with_fake=False, lora_rank=4, time_input="float")
    params = nets.trainable_parameters("student")
    for n, p in params.items():  # lora_B = 0 at init: start the adapters off zero so lora_A gets gradients too
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=1e-3, generator=torch.Generator().manual_seed(hash(n) % 1000))
    opt = torch.optim.Adam(params.values(), lr=1e-2)
    cfg = SimpleNamespace(dmd_weight=0.0, scm_weight=0.0, boundary_weight=1.0, loss_reduction="mean")
    x0 = torch.randn(4, 4, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    cond = {"encoder_hidden_states": torch.randn(4, 3, 16, generator=torch.Generator().manual_seed(1))}
    plan = StepPlan(i=0, student=True, student_eff=0, fake_eff=0, dmd=False, n_sim=1)
    d = []
    for k in range(8):
        opt.zero_grad()
        logs = T.student_step(
            nets, x0, cond, None, plan, cfg, torch.Generator().manual_seed(5), lambda loss, last: loss.backward()
        )
        if k == 0:
            assert all(p.grad is None for n, p in params.items() if n.startswith("transformer_2."))
            assert any(
                p.grad is not None and p.grad.abs().max() > 0 for n, p in params.items() if n.startswith("transformer.")
            )
        d.append(logs["bc_d"])
        opt.step()
    assert all(b < a for a, b in zip(d, d[1:])) and d[-1] < 0.8 * d[0], (
        d
    )  # same x_b each step: no learning = constant d


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def t2v(tmp_path_factory):
    root = tmp_path_factory.mktemp("experts_t2v")
    pipe, data = make_tiny_wan2(str(root / "pipe")), make_dataset(str(root / "data"), "wan")
    out = root / "run"
    run_trainer(
        ["--config", CONFIG, "--pretrained", pipe, "--data_dir", data, "--output_dir", str(out), "--sample_every", "30"]
    )
    return pipe, data, root, out


def _args(run, out, *extra):
    return ["--config", CONFIG, "--pretrained", run[0], "--data_dir", run[1], "--output_dir", str(out), *extra]


def _lora_pair(out):
    return {
        e: load_file(os.path.join(out, *([] if e == HIGH else [LOW]), "pytorch_lora_weights.safetensors"))
        for e in (HIGH, LOW)
    }


def test_both_experts_train_and_export_a_lora_each(t2v):
    out = t2v[3]
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    scm = [r for r in recs if "scm_high" in r]
    high = sum(r["scm_high"] for r in scm)
    assert scm and 0.2 < high / (2 * len(scm)) < 0.8  # balanced: each expert about half of the sCM samples (batch 2)
    env = json.load(open(out / "env.json"))
    assert env["config"]["experts"] == "auto"
    for sub in ("", "ema"):
        pair = _lora_pair(out / sub)
        for e, sd in pair.items():
            assert sd and all(k.startswith("transformer.") for k in sd), e
            assert any("lora_B" in k and v.abs().max() > 0 for k, v in sd.items()), (sub, e)
        assert pair[HIGH].keys() == pair[LOW].keys()
        assert any(not torch.equal(pair[HIGH][k], pair[LOW][k]) for k in pair[HIGH])


def _stock_pipeline_samples(pipe_dir, run_dir, data_dir, steps, time_input="bf16"):
    """The trainer's preview conditions and noise through the stock ``WanPipeline`` with the LoRA pair loaded by
    ``load_rcm_lora``; records the expert called at each step."""
    from diffusers import WanPipeline

    from rcm_diffusers import RCMScheduler
    from rcm_diffusers.distill.data import LatentDataset, model_inputs
    from rcm_diffusers.lora.pipeline import load_rcm_lora

    pipe = WanPipeline.from_pretrained(pipe_dir, text_encoder=None, tokenizer=None)
    files = load_rcm_lora(pipe, str(run_dir), scheduler=False)  # the sampler is set here, for the preview's settings
    pipe.scheduler = RCMScheduler.from_config(pipe.scheduler.config, sigma_max=80.0, time_input=time_input)
    assert set(files) == {HIGH, LOW}
    calls = []
    for name in (HIGH, LOW):
        getattr(pipe, name).register_forward_pre_hook(
            lambda m, a, kw, name=name: calls.append((name, float(kw["timestep"][0]))), with_kwargs=True
        )
    data = LatentDataset(data_dir)
    x0, cond, _ = model_inputs("wan", data.get([0, 1, 2, 3]), "cpu", torch.float32)
    g = torch.Generator().manual_seed(0)  # the trainer's preview: Generator().manual_seed(cfg.seed), seed 0
    noise = torch.randn(x0.shape, generator=g)
    pipe.scheduler.set_timesteps(steps)
    lat = pipe.scheduler.scale_initial_noise(noise)
    pipe.scheduler.set_generator(g)  # WanPipeline does not pass its generator to step: the re-noising draws
    out = pipe(
        prompt_embeds=cond["encoder_hidden_states"],
        latents=lat,
        height=32,
        width=32,
        num_frames=1,
        num_inference_steps=steps,
        guidance_scale=1.0,
        generator=g,
        output_type="latent",
    ).frames
    return out, calls


def test_lora_pair_in_the_stock_pipeline_reproduces_the_trainer_previews(t2v):
    """``WanPipeline`` + ``load_rcm_lora`` gives the trainer's own preview samples (same weights and noise; peft with
    one adapter vs two, so float32 round-off: 1e-5 at latents of size ~3), and calls the expert of each time:
    RF times 0.988, 0.932 >= 0.875 on ``transformer``; 0.852, 0.608 on ``transformer_2`` (1 and 2 steps at
    sigma_max 80 never reach the low-noise expert)."""
    pipe_dir, data_dir, _, out = t2v
    prev = load_file(out / "samples" / "step-00000030.safetensors")
    for steps in (1, 2, 4):
        got, calls = _stock_pipeline_samples(pipe_dir, out, data_dir, steps)
        torch.testing.assert_close(got, prev[f"steps_{steps}"], rtol=0, atol=1e-5)
        want = {
            1: [(HIGH, 988.0)],
            2: [(HIGH, 988.0), (HIGH, 932.0)],
            4: [(HIGH, 988.0), (HIGH, 932.0), (LOW, 852.0), (LOW, 608.0)],
        }[steps]
        assert calls == want
    base, _ = _stock_pipeline_samples(pipe_dir, out / "ema", data_dir, 4)
    assert (base - prev["steps_4"]).abs().max() > 1e-4  # the EMA pair is another student (the check can fail)


def test_kill_and_resume_is_bitwise_for_both_experts(t2v):
    out = t2v[2] / "run_resume"
    p = run_trainer(_args(t2v, out, "--sample_every", "30"), check=False, env=kill_after(14))
    assert p.returncode != 0 and "exit_after_step 14: hard exit" in p.stdout, p.stderr[-3000:]
    run_trainer(_args(t2v, out, "--sample_every", "30", "--resume", "latest"))
    for sub in ("", "ema"):
        a, b = _lora_pair(t2v[3] / sub), _lora_pair(out / sub)
        for e in (HIGH, LOW):
            assert a[e].keys() == b[e].keys() and all(torch.equal(a[e][k], b[e][k]) for k in a[e]), (sub, e)
    assert [json.loads(x).get("loss_scm") for x in open(out / "metrics.jsonl")] == [
        json.loads(x).get("loss_scm") for x in open(t2v[3] / "metrics.jsonl")
    ]


def test_one_expert_needs_to_be_asked_for(t2v, tmp_path):
    """On a two-expert pipeline, naming the low-noise subfolder without ``--experts one`` is an error (the old
    one-expert-per-run command would otherwise silently train both); ``--experts both`` on a one-network
    pipeline too. Nothing is written."""
    from train_helpers import make_tiny_wan, run_script

    p = run_script(_args(t2v, tmp_path / "a", "--transformer_subfolder", "transformer_2"))
    assert p.returncode != 0 and "add --experts one" in (p.stdout + p.stderr)
    one = make_tiny_wan(str(tmp_path / "one"))
    p = run_script(
        [
            "--config",
            CONFIG,
            "--pretrained",
            one,
            "--data_dir",
            t2v[1],
            "--output_dir",
            str(tmp_path / "b"),
            "--experts",
            "both",
        ]
    )
    assert p.returncode != 0 and "has no transformer_2" in (p.stdout + p.stderr)
    assert not any((tmp_path / d / "checkpoints").exists() for d in ("a", "b"))


def test_changing_the_experts_on_resume_is_refused(t2v):
    out = t2v[2] / "run_change"
    p = run_trainer(_args(t2v, out, "--max_steps", "2", "--checkpoint_every", "1"))
    p = run_trainer(_args(t2v, out, "--resume", "latest", "--experts", "one", "--max_steps", "3"), check=False)
    assert p.returncode != 0 and "experts 'auto' -> 'one'" in (p.stdout + p.stderr)


def test_i2v_two_experts_lora_pair_reproduces_previews(tmp_path):
    """Two-expert I2V (Wan2.2-I2V-A14B layout: image latents + mask on the channels, boundary 0.9, sigma_max 200):
    the pair loaded into ``WanImageToVideoPipeline`` by ``load_rcm_lora`` and run over the same conditions as the
    trainer's preview, expert by expert at the pipeline's rule, gives the preview samples."""
    from diffusers import WanImageToVideoPipeline

    from rcm_diffusers import RCMScheduler
    from rcm_diffusers.distill.data import LatentDataset, model_inputs
    from rcm_diffusers.lora.pipeline import load_rcm_lora
    from rcm_diffusers.models import velocity_fn

    pipe_dir = make_tiny_wan2(str(tmp_path / "pipe"), i2v=True, boundary_ratio=0.9)
    data_dir = make_dataset(str(tmp_path / "data"), "wan_i2v")
    out = tmp_path / "run"
    run_trainer(
        [
            "--config",
            CONFIG,
            "--pretrained",
            pipe_dir,
            "--data_dir",
            data_dir,
            "--output_dir",
            str(out),
            "--sample_every",
            "30",
            "--sigma_max",
            "200",
        ]
    )
    prev = load_file(out / "samples" / "step-00000030.safetensors")
    pipe = WanImageToVideoPipeline.from_pretrained(
        pipe_dir, text_encoder=None, tokenizer=None, image_encoder=None, image_processor=None
    )
    load_rcm_lora(pipe, str(out), scheduler=False)
    sw = WanExpertSwitch(pipe.transformer, pipe.transformer_2, pipe.config.boundary_ratio)
    sw.calls = []
    data = LatentDataset(data_dir)
    x0, cond, _ = model_inputs("wan_i2v", data.get([0, 1, 2, 3]), "cpu", torch.float32)
    v = velocity_fn(sw, "bf16")
    for steps in (1, 2, 4):
        sch = RCMScheduler(sigma_max=200.0)
        sch.set_timesteps(steps)
        g = torch.Generator().manual_seed(0)
        x = sch.scale_initial_noise(torch.randn(x0.shape, generator=g))
        with torch.no_grad():
            for k, ts in enumerate(sch.timesteps):
                r = torch.tensor(float(sch.rf_times[k]), dtype=F64)
                x = sch.step(v(x, r, **cond).float(), ts, x, generator=g).prev_sample
        torch.testing.assert_close(x, prev[f"steps_{steps}"], rtol=0, atol=1e-5)
    # RF times 0.995, 0.934 >= 0.9: high-noise expert; 0.853, 0.609: low-noise (the 4-step run, last four calls)
    assert [(e, ts[0]) for e, ts in sw.calls[-4:]] == [(HIGH, 996.0), (HIGH, 932.0), (LOW, 852.0), (LOW, 608.0)]


@pytest.mark.parametrize("name", ["wan2.2-t2v-a14b", "wan2.2-i2v-a14b"])
def test_shipped_two_expert_configs_load_and_train_both(name):
    from rcm_diffusers.distill.config import load_config

    c = load_config(["--config", os.path.join(REPO, "training", "configs", name + ".yaml")])
    assert c.experts == "both" and c.boundary_ratio == 0.0 and c.expert_sampling == "balanced"
    assert c.sigma_max == (200.0 if "i2v" in name else 80.0) and c.time_input == "bf16"
    with pytest.raises(ValueError, match="high_noise_share"):
        load_config(["--config", os.path.join(REPO, "training", "configs", name + ".yaml"), "--high_noise_share", "1"])


def test_rcm_lora_converts_a_two_expert_run_to_the_two_comfyui_files(t2v, tmp_path):
    """``rcm-lora convert RUN NAME.safetensors --format comfyui`` writes NAME_high_noise / NAME_low_noise, each equal
    (exactly: the same key map) to converting that expert's file alone; a one-network output name is refused."""
    from rcm_diffusers.lora.cli import main

    out = t2v[3]
    assert main(["convert", str(out), str(tmp_path / "rcm.safetensors"), "--format", "comfyui"]) == 0
    for tag, src in (
        ("high_noise", out / "pytorch_lora_weights.safetensors"),
        ("low_noise", out / LOW / "pytorch_lora_weights.safetensors"),
    ):
        assert main(["convert", str(src), str(tmp_path / f"one_{tag}.safetensors"), "--format", "comfyui"]) == 0
        a, b = load_file(tmp_path / f"rcm_{tag}.safetensors"), load_file(tmp_path / f"one_{tag}.safetensors")
        assert a.keys() == b.keys() and all(k.startswith("diffusion_model.") for k in a)
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(
        *(
            load_file(tmp_path / f"rcm_{t}.safetensors")["diffusion_model.blocks.0.self_attn.q.lora_up.weight"]
            for t in ("high_noise", "low_noise")
        )
    )
    assert main(["convert", str(out), str(tmp_path / "folder"), "--format", "comfyui"]) == 2


def test_full_mode_trains_and_exports_both_experts(t2v):
    """``--mode full``: a trainable copy per role of the expert pair; ``student_transformer/`` is the high-noise expert,
    ``student_transformer_2/`` the low-noise one (and the EMA variants), each moved away from its own teacher."""
    from diffusers import WanTransformer3DModel

    out = t2v[2] / "run_full_mode"
    run_trainer(_args(t2v, out, "--mode", "full", "--max_steps", "4", "--checkpoint_every", "0", "--lr", "1e-4"))
    for sub in ("", "ema"):
        for name, teacher_sub in (("student_transformer", HIGH), ("student_transformer_2", LOW)):
            st = WanTransformer3DModel.from_pretrained(os.path.join(out, sub, name))
            te = WanTransformer3DModel.from_pretrained(t2v[0], subfolder=teacher_sub)
            diff = max(float((a - b).abs().max()) for a, b in zip(st.parameters(), te.parameters()))
            assert 0 < diff < 1.0, (sub, name, diff)


def test_exact_jvp_tangent_trains_both_experts(t2v):
    """``fd_type 0`` (the official exact JVP) through the switch with the JVP attention on both experts: finite sCM
    losses, no masked sample, both experts' student adapters moved."""
    out = t2v[2] / "run_fd0"
    run_trainer(_args(t2v, out, "--fd_type", "0", "--max_steps", "3", "--checkpoint_every", "0"))
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert all(math.isfinite(r["loss_scm"]) and r["nan_scm"] == 0 for r in recs if "loss_scm" in r)
    for e, sd in _lora_pair(out).items():
        assert any("lora_B" in k and v.abs().max() > 0 for k, v in sd.items()), e
