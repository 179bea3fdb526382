"""End-to-end trainer runs on a tiny random Wan T2V (CPU, ``accelerate launch`` with one process)."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import (
    REPO,
    kill_after,
    make_dataset,
    plant_pickles,
    run_script,
    run_trainer,
    tiny_wan_run,
    trainer_args,
)

from rcm_diffusers.distill.alternation import plan_step
from rcm_diffusers.distill.checkpoints import KILL_ENV

CONFIG = os.path.join(REPO, "training", "configs", "tiny-wan-test.yaml")


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    return tiny_wan_run(tmp_path_factory, "wan")


def _args(wan, out, *extra):
    return trainer_args(CONFIG, wan, out, *extra)


@pytest.fixture(scope="module")
def full_run(wan):
    out = wan[2] / "run_full"
    run_trainer(_args(wan, out))
    return out


def _pipe_latents(pipe_dir, lora_dir=None):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(pipe_dir, text_encoder=None, tokenizer=None)
    if lora_dir:
        pipe.load_lora_weights(lora_dir)
    g = torch.Generator().manual_seed(0)
    emb = load_file(os.path.join(os.path.dirname(pipe_dir), "data", "tables.safetensors"))
    return pipe(
        prompt_embeds=emb["prompt_embeds"][:1],
        negative_prompt_embeds=emb["negative_prompt_embeds"],
        height=32,
        width=32,
        num_frames=1,
        num_inference_steps=2,
        guidance_scale=2.0,
        generator=g,
        output_type="latent",
    ).frames


def test_30_steps_alternate_and_log(full_run):
    recs = [json.loads(line) for line in open(full_run / "metrics.jsonl")]
    assert [r["step"] for r in recs] == list(range(30))
    # config: tangent_warmup 10, student_update_freq 3, max_simulation_steps 2
    want = [plan_step(i, 10, 3, 2) for i in range(30)]
    assert [r["net"] for r in recs] == ["student" if p.student else "fake" for p in want]
    assert [r["net"] for r in recs[8:17]] == [
        "student",
        "student",
        "student",
        "fake",
        "fake",
        "student",
        "fake",
        "fake",
        "student",
    ]
    for r, p in zip(recs, want):
        assert r["student_eff"] == p.student_eff and r["fake_eff"] == p.fake_eff
        assert all(r[k] >= 0 and r[k] < 1e6 for k in ("grad_norm", "step_time", "peak_mem_mb", "lr"))
        if p.student:
            assert 0 < r["loss_scm"] <= 1.0  # normalised g: each sample contributes < 1
            assert r["warmup_r"] == pytest.approx(min(1.0, p.student_eff / 10))
            assert ("loss_dmd" in r) == p.dmd
        else:
            assert r["loss_fake"] > 0 and r["n_sim"] == p.fake_eff % 2 + 1
    env = json.load(open(full_run / "env.json"))
    assert env["packages"]["torch"] and env["config"]["max_steps"] == 30 and env["world_size"] == 1
    assert sorted(os.listdir(full_run / "checkpoints")) == ["step-00000010", "step-00000020", "step-00000030"]


def test_saved_lora_loads_and_changes_output(wan, full_run):
    pipe_dir = wan[0]
    sd = load_file(full_run / "pytorch_lora_weights.safetensors")
    assert sd and all(k.startswith("transformer.") for k in sd)
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in sd.items())  # trained away from B = 0
    base = _pipe_latents(pipe_dir)
    lora = _pipe_latents(pipe_dir, str(full_run))
    ema = _pipe_latents(pipe_dir, str(full_run / "ema"))
    assert (lora - base).abs().max() > 1e-4
    assert (ema - base).abs().max() > 1e-6 and (ema - lora).abs().max() > 1e-7
    # the loaded weights are the trained adapter: a second load of the same file gives the same output
    torch.testing.assert_close(_pipe_latents(pipe_dir, str(full_run)), lora, rtol=0, atol=0)


def test_exported_scheduler_is_the_one_the_student_was_trained_for(full_run):
    """``trainer.export_student`` writes ``scheduler/`` next to the LoRA and its EMA variant: RCMScheduler with
    the run's ``sigma_max``, ``mid_t`` and ``time_input`` (env.json's config), loadable by diffusers."""
    from rcm_diffusers import RCMScheduler

    cfg = json.load(open(full_run / "env.json"))["config"]
    for d in (full_run, full_run / "ema"):
        s = RCMScheduler.from_pretrained(str(d), subfolder="scheduler")
        assert s.config.rcm_sigma_max == cfg["sigma_max"] and s.config.time_input == cfg["time_input"]
        assert list(s.config.mid_t) == (cfg["mid_t"] or list(RCMScheduler().config.mid_t))


def test_kill_and_resume_is_bitwise(wan, full_run):
    """Killed after step 14, then again in the middle of writing the step-20 checkpoint; the last metrics line
    torn, a damaged copy posing as the newest checkpoint, and code-running pickles in all of accelerate's
    checkpoint file names: the final LoRA, EMA and metrics equal the uninterrupted run's bit for bit."""
    out = wan[2] / "run_resume"
    p = run_trainer(_args(wan, out), check=False, env=kill_after(14))
    assert p.returncode != 0 and "exit_after_step 14: hard exit" in p.stdout, p.stderr[-3000:]  # launcher maps 17 -> 1
    assert sorted(os.listdir(out / "checkpoints")) == ["step-00000010"]
    assert not (out / "pytorch_lora_weights.safetensors").exists()
    step10, marker = out / "checkpoints" / "step-00000010", wan[2] / "code_ran"
    plant_pickles(step10, marker)
    p = run_trainer(_args(wan, out, "--resume", "latest"), check=False, env={KILL_ENV: "20"})
    assert p.returncode != 0 and "hard exit while writing the checkpoint" in p.stdout, p.stderr[-3000:]
    assert sorted(os.listdir(out / "checkpoints")) == ["step-00000010", "step-00000020.tmp"]
    assert not (out / "checkpoints" / "step-00000020.tmp" / "manifest.json").exists()
    shutil.copytree(step10, out / "checkpoints" / "step-00000020")
    with open(out / "checkpoints" / "step-00000020" / "trainable.safetensors", "r+b") as f:
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 1]))
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 20, "net": "stu')
    p = run_trainer(_args(wan, out, "--resume", "latest"))
    assert "step-00000020 is damaged, skipped: " in p.stdout and "does not match its SHA-256" in p.stdout
    assert f"resumed from {step10} at iteration 10" in p.stdout and "dropped 1 unreadable line" in p.stderr
    assert not marker.exists()
    for name in ("pytorch_lora_weights.safetensors", "ema/pytorch_lora_weights.safetensors"):
        a, b = load_file(full_run / name), load_file(out / name)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k)
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in recs] == list(range(30))  # steps 10..19 rewritten once, not duplicated
    ref = [json.loads(line) for line in open(full_run / "metrics.jsonl")]
    assert [r.get("loss_scm") for r in recs] == [r.get("loss_scm") for r in ref]
    env = json.load(open(out / "env.json"))
    assert [s["start_step"] for s in env["sessions"]] == [0, 10, 10] and env["resumed_from"] == str(step10)


def test_a_used_run_folder_is_never_mixed(wan, full_run):
    """A new run into a finished run's folder, changed shapes, a shorter run, a second writer: each refused with
    one plain message before anything is written."""
    from rcm_diffusers.distill.run_folder import RunLock

    def listing():
        return {
            str(p.relative_to(full_run)): p.stat().st_mtime_ns for p in full_run.rglob("*") if p.name != ".rcm-run.lock"
        }

    before = listing()
    cases = [
        (("--seed", "1", "--max_steps", "40"), "already holds a training run"),
        (("--resume", "latest", "--lora_rank", "8"), "cannot change on resume: lora_rank 4 -> 8"),
        (("--resume", "latest", "--max_steps", "15"), "--max_steps 15 is below the checkpoint's step 30"),
        (("--resume", "latest", "--pretrained", str(wan[2] / "missing")), "no such folder"),
    ]
    for extra, msg in cases:
        p = run_script(_args(wan, full_run, *extra))
        assert p.returncode == 2 and p.stderr.count(msg) == 1 and "Traceback" not in p.stderr, (extra, p.stderr[-3000:])
    lock = RunLock(str(full_run))
    p = run_script(_args(wan, full_run, "--resume", "latest"))
    lock.release()
    assert p.returncode == 2 and f"is in use by pid {os.getpid()}" in p.stderr, p.stderr[-3000:]
    assert listing() == before


def test_changed_lr_and_ema_rate_apply_on_resume(wan, full_run):
    out = wan[2] / "run_lr"
    run_trainer(
        _args(
            wan,
            out,
            "--resume",
            str(full_run / "checkpoints" / "step-00000020"),
            "--max_steps",
            "22",
            "--lr",
            "1e-2",
            "--fake_lr",
            "2e-2",
            "--ema_rate",
            "0.2",
        )
    )
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [(r["step"], r["lr"]) for r in recs] == [
        (i, 1e-2 if r["net"] == "student" else 2e-2) for i, r in zip((20, 21), recs)
    ]
    env = json.load(open(out / "env.json"))
    assert env["config"]["lr"] == 1e-2
    assert env["changed_on_resume"] == {"lr": [1e-3, 1e-2], "fake_lr": [1e-3, 2e-2], "ema_rate": [0.1, 0.2]}


def test_training_on_nan_latents_fails(wan):
    """NaN latents are refused before the run folder (exit 2, one line); with the value scan off
    (check_data_values false) training on them stops at the skipped-step limit, without exports."""
    from safetensors.torch import save_file

    data = wan[2] / "nan_data"
    shutil.copytree(wan[1], data)
    lat = load_file(data / "shard-00000.safetensors")
    lat["latents"] = torch.full_like(lat["latents"], float("nan"))
    save_file(lat, data / "shard-00000.safetensors")
    out = wan[2] / "run_nan"
    args = [
        "--config",
        CONFIG,
        "--pretrained",
        wan[0],
        "--data_dir",
        str(data),
        "--output_dir",
        str(out),
        "--max_steps",
        "10",
    ]
    p = run_script(args)
    assert p.returncode == 2 and p.stderr.count("error: ") == 1, p.stderr[-3000:]
    assert "latents of sample 0 holds NaN or inf" in p.stderr, p.stderr[-3000:]
    assert not out.exists()
    p = run_trainer([*args, "--check_data_values", "false"], check=False)
    assert p.returncode != 0 and "non-finite gradient and were skipped" in p.stderr, p.stderr[-3000:]
    assert "gradient norm is nan, optimizer step skipped" in p.stdout
    assert not (out / "final.json").exists() and not (out / "pytorch_lora_weights.safetensors").exists()


def test_final_json_lists_every_export_and_verify_catches_a_flipped_bit(full_run, tmp_path):
    final = json.load(open(full_run / "final.json"))
    exported = sorted(
        os.path.relpath(os.path.join(d, f), full_run)
        for n in ("pytorch_lora_weights.safetensors", "ema", "scheduler")
        for d, _, fs in ([(str(full_run), None, [n])] if n.endswith(".safetensors") else os.walk(full_run / n))
        for f in fs
    )
    assert sorted(final["files"]) == exported and "ema/scheduler/scheduler_config.json" in exported
    size = os.path.getsize(full_run / "pytorch_lora_weights.safetensors")
    assert final["files"]["pytorch_lora_weights.safetensors"]["bytes"] == size
    p = run_script(["--verify", str(full_run)])
    assert p.returncode == 0 and f"ok: {len(exported)} exported files match final.json" in p.stdout, p.stderr[-2000:]
    copy = tmp_path / "copy"
    shutil.copytree(full_run, copy, ignore=shutil.ignore_patterns("checkpoints"))
    with open(copy / "ema" / "pytorch_lora_weights.safetensors", "r+b") as f:
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0x01]))
    p = run_script(["--verify", str(copy)])
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert (
        p.stderr.strip() == "error: ema/pytorch_lora_weights.safetensors: SHA-256 differs from final.json "
        "(the file was changed or damaged)"
    )


# ----------------------------------------------------------------------------- dCM and fixed-angle DMD: JVP-free


class _NoForwardAD(torch.autograd.Function):
    """Identity with a backward and no forward-mode rule: any JVP through it raises."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


class NoJVPAttnProcessor:
    """The stock Wan attention processor behind ``_NoForwardAD``: trains in reverse mode, fails under
    ``torch.func.jvp``."""

    def __init__(self, stock, calls):
        self.stock, self.calls = stock, calls

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        self.calls.append(1)
        return _NoForwardAD.apply(self.stock(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb))


def _rcm_main():
    import importlib.util

    spec = importlib.util.spec_from_file_location("rcm_train_script", os.path.join(REPO, "training", "rcm.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dcm_and_fixed_dmd_train_without_any_jvp(wan, monkeypatch):
    """``training/rcm.py`` with every attention processor replaced by one that has no forward-mode support:
    ``cm_type dcm`` + DMD on fixed angles (``fd_type 0`` set, and ignored) trains through warm-up, student and
    fake-score steps and never installs the JVP attention; the same trainer with sCM ``fd_type 0`` fails on that
    processor (so the first run would fail had it taken a JVP)."""
    import rcm_diffusers.attention as A
    from rcm_diffusers.distill import base_model as T

    enabled, calls = [], []
    monkeypatch.setattr(A, "enable_jvp_attention", lambda m, *a, **k: enabled.append(m) or m)
    load = T.load_transformer

    def load_with_no_jvp_processors(*a, **k):
        m = load(*a, **k)
        m.set_attn_processor({n: NoJVPAttnProcessor(p, calls) for n, p in m.attn_processors.items()})
        return m

    monkeypatch.setattr(T, "load_transformer", load_with_no_jvp_processors)
    main = _rcm_main().main
    out = wan[2] / "run_nojvp_dcm"
    main(
        _args(
            wan,
            out,
            "--cm_type",
            "dcm",
            "--fd_type",
            "0",
            "--dmd_fix_timesteps",
            "true",
            "--max_steps",
            "6",
            "--tangent_warmup",
            "2",
            "--student_update_freq",
            "2",
            "--checkpoint_every",
            "0",
            "--ema_rate",
            "0",
        )
    )
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["net"] for r in recs] == ["student", "student", "student", "fake", "student", "fake"]
    assert all("loss_dcm" in r and "loss_scm" not in r and r["loss_dcm"] > 0 for r in recs if r["net"] == "student")
    assert any("loss_dmd" in r for r in recs) and (out / "final.json").exists()
    assert enabled == [] and len(calls) > 0
    calls.clear()
    # the JVP fails on the first attention op without a forward-mode rule: on CPU that is the stock SDPA inside the
    # processor (no forward-AD formula), else _NoForwardAD
    with pytest.raises(
        RuntimeError, match="forward AD with _scaled_dot_product|autograd.Function with functorch transforms"
    ):
        main(
            _args(
                wan,
                wan[2] / "run_nojvp_scm",
                "--fd_type",
                "0",
                "--max_steps",
                "2",
                "--tangent_warmup",
                "0",
                "--checkpoint_every",
                "0",
                "--ema_rate",
                "0",
            )
        )
    assert len(enabled) == 1 and len(calls) > 0


def test_dcm_kill_and_resume_equals_uninterrupted(wan):
    """A dCM + fixed-angle DMD run killed after step 6 and resumed from its step-4 checkpoint ends with the same LoRA,
    EMA and logged losses, bit for bit, as the same run uninterrupted."""
    extra = (
        "--cm_type",
        "dcm",
        "--dcm_skipping_interval_steps",
        "2",
        "--dmd_fix_timesteps",
        "true",
        "--max_steps",
        "10",
        "--tangent_warmup",
        "3",
        "--checkpoint_every",
        "4",
    )
    full, cut = wan[2] / "run_dcm_full", wan[2] / "run_dcm_cut"
    run_trainer(_args(wan, full, *extra))
    p = run_trainer(_args(wan, cut, *extra), check=False, env=kill_after(6))
    assert p.returncode != 0 and "exit_after_step 6: hard exit" in p.stdout, p.stderr[-3000:]
    p = run_trainer(_args(wan, cut, *extra, "--resume", "latest"))
    assert "at iteration 4" in p.stdout
    for name in ("pytorch_lora_weights.safetensors", "ema/pytorch_lora_weights.safetensors"):
        a, b = load_file(full / name), load_file(cut / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    ref = [json.loads(line) for line in open(full / "metrics.jsonl")]
    got = [json.loads(line) for line in open(cut / "metrics.jsonl")]
    keys = ("step", "net", "loss_dcm", "loss_dmd", "loss_fake")
    assert [[r.get(k) for k in keys] for r in got] == [[r.get(k) for k in keys] for r in ref]
    assert any("loss_dmd" in r for r in ref) and sum("loss_dcm" in r for r in ref) >= 5


@torch.no_grad()
def test_regression_term_equals_teacher_one_step_error_and_resumes(wan):
    """With ``regression_weight``, every student step logs ``loss_reg``: at step 0 (student = teacher, LoRA B = 0) it
    equals the mean over the step's pairs (``pair_indices``) of ``||x0(noise, r = 1) - target||^2``, where the teacher's
    rectified-flow ``x0 = x_r - r v`` is computed here from the diffusers transformer directly; a run killed after
    step 6 and resumed from step 4 ends with the same LoRA, EMA and logged losses, bit for bit."""
    from diffusers import WanTransformer3DModel

    from rcm_diffusers.distill.data import LatentDataset, pair_indices

    pairs = make_dataset(str(wan[2] / "pairs"), "wan", n=7, noise=True)
    extra = (
        "--regression_weight",
        "0.5",
        "--regression_data_dir",
        str(pairs),
        "--max_steps",
        "10",
        "--tangent_warmup",
        "3",
        "--checkpoint_every",
        "4",
    )
    full, cut = wan[2] / "run_reg_full", wan[2] / "run_reg_cut"
    run_trainer(_args(wan, full, *extra))
    ref = [json.loads(line) for line in open(full / "metrics.jsonl")]
    assert all(("loss_reg" in r) == (r["net"] == "student") for r in ref) and any(r["net"] == "fake" for r in ref)
    b = LatentDataset(str(pairs)).get(pair_indices(7, 2, 0, 0, 1, 0))  # batch 2, step 0, rank 0 of 1, seed 0
    tr = WanTransformer3DModel.from_pretrained(wan[0], subfolder="transformer").eval()
    v = tr(
        hidden_states=b["noise"],
        timestep=torch.full((2,), 1000.0),
        encoder_hidden_states=b["prompt_embeds"],
        return_dict=False,
    )[0]
    want = ((b["noise"].double() - v.double() - b["latents"].double()) ** 2).flatten(1).sum(1).mean()
    assert ref[0]["loss_reg"] == pytest.approx(float(want), rel=1e-5)
    p = run_trainer(_args(wan, cut, *extra), check=False, env=kill_after(6))
    assert p.returncode != 0 and "exit_after_step 6: hard exit" in p.stdout, p.stderr[-3000:]
    assert "at iteration 4" in run_trainer(_args(wan, cut, *extra, "--resume", "latest")).stdout
    for name in ("pytorch_lora_weights.safetensors", "ema/pytorch_lora_weights.safetensors"):
        a, c = load_file(full / name), load_file(cut / name)
        assert a.keys() == c.keys() and all(torch.equal(a[k], c[k]) for k in a), name
    got = [json.loads(line) for line in open(cut / "metrics.jsonl")]
    keys = ("step", "net", "loss_reg", "loss_scm", "loss_dmd", "loss_fake")
    assert [[r.get(k) for k in keys] for r in got] == [[r.get(k) for k in keys] for r in ref]


def test_regression_warmup_runs_the_regression_term_alone_first(wan):
    """``regression_warmup 3``: iterations 0-2 train the student on the ODE-pair term alone (``loss_reg`` only, no
    sCM, DMD or fake-score loss); from iteration 3 on the run logs what a run without it logs at ``i - 3`` (the tangent
    warm-up, then the alternation with DMD and the fake score)."""
    pairs = make_dataset(str(wan[2] / "pairs_rw"), "wan", n=7, noise=True)
    common = ("--regression_weight", "0.5", "--regression_data_dir", str(pairs), "--tangent_warmup", "2")
    run_trainer(_args(wan, wan[2] / "run_rw", *common, "--max_steps", "8", "--regression_warmup", "3"))
    run_trainer(_args(wan, wan[2] / "run_rw0", *common, "--max_steps", "5"))
    got = [json.loads(line) for line in open(wan[2] / "run_rw" / "metrics.jsonl")]
    ref = [json.loads(line) for line in open(wan[2] / "run_rw0" / "metrics.jsonl")]
    losses = lambda r: sorted(k for k in r if k.startswith("loss_"))  # noqa: E731
    assert [r["step"] for r in got] == list(range(8))
    assert all(r["net"] == "student" and losses(r) == ["loss_reg"] for r in got[:3])
    assert [(r["net"], losses(r), r.get("n_sim")) for r in got[3:]] == [
        (r["net"], losses(r), r.get("n_sim")) for r in ref
    ]
    assert any(r["net"] == "fake" for r in got) and any("loss_dmd" in r for r in got)
