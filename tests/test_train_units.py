"""Trainer building blocks: config parsing, the latent format, deterministic batches, shared-base roles."""

import math

import pytest
import torch
from train_helpers import TEXT_DIM, tiny_wan_transformer

from rcm_diffusers.distill import losses as L
from rcm_diffusers.distill.adapters import Networks
from rcm_diffusers.distill.config import RCMConfig, format_help, load_config
from rcm_diffusers.distill.data import (
    LatentDataset,
    batch_indices,
    pack_flux_latents,
    pair_indices,
    unpack_flux_latents,
    write_latent_dataset,
)
from rcm_diffusers.distill.guards import SpikeGuard


def test_config_overrides_help_and_errors(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("pretrained: p\ndata_dir: d\nlr: 1.0e-4\nadam_betas: [0.0, 0.99]\n")
    c = load_config(["--config", str(y), "--lr", "3e-5", "--use_dmd", "false", "--fd_type=1"])
    assert c.lr == 3e-5 and c.use_dmd is False and c.fd_type == 1 and c.adam_betas == [0.0, 0.99]
    h = format_help()
    for name in RCMConfig.model_fields:
        assert f"--{name} " in h
    with pytest.raises(ValueError, match="unknown config option"):
        load_config(["--config", str(y), "--learning_rate", "1"])
    with pytest.raises(ValueError, match="fd_type"):
        load_config(["--config", str(y), "--fd_type", "3"])
    with pytest.raises(ValueError, match="expects an integer"):
        load_config(["--config", str(y), "--max_steps", "ten"])
    with pytest.raises(ValueError, match="tangent_warmup 0"):
        load_config(["--config", str(y), "--scm_weight", "0", "--tangent_warmup", "10"])
    assert load_config(["--config", str(y), "--scm_weight", "0", "--tangent_warmup", "0"]).scm_weight == 0.0
    # student sampler angles: strictly decreasing below arctan(sigma_max), enough of them for every sample_steps entry
    assert load_config(["--config", str(y), "--mid_t", "[0.8, 0.5, 0.25]"]).mid_t == [0.8, 0.5, 0.25]
    for bad, msg in [
        ("[0.8, 0.9, 0.25]", "strictly decreasing"),
        ("[1.6, 0.5, 0.2]", "strictly inside"),
        ("[0.8, 0.5]", "out of range"),
    ]:
        with pytest.raises(ValueError, match=f"mid_t.*{msg}"):
            load_config(["--config", str(y), "--mid_t", bad])


def test_config_mid_t_per_step_count(tmp_path):
    """``mid_t`` per step count: a YAML mapping, YAML flow text or the ``"2: 1.0; 4: ..."`` string on the command line,
    all kept in the scheduler's JSON form (so the checkpoint's config compares equal on resume); every sample_steps
    entry must be served, every angle checked."""
    import json

    from rcm_diffusers.distill.config import QADConfig

    want = {"2": [1.0], "4": [1.5, 1.4, 0.8]}
    y = tmp_path / "c.yaml"
    y.write_text("pretrained: p\ndata_dir: d\nmid_t: {2: [1.0], 4: [1.5, 1.4, 0.8]}\n")
    assert load_config(["--config", str(y)]).mid_t == want
    base = ["--pretrained", "p", "--data_dir", "d"]
    for text in ("2: 1.0; 4: 1.5, 1.4, 0.8", "{2: [1.0], 4: [1.5, 1.4, 0.8]}", "{'4': [1.5, 1.4, 0.8], '2': 1.0}"):
        cfg = load_config(base + ["--mid_t", text])
        assert cfg.mid_t == want, text
        assert json.loads(json.dumps(cfg.model_dump()))["mid_t"] == cfg.mid_t
    assert RCMConfig(mid_t={4: (1.5, 1.4, 0.8), 2: 1}).mid_t == want  # built in Python: the same form
    assert load_config(base + ["--mid_t", "1.5,1.4,1.0"]).mid_t == [1.5, 1.4, 1.0]  # the flat string form
    assert load_config(base + ["--mid_t", "2: 1.0", "--sample_steps", "[1, 2]"]).mid_t == {"2": [1.0]}
    for bad, msg in [
        ("2: 1.0", r"sample_steps 4: num_inference_steps=4 is out of range .* angles for 2 steps"),
        ("2: 1.0; 4: 1.5, 1.4", r"entry for 4 steps has 2 angle\(s\)"),
        ("1: 1.0; 4: 1.5, 1.4, 0.8", "key '1' is not a step count"),
        ("2: 1.0; 4: 1.4, 1.5, 0.8", "strictly decreasing.* entry for 4 steps"),
    ]:
        with pytest.raises(ValueError, match=f"^config option mid_t = .*{msg}") as e:
            load_config(base + ["--mid_t", bad])
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"mid_t.*arctan\(sigma_max=10.0\)"):  # the 4-step entry, though 2 steps fit
        load_config(base + ["--mid_t", "2: 1.0; 4: 1.5, 1.4, 0.8", "--sigma_max", "10"])
    # QAD: the rCM times it trains at (r_source rcm, rcm_steps)
    qad = load_config(
        base + ["--r_source", "rcm", "--rcm_steps", "2", "--mid_t", "2: 1.0; 4: 1.5, 1.4, 0.8"], config_cls=QADConfig
    )
    assert qad.mid_t == want
    from rcm_diffusers.distill.qad_student import training_times

    r1 = math.sin(1.0) / (math.sin(1.0) + math.cos(1.0))
    assert training_times(qad) == pytest.approx([80 / 81, r1], abs=1e-12)
    with pytest.raises(ValueError, match="rcm_steps 4: num_inference_steps=4 is out of range"):
        load_config(base + ["--r_source", "rcm", "--mid_t", "2: 1.0"], config_cls=QADConfig)


def test_latent_format_roundtrip_and_tables(tmp_path):
    lat = torch.randn(5, 4, 1, 2, 2)
    emb = torch.randn(3, 2, 8)
    write_latent_dataset(
        str(tmp_path),
        {"latents": lat, "prompt_index": torch.tensor([2, 0, 1, 2, 0])},
        family="wan",
        tables={"prompt_embeds": emb, "negative_prompt_embeds": torch.zeros(1, 2, 8)},
        table_index={"prompt_embeds": "prompt_index", "negative_prompt_embeds": None},
        shard_size=2,
    )
    ds = LatentDataset(str(tmp_path))
    assert len(ds) == 5 and len(ds.meta["shards"]) == 3
    b = ds.get([4, 1, 3])
    torch.testing.assert_close(b["latents"], lat[[4, 1, 3]])
    torch.testing.assert_close(b["prompt_embeds"], emb[[0, 0, 2]])
    assert b["negative_prompt_embeds"].shape == (3, 2, 8) and b["index"].tolist() == [4, 1, 3]


def test_batches_cover_each_epoch_once_across_ranks():
    N, B, W = 10, 2, 2
    seen = [i for step in range(5) for r in range(W) for i in batch_indices(N, B, step, r, W, seed=3)]
    assert sorted(seen[:10]) == list(range(10))  # epoch 0 (5 steps x 2 ranks x 2 = 20 = two epochs)
    assert sorted(seen[10:]) == list(range(10))
    assert batch_indices(N, B, 7, 1, W, 3) == batch_indices(N, B, 7, 1, W, 3)
    assert batch_indices(N, B, 0, 0, W, 3) != batch_indices(N, B, 0, 0, W, 4)
    # the ODE pairs of the regression term: each epoch once across ranks too, in an order of their own
    pairs = [i for step in range(5) for r in range(W) for i in pair_indices(N, B, step, r, W, seed=3)]
    assert sorted(pairs[:10]) == list(range(10)) and sorted(pairs[10:]) == list(range(10)) and pairs != seen


def test_flux_packing_matches_pipeline():
    from diffusers import FluxPipeline

    x = torch.randn(2, 4, 6, 8)
    ref = FluxPipeline._pack_latents(x, 2, 4, 6, 8)
    torch.testing.assert_close(pack_flux_latents(x), ref)
    torch.testing.assert_close(unpack_flux_latents(ref, 6, 8), x)


def test_spike_guard_fires_after_patience():
    g = SpikeGuard({}, factor=5, patience=3)
    assert not any(g.check("student", 1.0 + 0.01 * k) for k in range(10))
    assert [g.check("student", 100.0) for _ in range(3)] == [False, False, True]
    assert not g.check("student", 1.0)
    assert not g.check("fake", math.inf)  # its own history, too short to judge


@pytest.fixture(scope="module")
def nets():
    tr = tiny_wan_transformer()
    n, trainable = Networks.build(tr, "shared", with_fake=True, lora_rank=4)
    return n, tr


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 1, 4, 4, dtype=torch.float64, generator=g)
    t = torch.tensor([0.3, 1.2], dtype=torch.float64)
    return x, t, {"encoder_hidden_states": torch.randn(2, 3, TEXT_DIM, generator=g)}


def test_shared_base_roles(nets):
    n, tr = nets
    x, t, cond = _inputs()
    with torch.no_grad():
        F_t, F_s, F_f = (n.F(r, x, t, cond) for r in ("teacher", "student", "fake"))
        torch.testing.assert_close(F_s, F_t)  # lora_B = 0: student and fake start as the teacher
        torch.testing.assert_close(F_f, F_t)
        for p in n.trainable_parameters("student").values():
            if ".lora_B." in next(k for k, q in n.trainable_parameters("student").items() if q is p):
                p.add_(0.05)
        F_s2, F_t2, F_f2 = (n.F(r, x, t, cond) for r in ("student", "teacher", "fake"))
        for p_name, p in n.trainable_parameters("student").items():
            if ".lora_B." in p_name:
                p.sub_(0.05)
    assert (F_s2 - F_t).abs().max() > 1e-3
    torch.testing.assert_close(F_t2, F_t, rtol=0, atol=0)
    torch.testing.assert_close(F_f2, F_t, rtol=0, atol=0)
    s, f = n.trainable_parameters("student"), n.trainable_parameters("fake")
    assert s and f and not set(s) & set(f)
    assert all(p.requires_grad for p in (*s.values(), *f.values()))
    assert not any(p.requires_grad for k, p in tr.named_parameters() if "lora_" not in k)


def test_fd2_approaches_fd0_on_wan(nets):
    """fd_type 2 -> fd_type 0 as h -> 0 through the real (tiny) Wan with JVP attention and LoRA roles.
    The time embedding sees 1000 t, so h must be small (1e-3 in t is a timestep change of ~1)."""
    from rcm_diffusers.attention import enable_jvp_attention

    n, tr = nets
    enable_jvp_attention(tr)
    x, t, cond = _inputs()
    F_T = n.F("teacher", x, t, cond).detach()
    F_stu = n.F_fn("student", cond)
    _, dF0 = L.scm_dF(F_stu, x, t, F_T, fd_type=0)
    errs = [float((L.scm_dF(F_stu, x, t, F_T, fd_type=2, h=h)[1] - dF0).abs().max()) for h in (1e-3, 1e-4)]
    scale = float(dF0.abs().max())
    assert errs[1] < errs[0] / 3 and errs[1] < 0.05 * scale, (errs, scale)


def test_loss_scale_and_batch_reduction(nets):
    """The official objective ``100 L_sCM + L_DMD`` summed over the batch (NVlabs/rcm trainer_distillation.py
    ``loss_i.sum()`` over the per-sample ``loss_scale * loss_scm`` / ``loss_scale_dmd * loss_dmd`` of
    t2v_model_distill_rcm.py) is ``100 B`` times our ``L_sCM + 0.01 L_DMD`` averaged over the batch, term by term;
    the fake score's loss is reduced the same way. Same seeds, so the per-sample losses are the same draws."""
    from types import SimpleNamespace

    from rcm_diffusers.distill.alternation import plan_step
    from rcm_diffusers.distill.terms import batch_reduce, fake_step, student_step

    n, _ = nets
    B = 3
    x0 = torch.randn(B, 4, 1, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    cond = {"encoder_hidden_states": torch.randn(B, 3, TEXT_DIM, generator=torch.Generator().manual_seed(2))}
    base = dict(
        p_D_shift=5.0,
        guidance_scale=1.0,
        P_mean=-0.8,
        P_std=1.6,
        tangent_warmup=0,
        fd_type=2,
        fd_h=1e-3,
        max_simulation_steps=2,
    )
    ours = SimpleNamespace(**base, scm_weight=1.0, dmd_weight=0.01, loss_reduction="mean")
    official = SimpleNamespace(**base, scm_weight=100.0, dmd_weight=1.0, loss_reduction="sum")
    plan = plan_step(0, 0, 2, 2)  # student step with DMD
    fplan = plan_step(1, 0, 2, 2)  # fake-score step
    fake_B = [p for k, p in n.trainable_parameters("fake").items() if ".lora_B." in k]
    with torch.no_grad():
        for p in fake_B:  # a fake score away from the teacher, so L_DMD is not 0
            p.add_(0.05)
    got = {}
    for name, cfg in (("ours", ours), ("official", official)):
        seen = []
        logs = student_step(
            n,
            x0,
            cond,
            None,
            plan,
            cfg,
            torch.Generator().manual_seed(5),
            lambda l, last: seen.append(float(l.detach())),
        )
        fseen = []
        flogs = fake_step(
            n,
            x0.shape,
            cond,
            fplan,
            cfg,
            torch.Generator().manual_seed(6),
            lambda l, last: fseen.append(float(l.detach())),
            torch.device("cpu"),
        )
        got[name] = (seen, logs, fseen, flogs)
    with torch.no_grad():
        for p in fake_B:
            p.sub_(0.05)
    (s_o, l_o, f_o, fl_o), (s_f, l_f, f_f, _fl_f) = got["ours"], got["official"]
    assert l_o["loss_dmd"] == pytest.approx(l_f["loss_dmd"], rel=1e-12) and l_o["loss_scm"] == pytest.approx(
        l_f["loss_scm"], rel=1e-12
    )
    # backward order: DMD first, then sCM (trainer.student_step)
    assert s_o == pytest.approx([0.01 * l_o["loss_dmd"], l_o["loss_scm"]], rel=1e-12)
    assert s_f == pytest.approx([B * l_o["loss_dmd"], 100 * B * l_o["loss_scm"]], rel=1e-12)
    assert min(s_o) > 0
    assert [f / o for f, o in zip(s_f, s_o)] == pytest.approx([100 * B, 100 * B], rel=1e-12)
    assert f_o == pytest.approx([fl_o["loss_fake"]], rel=1e-12) and f_f == pytest.approx(
        [B * fl_o["loss_fake"]], rel=1e-12
    )
    assert float(batch_reduce(torch.tensor([1.0, 2.0, 6.0]), "sum")) == 9.0
    assert float(batch_reduce(torch.tensor([1.0, 2.0, 6.0]), "mean")) == 3.0
    with pytest.raises(ValueError, match="loss_reduction"):
        batch_reduce(torch.ones(2), "max")


def test_loss_reduction_option_validated(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("pretrained: p\ndata_dir: d\n")
    assert load_config(["--config", str(y)]).loss_reduction == "mean"
    assert load_config(["--config", str(y), "--loss_reduction", "sum"]).loss_reduction == "sum"
    with pytest.raises(ValueError, match="loss_reduction"):
        load_config(["--config", str(y), "--loss_reduction", "median"])


def test_lr_decay_schedule_and_step_counts(tmp_path):
    """``trainer.lr_lambda`` against the closed forms of docs/math.md §4.4 written out here, and
    ``alternation.optimizer_steps`` against a count of the iterations ``plan_step`` gives each network."""
    from rcm_diffusers.distill.alternation import optimizer_steps, plan_step
    from rcm_diffusers.distill.optim import lr_lambda

    plans = [plan_step(i, 7, 3, 4) for i in range(50)]
    assert optimizer_steps(50, 7, 3) == {
        "student": sum(p.student for p in plans),
        "fake": sum(not p.student for p in plans),
    }
    assert optimizer_steps(50, 7, 3) == {"student": 7 + 15, "fake": 28}  # 7 warm-up + i = 7, 10, ..., 49
    assert optimizer_steps(9, 0, 2, has_fake=False) == {"student": 9, "fake": 0}

    W, N, f = 4, 24, 0.1
    const, cos, lin = lr_lambda(W), lr_lambda(W, N, "cosine", f), lr_lambda(W, N, "linear", f)
    for k in range(N + 3):
        warm = (k + 1) / W
        p = min(1.0, (k + 1 - W) / (N - W))
        assert const(k) == (warm if k < W else 1.0)
        assert cos(k) == pytest.approx(warm if k < W else f + (1 - f) * (1 + math.cos(math.pi * p)) / 2, abs=1e-15)
        assert lin(k) == pytest.approx(warm if k < W else 1 - (1 - f) * p, abs=1e-15)
    assert cos(N - 1) == pytest.approx(f) and lin(N - 1) == pytest.approx(f) and cos(W) > 0.99
    assert all(cos(k) > cos(k + 1) for k in range(W, N - 1))  # strictly decreasing after the warm-up
    assert lr_lambda(5, 5, "cosine")(9) == 1.0  # nothing left to decay over: constant
    late = lr_lambda(W, N, "linear", f, decay_fraction=0.25)  # constant until the last 5 of the 20 post-warm-up steps
    assert [late(k) for k in range(W, N)] == pytest.approx(
        [1.0] * 15 + [1 - (1 - f) * j / 5 for j in range(1, 6)], abs=1e-15
    )

    # the factor reaches the optimizer: LambdaLR steps once per optimizer step
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cos)
    seen = []
    for _ in range(N):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2.0 * cos(k) for k in range(N)], rel=1e-12)

    y = tmp_path / "c.yaml"
    y.write_text("pretrained: p\ndata_dir: d\n")
    assert load_config(["--config", str(y)]).lr_decay == "none"
    with pytest.raises(ValueError, match="lr_decay"):
        load_config(["--config", str(y), "--lr_decay", "step"])
    with pytest.raises(ValueError, match="lr_final_ratio"):
        load_config(["--config", str(y), "--lr_decay", "cosine", "--lr_final_ratio", "1.5"])
    with pytest.raises(ValueError, match="lr_decay_fraction"):
        load_config(["--config", str(y), "--lr_decay_fraction", "0"])
    with pytest.raises(ValueError, match="lr decay"):
        lr_lambda(3, 10, "exp")


def test_dcm_and_fixed_dmd_options_parse_and_validate(tmp_path):
    """``cm_type`` / ``dcm_*`` / ``dmd_fix_timesteps`` / ``backward_timesteps`` from YAML and the command line, with the
    official defaults; bad values are refused naming the option; which settings take a JVP (``trainer.needs_jvp``)."""
    from rcm_diffusers.distill.terms import needs_jvp

    y = tmp_path / "c.yaml"
    y.write_text("pretrained: p\ndata_dir: d\ncm_type: dcm\ndcm_skipping_interval_steps: 2\n")
    d = RCMConfig(pretrained="p", data_dir="d").validate()
    assert (d.cm_type, d.dcm_total_steps, d.dcm_skipping_interval_steps, d.dcm_timestep_shift) == ("scm", 48, 1, 5.0)
    assert d.dmd_fix_timesteps is False and d.backward_timesteps == [1.5, 1.4, 1.0]
    c = load_config(
        [
            "--config",
            str(y),
            "--dcm_timestep_shift",
            "3",
            "--dmd_fix_timesteps",
            "true",
            "--backward_timesteps",
            "[1.2, 0.7, 0.3]",
        ]
    )
    assert (c.cm_type, c.dcm_skipping_interval_steps, c.dcm_timestep_shift) == ("dcm", 2, 3.0)
    assert c.dmd_fix_timesteps is True and c.backward_timesteps == [1.2, 0.7, 0.3]
    for args, key in [
        (["--cm_type", "ecm"], "cm_type"),
        (["--dcm_total_steps", "1"], "dcm_total_steps"),
        (["--dcm_skipping_interval_steps", "48"], "dcm_skipping_interval_steps"),
        (["--dcm_skipping_interval_steps", "0"], "dcm_skipping_interval_steps"),
        (["--dcm_timestep_shift", "0"], "dcm_timestep_shift"),
        (["--dmd_fix_timesteps", "true", "--backward_timesteps", "[1.0, 1.4, 0.5]"], "backward_timesteps"),
        (["--dmd_fix_timesteps", "true", "--backward_timesteps", "[1.6, 1.0, 0.5]"], "backward_timesteps"),
        (["--dmd_fix_timesteps", "true", "--backward_timesteps", "[1.0]"], "backward_timesteps"),
    ]:
        with pytest.raises(ValueError, match=f"option {key} "):
            load_config(["--config", str(y), *args])
    assert needs_jvp(RCMConfig(fd_type=0)) and needs_jvp(RCMConfig(fd_type=1)) and not needs_jvp(RCMConfig(fd_type=2))
    assert not needs_jvp(RCMConfig(fd_type=0, cm_type="dcm"))
    assert not needs_jvp(RCMConfig(fd_type=0, scm_weight=0.0, tangent_warmup=0))


def test_compute_dtype_of_a_bf16_from_pretrained_wan(tmp_path):
    """``from_pretrained(torch_dtype=bf16)`` keeps ``scale_shift_table`` (Wan's first parameter) and the norms in
    float32: the trainer's networks, the denoiser and the two-expert switch must still compute in bf16 (diffusers'
    ``ModelMixin.dtype``). With the first parameter's dtype the inputs were float32 and the patch embedding refused
    them outside autocast."""
    from diffusers import WanTransformer3DModel

    from rcm_diffusers.distill.adapters import Networks
    from rcm_diffusers.distill.experts import WanExpertSwitch
    from rcm_diffusers.models import compute_dtype, denoiser

    tiny_wan_transformer().save_pretrained(tmp_path / "t")
    m = WanTransformer3DModel.from_pretrained(tmp_path / "t", torch_dtype=torch.bfloat16)
    assert next(m.parameters()).dtype == torch.float32 and compute_dtype(m) == torch.bfloat16
    assert compute_dtype(torch.nn.Linear(2, 2)) == torch.float32
    x, t = torch.randn(1, 4, 1, 4, 4, dtype=torch.float64), torch.tensor([0.7], dtype=torch.float64)
    ehs = torch.randn(1, 3, 16, dtype=torch.bfloat16)
    assert torch.isfinite(denoiser(m).F(x, t, encoder_hidden_states=ehs)).all()
    assert WanExpertSwitch(m, m, 0.875).dtype == torch.bfloat16
    nets, _ = Networks.build(m, "shared", with_fake=False, lora_rank=2)
    assert nets.model_dtype == torch.bfloat16
    assert torch.isfinite(nets.F("student", x, t, {"encoder_hidden_states": ehs})).all()


def test_regression_options_parse_and_validate(tmp_path):
    """``regression_weight`` / ``regression_data_dir`` from YAML and the command line (off by default); a weight without
    pairs, a negative or non-finite weight, a regression warm-up without the term or below 0 are refused naming the
    option."""
    d = RCMConfig(pretrained="p", data_dir="d").validate()
    assert (d.regression_weight, d.regression_data_dir) == (0.0, "")
    y = tmp_path / "c.yaml"
    y.write_text("pretrained: p\ndata_dir: d\nregression_weight: 0.5\nregression_data_dir: pairs\n")
    c = load_config(["--config", str(y), "--regression_weight", "2"])
    assert (c.regression_weight, c.regression_data_dir) == (2.0, "pairs")
    for args, key in [
        (["--regression_data_dir", ""], "regression_data_dir"),
        (["--regression_weight", "-1"], "regression_weight"),
        (["--regression_weight", "nan"], "regression_weight"),
        (["--regression_weight", "0", "--regression_warmup", "5"], "regression_warmup"),
        (["--regression_warmup", "-1"], "regression_warmup"),
    ]:
        with pytest.raises(ValueError, match=f"option {key} "):
            load_config(["--config", str(y), *args])
    assert load_config(["--config", str(y), "--regression_warmup", "5"]).regression_warmup == 5
