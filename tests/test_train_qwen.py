"""Qwen-Image (QwenImagePipeline) as a teacher of the rCM trainer, on a tiny random model (CPU): the family by exact
class, sCM (exact JVP, fd_type 0) + DMD and dCM runs through training/rcm.py, kill / resume bit for bit, the exported
LoRA in a stock QwenImagePipeline, and the model call and true CFG against the stock pipeline's own."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import (
    QWEN_LENGTHS,
    REPO,
    kill_after,
    make_qwen_dataset,
    make_tiny_qwen,
    run_script,
    run_trainer,
    tiny_qwen_transformer,
)

from rcm_diffusers.distill.alternation import plan_step
from rcm_diffusers.distill.data import LatentDataset, model_inputs, pack_flux_latents
from rcm_diffusers.lora.keys import detect_arch

CONFIG = os.path.join(REPO, "training", "configs", "tiny-qwen-test.yaml")
STEPS, WARMUP, FREQ = 8, 2, 2  # tiny-qwen-test.yaml


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen")
    return make_tiny_qwen(str(root / "pipe")), make_qwen_dataset(str(root / "data")), root


def _args(qwen, out, *extra):
    return ["--config", CONFIG, "--pretrained", qwen[0], "--data_dir", qwen[1], "--output_dir", str(out), *extra]


@pytest.fixture(scope="module")
def fd0_run(qwen):
    """sCM with the exact JVP (fd_type 0, through rcm_diffusers.attention with the text mask) + DMD, 8 iterations."""
    out = qwen[2] / "run_fd0"
    run_trainer(_args(qwen, out))
    return out


def _stock_pipe(pipe_dir):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(pipe_dir, text_encoder=None, tokenizer=None)


def _batch(data_dir, ids):
    """Rows ``ids`` of the dataset, and their text as QwenImagePipeline.encode_prompt returns it for that batch
    (padded to the batch's longest prompt, with its mask)."""
    batch = LatentDataset(data_dir).get(ids)
    n = int(batch["prompt_embeds_mask"].sum(1).max())
    return batch, batch["prompt_embeds"][:, :n], batch["prompt_embeds_mask"][:, :n].long()


# ----------------------------------------------------------------------------- family


def _fake_teacher(root, pipeline):
    (root / "transformer").mkdir(parents=True)
    index = {"_class_name": pipeline, "transformer": ["diffusers", "QwenImageTransformer2DModel"]}
    (root / "model_index.json").write_text(json.dumps(index))
    (root / "transformer" / "config.json").write_text(json.dumps({"_class_name": "QwenImageTransformer2DModel"}))
    (root / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"not a model")
    return root


def test_qwen_family_by_exact_class(qwen, tmp_path, capsys):
    """QwenImagePipeline is the family; the other Qwen-Image pipelines (same transformer class) are refused in one
    line that names the supported teachers, by training/rcm.py before the teacher loads; QAD refuses Qwen-Image."""
    from rcm_diffusers.distill import inputs
    from rcm_diffusers.distill.config import QADConfig
    from rcm_diffusers.distill.families import UnsupportedTeacher, teacher_family

    with open(os.path.join(qwen[0], "model_index.json")) as f:
        assert teacher_family(json.load(f)).name == "qwen"
    for pipeline in ("QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline", "QwenImageEditPlusPipeline"):
        index = {"_class_name": pipeline, "transformer": ["diffusers", "QwenImageTransformer2DModel"]}
        with pytest.raises(UnsupportedTeacher, match=f"a {pipeline} with QwenImageTransformer2DModel is not"):
            teacher_family(index)
    with pytest.raises(SystemExit) as e:  # QAD: Wan and FLUX.1 only, refused before a model loads
        inputs.check_inputs(QADConfig(pretrained=qwen[0], data_dir=qwen[1], output_dir=str(tmp_path / "qad")))
    assert e.value.code == 2 and "QAD (training/qad.py) supports Wan and FLUX.1 teachers" in capsys.readouterr().err
    teacher = _fake_teacher(tmp_path / "teacher", "QwenImageEditPipeline")
    out = tmp_path / "run"
    p = run_script(["--config", CONFIG, "--pretrained", str(teacher), "--data_dir", qwen[1], "--output_dir", str(out)])
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]  # (library warnings aside)
    assert len(errors) == 1 and p.stderr.strip().endswith(errors[0]), p.stderr[-3000:]
    assert "a QwenImageEditPipeline with QwenImageTransformer2DModel is not a supported teacher" in errors[0]
    assert "supported: " in errors[0] and "QwenImagePipeline (QwenImageTransformer2DModel)" in errors[0]
    assert not out.exists()


# ----------------------------------------------------------------------------- training runs


def test_qwen_scm_fd0_dmd_trains(fd0_run):
    recs = [json.loads(line) for line in open(fd0_run / "metrics.jsonl")]
    want = [plan_step(i, WARMUP, FREQ, 2) for i in range(STEPS)]
    assert [r["net"] for r in recs] == ["student" if p.student else "fake" for p in want]
    student = [r for r in recs if r["net"] == "student"]
    assert all(r["nan_scm"] == 0 and 0 < r["loss_scm"] <= 1 for r in student)
    assert any("loss_dmd" in r and r["nan_dmd"] == 0 for r in student)
    sd = load_file(fd0_run / "pytorch_lora_weights.safetensors")
    for t in ("attn.to_q", "attn.add_k_proj", "attn.to_add_out", "img_mlp.net.2", "txt_mlp.net.0.proj"):
        assert f"transformer.transformer_blocks.1.{t}.lora_B.weight" in sd, t
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in sd.items())


def test_qwen_dcm_trains(qwen):
    out = qwen[2] / "run_dcm"
    run_trainer(_args(qwen, out, "--cm_type", "dcm", "--max_steps", "4", "--checkpoint_every", "0"))
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(recs) == 4 and all(r["nan_dcm"] == 0 and r["loss_dcm"] > 0 for r in recs if "loss_dcm" in r)
    assert sum("loss_dcm" in r for r in recs) >= 2 and (out / "pytorch_lora_weights.safetensors").exists()


def test_qwen_kill_and_resume_is_bitwise(qwen, fd0_run):
    out = qwen[2] / "run_resume"
    p = run_trainer(_args(qwen, out), check=False, env=kill_after(5))
    assert p.returncode != 0 and "exit_after_step 5: hard exit" in p.stdout, p.stderr[-3000:]
    assert sorted(os.listdir(out / "checkpoints")) == ["step-00000004"]
    p = run_trainer(_args(qwen, out, "--resume", "latest"))
    assert "at iteration 4" in p.stdout, p.stdout[-2000:]
    for name in ("pytorch_lora_weights.safetensors", "ema/pytorch_lora_weights.safetensors"):
        a, b = load_file(fd0_run / name), load_file(out / name)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k)
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    ref = [json.loads(line) for line in open(fd0_run / "metrics.jsonl")]
    assert [r["step"] for r in recs] == list(range(STEPS))
    assert [r.get("loss_scm") for r in recs] == [r.get("loss_scm") for r in ref]


# ----------------------------------------------------------------------------- the exported LoRA


def _sample(pipe, data_dir):
    _, pe, mask = _batch(data_dir, [0, 1])
    return pipe(
        prompt_embeds=pe,
        prompt_embeds_mask=mask,
        height=32,
        width=32,
        num_inference_steps=2,
        true_cfg_scale=1.0,
        generator=torch.Generator().manual_seed(0),
        output_type="latent",
    ).images


def test_qwen_lora_loads_in_stock_pipeline_as_its_fused_delta(qwen, fd0_run):
    pipe_dir, data_dir, _ = qwen
    base = _sample(_stock_pipe(pipe_dir), data_dir)
    pipe = _stock_pipe(pipe_dir)
    pipe.load_lora_weights(str(fd0_run))
    lora = _sample(pipe, data_dir)
    # the same delta fused by hand: W += (alpha / r) B A, alpha = r (lora_alpha unset in tiny-qwen-test.yaml)
    fused = _stock_pipe(pipe_dir)
    sd = load_file(fd0_run / "pytorch_lora_weights.safetensors")
    mods = dict(fused.transformer.named_modules())
    with torch.no_grad():
        for k, A in sd.items():
            if k.endswith(".lora_A.weight"):
                name = k[len("transformer.") : -len(".lora_A.weight")]
                mods[name].weight += sd[k.replace("lora_A", "lora_B")] @ A
    ref = _sample(fused, data_dir)
    assert (lora - base).abs().max() > 1e-3  # the trained delta shows
    assert (lora - ref).abs().max() <= 1e-5 * max(1.0, float(ref.abs().max()))
    with pytest.raises(ValueError, match="a Qwen-Image state dict"):  # rcm-lora: not taken for a Flux LoRA
        detect_arch(sd)


# ----------------------------------------------------------------------------- parity with the stock pipeline


def _record_transformer(pipe):
    """Record the transformer's kwargs and output of every call of the pipeline."""
    calls = []

    def hook(module, args, kwargs, out):
        calls.append((dict(kwargs), out[0].detach().clone()))

    pipe.transformer.register_forward_hook(hook, with_kwargs=True)
    return calls


def test_qwen_velocity_is_the_stock_pipeline_call(qwen):
    """models.velocity_fn on data.model_inputs of dataset rows with prompts of different lengths equals, bit for
    bit, the transformer call QwenImagePipeline makes for the same prompts (padded to the batch's longest, mask)."""
    from rcm_diffusers.models import velocity_fn

    pipe_dir, data_dir, _ = qwen
    pipe = _stock_pipe(pipe_dir)
    ids = [0, 2]  # prompts of 3 and 4 tokens: a batch padded to 4, with a mask
    batch, pe, mask = _batch(data_dir, ids)
    assert sorted(QWEN_LENGTHS[i] for i in ids) == [3, 4] and not mask.all()
    noise = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    calls = _record_transformer(pipe)
    pipe(
        prompt_embeds=pe,
        prompt_embeds_mask=mask,
        latents=pack_flux_latents(noise),
        height=32,
        width=32,
        num_inference_steps=2,  # (one step of this scheduler's terminal shift is NaN)
        true_cfg_scale=1.0,
        output_type="latent",
    )
    kw, out = calls[0]
    x, cond, _ = model_inputs("qwen", {**batch, "latents": noise}, "cpu", torch.float32)
    assert torch.equal(cond["encoder_hidden_states"], kw["encoder_hidden_states"])
    assert torch.equal(cond["encoder_hidden_states_mask"], kw["encoder_hidden_states_mask"])
    assert cond["img_shapes"] == kw["img_shapes"] and torch.equal(x.float(), kw["hidden_states"])
    r = kw["timestep"][0].double()  # the pipeline's timestep / 1000: velocity_fn takes the RF time r itself
    v = velocity_fn(pipe.transformer)(x.float(), r, **cond)
    assert torch.equal(v, out)


def test_qwen_teacher_cfg_is_the_stock_true_cfg(qwen):
    """The trainer's guided teacher (distill.terms.teacher_F, CFG scale 4) equals QwenImagePipeline's true CFG at
    true_cfg_scale 4 (the combination rescaled per token to the conditional prediction's norm) to float32
    round-off; the plain combination differs."""
    from rcm_diffusers.distill.adapters import Networks
    from rcm_diffusers.distill.terms import teacher_F
    from rcm_diffusers.trigflow import r_to_t

    pipe_dir, data_dir, _ = qwen
    pipe = _stock_pipe(pipe_dir)
    ids = [0, 1]
    batch, pe, mask = _batch(data_dir, ids)
    neg = batch["negative_prompt_embeds"][:, :2]  # the 2-token negative prompt, all tokens valid: no mask
    noise = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(2))
    calls, preds = _record_transformer(pipe), []
    step = pipe.scheduler.step
    pipe.scheduler.step = lambda v, *a, **k: (preds.append(v.clone()), step(v, *a, **k))[1]
    pipe(
        prompt_embeds=pe,
        prompt_embeds_mask=mask,
        negative_prompt_embeds=neg,
        latents=pack_flux_latents(noise),
        height=32,
        width=32,
        num_inference_steps=2,
        true_cfg_scale=4.0,
        output_type="latent",
    )
    assert len(calls) == 4 and len(preds) == 2  # first step: calls 0 (conditional) and 1 (negative), preds 0
    x_r, cond, uncond = model_inputs("qwen", {**batch, "latents": noise}, "cpu", torch.float32)
    assert "encoder_hidden_states_mask" not in uncond and torch.equal(uncond["encoder_hidden_states"], neg)
    nets, _ = Networks.build(pipe.transformer, "shared", with_fake=False, lora_rank=4)
    r = calls[0][0]["timestep"][0].double()
    t = r_to_t(r).expand(2)
    s, c = torch.sin(t)[:, None, None], torch.cos(t)[:, None, None]
    x_t = x_r * (s + c)  # TrigFlow x_t of the pipeline's x_r at time r
    F = teacher_F(nets, x_t, t, cond, uncond, 4.0)
    v = F * (s + c) - (c - s) * x_t  # the guided velocity behind F (docs/math.md §1)
    want = preds[0].double()
    scale = float(want.abs().max())
    assert (v - want).abs().max() <= 2e-6 * scale
    v_c, v_u = calls[0][1].double(), calls[1][1].double()
    assert (v_u + 4.0 * (v_c - v_u) - want).abs().max() > 1e-2 * scale  # the rescale matters here


# central differences of the float64 model carry the float32 round-off of what Qwen-Image computes in float32 inside
# (RoPE in complex64, the sinusoidal time embedding) divided by the step: the bound of tests/test_jvp_processors.py,
#   max |tangent - difference quotient| <= rtol max |tangent| + 8 u max |output| / h,   u = 2^-24
FD_STEPS = {"x": (1e-3, 1e-4), "t": (1e-4, 5e-3)}
U32 = 2.0**-24


def test_qwen_exact_jvp_matches_central_differences():
    """fd_type 0's tangent of the student's F through the Qwen-Image transformer (JVP attention with the text mask,
    one-product linears) in float64: equal to stock forward AD on the math SDPA backend to 1e-10, and to central
    differences in x and in t within their round-off bound."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from rcm_diffusers.attention import enable_jvp_attention
    from rcm_diffusers.attention.function import STATS
    from rcm_diffusers.attention.linear_jvp import enable_linear_jvp
    from rcm_diffusers.distill.adapters import Networks

    tr = tiny_qwen_transformer(dtype=torch.float64).eval()
    nets, _ = Networks.build(tr, "shared", with_fake=False, lora_rank=4)
    with torch.no_grad():  # a student that differs from the teacher
        for p in nets.trainable_parameters("student").values():
            p.normal_(0, 0.05)
    g = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    cond = {
        "encoder_hidden_states": torch.randn(2, 5, 16, generator=g, dtype=torch.float64) * mask[..., None],
        "encoder_hidden_states_mask": mask,
        "img_shapes": [[(1, 2, 2)]] * 2,
    }
    x = torch.randn(2, 4, 16, generator=g, dtype=torch.float64)
    t = torch.tensor([0.4, 1.1], dtype=torch.float64)
    dx, dt = torch.randn(2, 4, 16, generator=g, dtype=torch.float64), torch.tensor([0.3, -0.7], dtype=torch.float64)

    def F(x, t):
        return nets.F("student", x, t, cond)

    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        _, want = torch.func.jvp(F, (x, t), (dx, dt))  # stock attention, the score matrix held
    enable_jvp_attention(tr)
    enable_linear_jvp(tr)
    calls = STATS["fused_calls"]
    with torch.no_grad():
        _, tangent = torch.func.jvp(F, (x, t), (dx, dt))
        assert STATS["fused_calls"] > calls  # the JVP pass ran our attention
        assert (tangent - want).abs().max() <= 1e-10 * want.abs().max()
        scale = F(x, t).abs().max()
        for wrt, tx, tt in (("x", dx, torch.zeros_like(dt)), ("t", torch.zeros_like(dx), dt)):
            h, rtol = FD_STEPS[wrt]
            _, ty = torch.func.jvp(F, (x, t), (tx, tt))
            fd = (F(x + h * tx, t + h * tt) - F(x - h * tx, t - h * tt)) / (2 * h)
            assert ty.abs().max() > 1e-3 * scale  # the tangent is not lost in the round-off term
            assert (ty - fd).abs().max() <= rtol * ty.abs().max() + 8 * U32 * scale / h, wrt


# ----------------------------------------------------------------------------- prepare_data


def test_qwen_prepare_latents_text_synthetic_and_decode(qwen, tmp_path):
    """training/prepare_data.py's encoder on a QwenImagePipeline: latents ``(z - mean) / std`` of the one latent
    frame, stored ``[C, h, w]``; the grid decoder inverts it on packed tokens; ``encode_prompt``'s output padded to
    ``max_sequence_length`` with its mask (the tiny pipeline has no Qwen2.5-VL encoder: a stand-in returns what
    encode_prompt returns, a batch padded to its longest prompt and the mask, or None when nothing is padding);
    teacher samples equal QwenImagePipeline with the same scheduler and true CFG."""
    from diffusers import AutoencoderKLQwenImage

    from rcm_diffusers import TrigFlowEulerScheduler
    from rcm_diffusers.distill.prepare import PipelineEncoder, seed_noise, teacher_samples
    from rcm_diffusers.distill.previews import SampleDecoder

    pipe = _stock_pipe(qwen[0])
    mean, std = [0.1, -0.2, 0.3, 0.0], [0.5, 2.0, 1.0, 1.5]
    torch.manual_seed(1)
    pipe.vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, latents_mean=mean, latents_std=std
    ).eval()
    enc = PipelineEncoder(pipe, 32, 32, max_sequence_length=6)
    assert enc.family == "qwen" and enc.latent_shape == (4, 4, 4)
    g = torch.Generator().manual_seed(4)
    px = torch.rand(1, 3, 1, 32, 32, generator=g) * 2 - 1
    lat = enc.encode_media(px)
    m, s = torch.tensor(mean).view(1, 4, 1, 1, 1), torch.tensor(std).view(1, 4, 1, 1, 1)
    ref = (pipe.vae.encode(px).latent_dist.mode() - m) / s
    torch.testing.assert_close(lat, ref[:, :, 0], rtol=1e-5, atol=1e-5)
    img = SampleDecoder(pipe.vae, "qwen").decode(pack_flux_latents(lat), (4, 4))
    torch.testing.assert_close(img, (pipe.vae.decode(ref * s + m).sample / 2 + 0.5).clamp(0, 1))

    table = {"a cat": torch.randn(3, 16, generator=g), "a dog on grass": torch.randn(5, 16, generator=g)}

    def encode_prompt(prompt, device=None, max_sequence_length=512, **kw):
        n = max(len(table[p]) for p in prompt)
        pe = torch.stack([torch.cat([table[p], torch.zeros(n - len(table[p]), 16)]) for p in prompt])
        mask = torch.stack([(torch.arange(n) < len(table[p])).long() for p in prompt])
        return pe, None if mask.all() else mask

    pipe.encode_prompt = encode_prompt
    for name in ("text_encoder", "tokenizer"):  # stand-ins that encode_text sees; put back before sampling
        object.__setattr__(pipe, name, "stand-in")
    text = enc.encode_text(["a cat", "a dog on grass"])
    assert text["prompt_embeds"].shape == (2, 6, 16) and text["prompt_embeds_mask"].tolist() == [
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0],
    ]
    assert torch.equal(text["prompt_embeds"][0, :3], table["a cat"]) and not text["prompt_embeds"][0, 3:].any()
    neg = enc.encode_text(["a cat"])
    assert neg["prompt_embeds_mask"].tolist() == [[1, 1, 1, 0, 0, 0]]
    for name in ("text_encoder", "tokenizer"):
        object.__setattr__(pipe, name, None)
    del pipe.encode_prompt  # the pipeline's own again

    batch = {
        "prompt_embeds": text["prompt_embeds"][1:],
        "prompt_embeds_mask": text["prompt_embeds_mask"][1:],
        "negative_prompt_embeds": neg["prompt_embeds"],
        "negative_prompt_embeds_mask": neg["prompt_embeds_mask"],
    }
    got = teacher_samples(
        pipe.transformer, "qwen", batch, seed_noise((4, 4, 4), [11]), steps=4, shift=3.0, guidance_scale=4.0
    )
    pipe.scheduler = TrigFlowEulerScheduler(shift=3.0, sigma_max=5000.0)
    want = pipe(
        prompt_embeds=table["a dog on grass"][None],
        negative_prompt_embeds=table["a cat"][None],
        true_cfg_scale=4.0,
        height=32,
        width=32,
        num_inference_steps=4,
        generator=torch.Generator().manual_seed(11),
        output_type="latent",
    ).images
    torch.testing.assert_close(pack_flux_latents(got), want, rtol=1e-4, atol=1e-5)
