"""The embedded digits benchmark: data split, evaluator metrics, shipped teacher, samplers, report, trainer smoke."""

import json
import os

import numpy as np
import pytest
import torch
from train_helpers import REPO, run_trainer

from rcm_diffusers import digits as D


@pytest.fixture(scope="module")
def split():
    return D.load_digits_split()


@pytest.fixture(scope="module")
def ev():
    return D.Evaluator()


@pytest.fixture(scope="module")
def teacher():
    return D.load_teacher()


def test_split_is_fixed_stratified_and_scaled(split):
    assert split["x_train"].shape == (1347, 1, 1, 8, 8) and split["x_test"].shape == (450, 1, 1, 8, 8)
    assert float(split["x_train"].min()) == -1.0 and float(split["x_train"].max()) == 1.0
    counts = np.bincount(split["y_test"].numpy(), minlength=10)
    assert counts.min() >= 43 and counts.max() <= 47  # stratified: ~45 per class
    again = D.load_digits_split()
    assert torch.equal(again["y_test"], split["y_test"]) and torch.equal(again["x_train"], split["x_train"])
    # no image of the held-out split is in the train split
    tr = {tuple(v) for v in split["x_train"].reshape(-1, 64).tolist()}
    dup = sum(tuple(v) in tr for v in split["x_test"].reshape(-1, 64).tolist())
    assert dup <= 3  # sklearn digits hold a handful of exact duplicate images


def test_frechet_distance_exact_identities():
    g = np.random.default_rng(0)
    f = g.standard_normal((500, 8)) @ g.standard_normal((8, 8))
    assert abs(D.frechet_distance(f, f)) < 1e-8
    # f2 = 2 f + c: S2 = 4 S1, (S1 S2)^(1/2) = 2 S1, so FD = |2 mu + c - mu|^2 + Tr(S1)
    c = g.standard_normal(8)
    want = float(((f.mean(0) + c) ** 2).sum() + np.trace(np.cov(f, rowvar=False)))
    assert D.frechet_distance(f, 2 * f + c) == pytest.approx(want, rel=1e-9)


def test_evaluator_real_vs_noise(split, ev):
    assert ev.accuracy(split["x_test"], split["y_test"]) >= 0.90
    real = ev.evaluate(split["x_test"], split["y_test"])
    assert abs(real["fd"]) < 1e-6 and real["diversity"] == pytest.approx(1.0) and real["accuracy"] >= 0.90
    assert abs(real["fd_pixel"]) < 1e-6
    # raw-pixel FD: the held-out set against the train split is far below noise, as in the classifier's features
    floor = D.frechet_distance(ev.pixels(split["x_train"]), ev.p_ref)
    assert 0 < floor and ev.p_ref.shape == (450, 64)
    noise = ev.evaluate(
        torch.rand(450, 1, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1, split["y_test"]
    )
    assert noise["fd"] > 50 * max(ev.fd_to(split["x_train"]), 1.0) and noise["accuracy"] < 0.3
    assert noise["fd_pixel"] > 10 * floor
    # mode collapse: one image per class -> zero within-class diversity
    first = torch.stack([split["x_test"][split["y_test"] == c][0] for c in range(10)])
    y = torch.arange(10).repeat(5)
    assert ev.evaluate(first[y], y)["diversity"] == pytest.approx(0.0, abs=1e-9)


def test_classifier_training_is_seeded(split):
    a = D.train_classifier(split["x_train"][:200], split["y_train"][:200], seed=3, epochs=2)
    b = D.train_classifier(split["x_train"][:200], split["y_train"][:200], seed=3, epochs=2)
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(va, vb), k


def test_shipped_teacher_loads_as_wan_pipeline():
    from diffusers import DiffusionPipeline, WanTransformer3DModel

    index = DiffusionPipeline.load_config(D.TEACHER_DIR)
    assert index["_class_name"] == "WanPipeline" and index["transformer"] == ["diffusers", "WanTransformer3DModel"]
    tr, emb = D.load_teacher()
    assert isinstance(tr, WanTransformer3DModel) and tr.config.in_channels == 1
    assert emb.shape == (11, D.TEXT_LEN, D.TEXT_DIM)
    assert 0.5e6 < sum(p.numel() for p in tr.parameters()) < 2e6
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(D.TEACHER_DIR) for f in fs)
    assert size < 8 * 2**20


def test_shipped_teacher_runs_in_wan_pipeline_like_sample_teacher(teacher):
    """The directory is a working WanPipeline (no VAE: 64 px = 8x8 latents, output_type='latent'); its
    TrigFlowEuler run equals ``digits.sample_teacher`` from the same seed."""
    from diffusers import WanPipeline
    from safetensors.torch import load_file

    pipe = WanPipeline.from_pretrained(D.TEACHER_DIR, vae=None, text_encoder=None, tokenizer=None)
    pipe.set_progress_bar_config(disable=True)
    e = load_file(os.path.join(D.TEACHER_DIR, "class_embeddings.safetensors"))
    lat = pipe(
        prompt_embeds=e["prompt_embeds"],
        height=64,
        width=64,
        num_frames=1,
        num_inference_steps=10,
        guidance_scale=1.0,
        output_type="latent",
        generator=torch.Generator().manual_seed(7),
    ).frames
    ref = D.sample_teacher(*teacher, torch.arange(10), steps=10, seed=7)
    torch.testing.assert_close(lat, ref, rtol=0, atol=1e-4)


def test_latent_dataset_matches_split_and_table(split):
    from rcm_diffusers.distill.data import LatentDataset, model_inputs

    data = LatentDataset(os.path.join(D.ASSETS, "digits_latents"))
    assert len(data) == 1347
    b = data.get([0, 5])
    assert torch.equal(b["latents"], split["x_train"][[0, 5]]) and torch.equal(b["label"], split["y_train"][[0, 5]])
    _, emb = D.load_teacher()
    x0, cond, uncond = model_inputs("wan", b, "cpu", torch.float32)
    assert torch.equal(cond["encoder_hidden_states"], emb[b["label"]])
    assert torch.equal(uncond["encoder_hidden_states"], emb[[10, 10]])


def test_teacher_samples_are_digits(teacher, ev):
    tr, emb = teacher
    y = torch.arange(200) % 10
    x50 = D.sample_teacher(tr, emb, y, steps=50, solver="euler", seed=0)
    m50 = ev.evaluate(x50, y)
    x1 = D.sample_teacher(tr, emb, y, steps=1, solver="euler", seed=0)
    m1 = ev.evaluate(x1, y)
    assert m50["accuracy"] >= 0.85 and m50["fd"] < 15.0, m50  # 200 samples: FD biased up vs the 1000-sample table
    assert m1["fd"] > 2 * m50["fd"], (m1, m50)  # the few-step gap that rCM closes
    xu = D.sample_teacher(tr, emb, y, steps=8, solver="unipc", seed=0, guidance_scale=2.0)
    assert ev.evaluate(xu, y)["accuracy"] >= 0.85
    # same seed, same samples; the student sampler runs the same model (undistilled: blurry but finite)
    torch.testing.assert_close(D.sample_teacher(tr, emb, y[:20], steps=50, seed=0), x50[:20], rtol=0, atol=1e-5)
    xs = D.sample_student(tr, emb, y[:20], steps=2, seed=0)
    assert xs.shape == (20, 1, 1, 8, 8) and torch.isfinite(xs).all()
    torch.testing.assert_close(D.sample_student(tr, emb, y[:20], steps=2, seed=0), xs, rtol=0, atol=1e-6)


@torch.no_grad()
def test_shipped_ode_pairs_are_the_teachers_ode_solutions(teacher, tmp_path):
    """``write_ode_pairs`` (the shipped ``digits_ode_pairs``) against an independent run of the digits sampler's
    velocity with ``TrigFlowUniPCScheduler`` from the stored noise; the shipped rows are what it writes (first 12 pairs,
    written again here in one batch instead of 512), their noise the seeded draw, their classes i % 10."""
    from rcm_diffusers.digits.sample import _velocity
    from rcm_diffusers.distill.data import LatentDataset
    from rcm_diffusers.schedulers import TrigFlowUniPCScheduler

    tr, emb = teacher
    shipped = LatentDataset(D.ODE_PAIRS_DIR)
    assert len(shipped) == 8192 and shipped.meta["steps"] == 32 and shipped.meta["seed"] == 0
    b = shipped.get(list(range(12)))
    again = LatentDataset(D.write_ode_pairs(str(tmp_path / "p"), num_samples=12)).get(list(range(12)))
    assert torch.equal(again["noise"], b["noise"]) and torch.equal(b["label"], torch.arange(12) % 10)
    torch.testing.assert_close(again["latents"], b["latents"], rtol=0, atol=1e-5)
    assert torch.equal(b["noise"][7], torch.randn(1, 1, 8, 8, generator=torch.Generator().manual_seed(7)))
    sch = TrigFlowUniPCScheduler(sigma_max=5000.0, shift=1.0)
    sch.set_timesteps(32)
    x, v = b["noise"].clone(), _velocity(tr, emb, b["label"], 1.0)
    for k, ts in enumerate(sch.timesteps):
        x = sch.step(v(x, sch.rf_times[k]), ts, x).prev_sample
    torch.testing.assert_close(x, b["latents"], rtol=0, atol=1e-5)
    assert (x - b["noise"]).abs().max() > 1.0  # the teacher moved the noise to a digit


def test_report_and_grid(tmp_path, split):
    rows = [
        D.Row("teacher euler", 50, 50, 1.234, 0.95, 0.98, 1.5, 100.0),
        D.Row("student rcm", 1, 1, 2.5, 0.9, 0.9, 0.1, 100.0, 1.1, 0.4567),
    ]
    table = D.write_report(str(tmp_path / "report.md"), rows, "# t")
    text = (tmp_path / "report.md").read_text()
    assert text.startswith("# t") and "| teacher euler | 50 | 50 | 1.23 | — | — | 0.950 |" in table
    assert "| student rcm | 1 | 1 | 2.50 | 1.10 | 0.457 | 0.900 |" in table
    from PIL import Image

    D.save_grid(str(tmp_path / "g.png"), [("real", split["x_test"][:10]), ("real2", split["x_test"][10:20])], scale=2)
    img = Image.open(tmp_path / "g.png")
    assert img.size == (150 + 10 * 18, 2 * 18 + 2)


def test_report_has_the_rows_of_the_stock_pipeline_path(tmp_path):
    """eval_digits adds, per LoRA student, the rows a diffusers user gets: "user call" (WanPipeline.from_pretrained +
    load_rcm_lora, which brings the run's scheduler/) and "from_config defaults"; the user call samples with the
    exported scheduler (its rows equal digits.sample_pipeline with that scheduler), the defaults row with sigma_max
    80."""
    import sys
    from types import SimpleNamespace

    from diffusers import WanPipeline

    from rcm_diffusers import RCMScheduler
    from rcm_diffusers.distill.adapters import add_rcm_adapters, lora_parameters
    from rcm_diffusers.distill.export import export_student

    out = tmp_path / "run"
    tr, emb = D.load_teacher()
    add_rcm_adapters(tr, rank=4, alpha=None, with_fake=False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in lora_parameters(tr, "student").values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    export_student(
        WanPipeline,
        SimpleNamespace(
            sigma_max=5000.0, mid_t=[0.8, 0.5, 0.25], time_input="float", output_dir=str(out), mode="shared"
        ),
        tr,
        None,
    )
    sys.path.insert(0, os.path.join(REPO, "training"))
    import eval_digits

    rows = eval_digits.main(
        [
            "--student",
            f"rcm={out}",
            "--out",
            str(tmp_path / "eval"),
            "--samples",
            "20",
            "--ref_steps",
            "2",
            "--teacher_steps",
            "",
            "--student_steps",
            "1",
        ]
    )
    assert [r.method for r in rows] == [
        "teacher euler",
        "teacher unipc",
        "student rcm",
        "student rcm: user call",
        "student rcm: from_config defaults",
    ]
    report = (tmp_path / "eval" / "report.md").read_text()
    assert "| student rcm: user call | 1 | 1 |" in report and "| student rcm: from_config defaults | 1 | 1 |" in report
    assert "load_rcm_lora(pipe, DIR)" in report and "(sigma_max 80, mid_t [1.5, 1.4, 1.0], time input bf16)" in report
    user, dflt = rows[3], rows[4]
    assert user.fd != dflt.fd  # different samplers, different samples
    pipe, _ = D.load_student_pipeline(D.TEACHER_DIR, str(out))
    assert pipe.scheduler.config.rcm_sigma_max == 5000.0 and pipe.scheduler.config.time_input == "float"
    labels = torch.arange(20) % D.NUM_CLASSES
    x = D.sample_pipeline(pipe, emb, labels, 1, seed=1234)
    assert D.Evaluator().evaluate(x, labels)["fd"] == pytest.approx(user.fd, rel=1e-4)
    pipe.scheduler = RCMScheduler.from_config(
        pipe.scheduler.config, sigma_max=80.0, mid_t=[1.5, 1.4, 1.0], time_input="bf16"
    )
    assert D.Evaluator().evaluate(D.sample_pipeline(pipe, emb, labels, 1, seed=1234), labels)["fd"] == pytest.approx(
        dflt.fd, rel=1e-4
    )


@pytest.mark.slow
def test_digits_trainer_smoke_then_eval(tmp_path):
    """A dozen rCM iterations on the shipped teacher with the default config, then the eval script with the LoRA."""
    out = tmp_path / "run"
    run_trainer(
        [
            "--output_dir",
            str(out),
            "--max_steps",
            "12",
            "--tangent_warmup",
            "4",
            "--student_update_freq",
            "2",
            "--batch_size",
            "8",
            "--checkpoint_every",
            "0",
            "--log_every",
            "1",
            "--progress",
            "false",
        ],
        timeout=600,
    )
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(recs) == 12 and any("loss_dmd" in r for r in recs) and any(r["net"] == "fake" for r in recs)
    assert os.path.exists(out / "pytorch_lora_weights.safetensors")
    import sys

    sys.path.insert(0, os.path.join(REPO, "training"))
    import eval_digits

    rows = eval_digits.main(
        [
            "--student",
            f"rcm={out}",
            "--out",
            str(tmp_path / "eval"),
            "--samples",
            "40",
            "--ref_steps",
            "8",
            "--teacher_steps",
            "1",
            "--student_steps",
            "1,2",
        ]
    )
    assert [(r.method, r.steps) for r in rows if r.method.startswith("student rcm")] == [
        ("student rcm", 1),
        ("student rcm", 2),
        ("student rcm: user call", 1),
        ("student rcm: user call", 2),
        ("student rcm: from_config defaults", 1),
        ("student rcm: from_config defaults", 2),
    ]
    assert all(np.isfinite(r.fd) and 0 <= r.accuracy <= 1 for r in rows)
    assert (tmp_path / "eval" / "report.md").exists() and (tmp_path / "eval" / "samples.png").exists()
    # the LoRA changed the network: 1-step student samples differ from the un-adapted teacher's
    tr, emb = D.load_teacher()
    st, _ = D.load_student(D.TEACHER_DIR, str(out))
    y = torch.arange(10)
    assert (D.sample_student(st, emb, y, 1) - D.sample_student(tr, emb, y, 1)).abs().max() > 1e-4


def test_teacher_training_script_is_seeded(tmp_path):
    """Two 3-step runs of training/train_teacher_digits.py write bit-identical weights and embeddings, and leave the
    shipped assets alone."""
    import sys

    from safetensors.torch import load_file

    sys.path.insert(0, os.path.join(REPO, "training"))
    import train_teacher_digits

    def shipped():
        return {
            os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns for d, _, fs in os.walk(D.ASSETS) for f in fs
        }

    before = shipped()
    outs = []
    for k in range(2):
        out = str(tmp_path / f"t{k}")
        train_teacher_digits.main(
            [
                "--out",
                out,
                "--steps",
                "3",
                "--batch_size",
                "16",
                "--classifier_out",
                "",
                "--data_out",
                "",
                "--eval_samples",
                "0",
            ]
        )
        outs.append(
            {
                **load_file(os.path.join(out, "transformer", "diffusion_pytorch_model.safetensors")),
                **load_file(os.path.join(out, "class_embeddings.safetensors")),
            }
        )
    assert outs[0].keys() == outs[1].keys()
    for k, v in outs[0].items():
        assert torch.equal(v, outs[1][k]), k
    tr, emb = D.load_teacher(str(tmp_path / "t0"))
    assert emb.shape == (11, D.TEXT_LEN, D.TEXT_DIM)
    assert shipped() == before  # another teacher's ODE pairs never land in the shipped ones (--pairs_out auto)


def test_extra_ema_rates_leave_training_and_the_configured_ema_alone(tmp_path):
    """``benchmarks/train_extra_ema.py`` (the EMA-rate sweep of docs/screens.md): the extra shadow at the configured
    rate equals the run's own ``ema/`` export bit for bit, another rate differs, and a second rate is just another
    folder."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    out = tmp_path / "run"
    cmd = [
        sys.executable,
        os.path.join(REPO, "benchmarks", "train_extra_ema.py"),
        "0.1,0.3",
        "--",
        "--output_dir",
        str(out),
        "--max_steps",
        "4",
        "--tangent_warmup",
        "1",
        "--student_update_freq",
        "2",
        "--batch_size",
        "4",
        "--checkpoint_every",
        "0",
        "--progress",
        "false",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, cwd=REPO, env=env, capture_output=True, timeout=300)
    lora = "pytorch_lora_weights.safetensors"
    ema, same, other = (load_file(out / d / lora) for d in ("ema", "ema-0.1", "ema-0.3"))
    assert set(ema) == set(same) == set(other)
    assert all(torch.equal(ema[k], same[k]) for k in ema)
    assert max(float((ema[k] - other[k]).abs().max()) for k in ema) > 0
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run(cmd + ["--resume", "latest"], check=True, cwd=REPO, env=env, capture_output=True, timeout=120)
