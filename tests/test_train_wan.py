"""End-to-end trainer runs on a tiny random Wan T2V (CPU, ``accelerate launch`` with one process)."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from rcm_diffusers.alternation import plan_step
from train_helpers import REPO, run_trainer, tiny_wan_run, trainer_args

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
    return pipe(prompt_embeds=emb["prompt_embeds"][:1], negative_prompt_embeds=emb["negative_prompt_embeds"],
                height=32, width=32, num_frames=1, num_inference_steps=2, guidance_scale=2.0, generator=g,
                output_type="latent").frames


def test_30_steps_alternate_and_log(full_run):
    recs = [json.loads(line) for line in open(full_run / "metrics.jsonl")]
    assert [r["step"] for r in recs] == list(range(30))
    # config: tangent_warmup 10, student_update_freq 3, max_simulation_steps 2
    want = [plan_step(i, 10, 3, 2) for i in range(30)]
    assert [r["net"] for r in recs] == ["student" if p.student else "fake" for p in want]
    assert [r["net"] for r in recs[8:17]] == ["student", "student", "student", "fake", "fake", "student", "fake", "fake", "student"]
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


def test_kill_and_resume_is_bitwise(wan, full_run):
    out = wan[2] / "run_resume"
    p = run_trainer(_args(wan, out, "--exit_after_step", "14"), check=False)
    assert p.returncode != 0 and "exit_after_step 14: hard exit" in p.stdout, p.stderr[-3000:]  # launcher maps 17 -> 1
    assert sorted(os.listdir(out / "checkpoints")) == ["step-00000010"]
    assert not (out / "pytorch_lora_weights.safetensors").exists()
    run_trainer(_args(wan, out, "--resume", "latest"))
    for name in ("pytorch_lora_weights.safetensors", "ema/pytorch_lora_weights.safetensors"):
        a, b = load_file(full_run / name), load_file(out / name)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k)
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in recs] == list(range(30))  # steps 10..14 rewritten once, not duplicated
    ref = [json.loads(line) for line in open(full_run / "metrics.jsonl")]
    assert [r.get("loss_scm") for r in recs] == [r.get("loss_scm") for r in ref]
