"""HunyuanVideo-1.5 text-to-video (HunyuanVideo15Pipeline) as a teacher of the rCM trainer, on a tiny random model
(CPU): the family by exact class (image-to-video refused), sCM (exact JVP, fd_type 0) + DMD and dCM runs through
training/rcm.py, kill / resume bit for bit, the exported LoRA in the stock pipeline's transformer, and the model call
and CFG against the stock pipeline's own."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import REPO, kill_after, run_script, run_trainer

from rcm_diffusers.distill.alternation import plan_step
from rcm_diffusers.distill.data import LatentDataset, model_inputs, write_latent_dataset
from rcm_diffusers.lora.keys import detect_arch

CONFIG = os.path.join(REPO, "training", "configs", "tiny-hunyuan15-test.yaml")
STEPS, WARMUP, FREQ = 8, 2, 2  # tiny-hunyuan15-test.yaml
C, SHAPE = (
    4,
    (4, 2, 4, 4),
)  # latent channels; latents [C, F, h, w] of 5 frames at 64 x 64 (VAE x4 in time, x16 in space)
TEXT_DIM, TEXT_2_DIM, IMAGE_DIM = 16, 8, 8
LENGTHS, LENGTHS_2 = (3, 6, 4), (2, 0, 3)  # prompt tokens per class (Qwen2.5-VL, ByT5: 0 = no quoted glyph text)
L, L2 = 6, 4  # padded lengths (the pipeline's 1000 and 256)
NEG_LENGTH = 2
WEIGHTS = "pytorch_lora_weights.safetensors"


def tiny_hunyuan15_transformer(seed: int = 0, dtype: torch.dtype = torch.float32):
    """2-block, 2-head text-to-video HunyuanVideo-1.5 transformer (in_channels 2 C + 1: latents, zero condition
    latents and mask, as the pipeline concatenates them)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(seed)
    m = HunyuanVideo15Transformer3DModel(
        in_channels=2 * C + 1,
        out_channels=C,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=2,
        num_refiner_layers=1,
        text_embed_dim=TEXT_DIM,
        text_embed_2_dim=TEXT_2_DIM,
        image_embed_dim=IMAGE_DIM,
        rope_axes_dim=(4, 6, 6),
        task_type="t2v",
    )
    return m if dtype == torch.float32 else m.to(dtype)


def tiny_vae():
    from diffusers import AutoencoderKLHunyuanVideo15

    torch.manual_seed(0)
    return AutoencoderKLHunyuanVideo15(
        latent_channels=C, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1, scaling_factor=1.5
    )


def make_tiny_hunyuan15(root: str) -> str:
    """Save a tiny HunyuanVideo15Pipeline (tiny VAE, no text encoders) to ``root``; returns its path."""
    from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline

    if os.path.exists(os.path.join(root, "model_index.json")):
        return root
    pipe = HunyuanVideo15Pipeline(
        text_encoder=None,
        tokenizer=None,
        transformer=tiny_hunyuan15_transformer(),
        vae=tiny_vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),  # the 480p T2V scheduler's shift
        text_encoder_2=None,
        tokenizer_2=None,
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )
    pipe.save_pretrained(root)
    return root


def _text(g, lengths, n, width):
    mask = torch.zeros(len(lengths), n)
    for i, k in enumerate(lengths):
        mask[i, :k] = 1.0
    return torch.randn(len(lengths), n, width, generator=g) * mask[..., None], mask


def make_hunyuan15_dataset(root: str, n: int = 16) -> str:
    """Latents ``[C, F, h, w]`` and a class table of both encoders' prompt embeddings at their padded lengths with
    masks (ByT5: all padding for a prompt without quoted text, as ``_get_byt5_prompt_embeds`` returns zeros and a
    zero mask), and a negative prompt, as prepare_data stores HunyuanVideo15Pipeline.encode_prompt's output."""
    if os.path.exists(os.path.join(root, "meta.json")):
        return root
    g = torch.Generator().manual_seed(0)
    classes = len(LENGTHS)
    label = torch.arange(n) % classes
    means = torch.randn(classes, *SHAPE, generator=g)
    lat = means[label] + 0.3 * torch.randn(n, *SHAPE, generator=g)
    pe, pm = _text(g, LENGTHS, L, TEXT_DIM)
    pe2, pm2 = _text(g, LENGTHS_2, L2, TEXT_2_DIM)
    ne, nm = _text(g, (NEG_LENGTH,), L, TEXT_DIM)
    tables = {
        "prompt_embeds": pe,
        "prompt_embeds_mask": pm,
        "prompt_embeds_2": pe2,
        "prompt_embeds_mask_2": pm2,
        "negative_prompt_embeds": ne,
        "negative_prompt_embeds_mask": nm,
        "negative_prompt_embeds_2": torch.zeros(1, L2, TEXT_2_DIM),
        "negative_prompt_embeds_mask_2": torch.zeros(1, L2),
    }
    index = {k: (None if k.startswith("negative") else "prompt_index") for k in tables}
    samples = {"latents": lat, "prompt_index": label}
    return write_latent_dataset(root, samples, family="hunyuan15", tables=tables, table_index=index)


@pytest.fixture(scope="module")
def hy(tmp_path_factory):
    root = tmp_path_factory.mktemp("hunyuan15")
    return make_tiny_hunyuan15(str(root / "pipe")), make_hunyuan15_dataset(str(root / "data")), root


def _args(hy, out, *extra):
    return ["--config", CONFIG, "--pretrained", hy[0], "--data_dir", hy[1], "--output_dir", str(out), *extra]


@pytest.fixture(scope="module")
def fd0_run(hy):
    """sCM with the exact JVP (fd_type 0, through rcm_diffusers.attention with the text masks) + DMD, 8 iterations."""
    out = hy[2] / "run_fd0"
    p = run_trainer(_args(hy, out))
    # the start-up memory and compute predictions know the family (video tokens, the 1000 + 256 + 729 context)
    assert "memory: predicted peak" in p.stdout and "compute: no prediction" not in p.stdout, p.stdout[-3000:]
    return out


def _stock_pipe(pipe_dir):
    from diffusers import HunyuanVideo15Pipeline

    none = dict.fromkeys(("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"))
    return HunyuanVideo15Pipeline.from_pretrained(pipe_dir, **none)


# ----------------------------------------------------------------------------- family


def _fake_teacher(root, pipeline):
    (root / "transformer").mkdir(parents=True)
    index = {"_class_name": pipeline, "transformer": ["diffusers", "HunyuanVideo15Transformer3DModel"]}
    (root / "model_index.json").write_text(json.dumps(index))
    cfg = {"_class_name": "HunyuanVideo15Transformer3DModel"}
    (root / "transformer" / "config.json").write_text(json.dumps(cfg))
    (root / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"not a model")
    return root


def test_hunyuan15_family_by_exact_class(hy, tmp_path, capsys):
    """HunyuanVideo15Pipeline is the family; the image-to-video pipeline (the same transformer class) is refused in
    one line that names the supported teachers, by training/rcm.py before the teacher loads; QAD refuses it."""
    from rcm_diffusers.distill import inputs
    from rcm_diffusers.distill.config import QADConfig
    from rcm_diffusers.distill.families import UnsupportedTeacher, teacher_family

    with open(os.path.join(hy[0], "model_index.json")) as f:
        assert teacher_family(json.load(f)).name == "hunyuan15"
    i2v = "HunyuanVideo15ImageToVideoPipeline"
    index = {"_class_name": i2v, "transformer": ["diffusers", "HunyuanVideo15Transformer3DModel"]}
    with pytest.raises(UnsupportedTeacher, match=f"a {i2v} with HunyuanVideo15Transformer3DModel is not"):
        teacher_family(index)
    with pytest.raises(SystemExit) as e:  # QAD: Wan and FLUX.1 only, refused before a model loads
        inputs.check_inputs(QADConfig(pretrained=hy[0], data_dir=hy[1], output_dir=str(tmp_path / "qad")))
    assert e.value.code == 2 and "supports Wan and FLUX.1 teachers, not HunyuanVideo-1.5" in capsys.readouterr().err
    teacher = _fake_teacher(tmp_path / "teacher", i2v)
    out = tmp_path / "run"
    p = run_script(["--config", CONFIG, "--pretrained", str(teacher), "--data_dir", hy[1], "--output_dir", str(out)])
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and p.stderr.strip().endswith(errors[0]), p.stderr[-3000:]
    assert f"a {i2v} with HunyuanVideo15Transformer3DModel is not a supported teacher" in errors[0]
    assert "HunyuanVideo15Pipeline (HunyuanVideo15Transformer3DModel)" in errors[0] and not out.exists()


# ----------------------------------------------------------------------------- training runs


def test_hunyuan15_scm_fd0_dmd_trains(fd0_run):
    recs = [json.loads(line) for line in open(fd0_run / "metrics.jsonl")]
    want = [plan_step(i, WARMUP, FREQ, 2) for i in range(STEPS)]
    assert [r["net"] for r in recs] == ["student" if p.student else "fake" for p in want]
    student = [r for r in recs if r["net"] == "student"]
    assert all(r["nan_scm"] == 0 and 0 < r["loss_scm"] <= 1 for r in student)
    assert any("loss_dmd" in r and r["nan_dmd"] == 0 for r in student)
    sd = load_file(fd0_run / "pytorch_lora_weights.safetensors")
    for t in ("attn.to_q", "attn.add_k_proj", "attn.to_add_out", "ff.net.2", "ff_context.net.0.proj"):
        assert f"transformer.transformer_blocks.1.{t}.lora_B.weight" in sd, t
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in sd.items())


def test_hunyuan15_dcm_trains(hy):
    out = hy[2] / "run_dcm"
    run_trainer(_args(hy, out, "--cm_type", "dcm", "--max_steps", "4", "--checkpoint_every", "0"))
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(recs) == 4 and all(r["nan_dcm"] == 0 and r["loss_dcm"] > 0 for r in recs if "loss_dcm" in r)
    assert sum("loss_dcm" in r for r in recs) >= 2 and (out / "pytorch_lora_weights.safetensors").exists()


def test_hunyuan15_kill_and_resume_is_bitwise(hy, fd0_run):
    out = hy[2] / "run_resume"
    p = run_trainer(_args(hy, out), check=False, env=kill_after(5))
    assert p.returncode != 0 and "exit_after_step 5: hard exit" in p.stdout, p.stderr[-3000:]
    assert sorted(os.listdir(out / "checkpoints")) == ["step-00000004"]
    p = run_trainer(_args(hy, out, "--resume", "latest"))
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


# ----------------------------------------------------------------------------- the stock pipeline


def _conds(batch, prefix=""):
    """A batch's text as the pipeline's ``prompt_embeds`` / ``prompt_embeds_mask`` / ``..._2`` arguments."""
    return {
        f"{prefix}prompt_embeds": batch[f"{prefix}prompt_embeds"],
        f"{prefix}prompt_embeds_mask": batch[f"{prefix}prompt_embeds_mask"],
        f"{prefix}prompt_embeds_2": batch[f"{prefix}prompt_embeds_2"],
        f"{prefix}prompt_embeds_mask_2": batch[f"{prefix}prompt_embeds_mask_2"],
    }


def _call(pipe, batch, noise, negative=False, steps=2):
    return pipe(
        **_conds(batch),
        **(_conds(batch, "negative_") if negative else {}),
        latents=noise,
        height=64,
        width=64,
        num_frames=5,
        num_inference_steps=steps,
        output_type="latent",
    ).frames


def _record_transformer(pipe):
    """Record the transformer's kwargs and output of every call of the pipeline."""
    calls = []

    def hook(module, args, kwargs, out):
        calls.append((dict(kwargs), out[0].detach().clone()))

    pipe.transformer.register_forward_hook(hook, with_kwargs=True)
    return calls


def test_hunyuan15_lora_loads_in_stock_transformer_as_its_fused_delta(hy, fd0_run):
    """HunyuanVideo15Pipeline has no load_lora_weights (diffusers 0.42): the exported file loads with the stock
    transformer's own ``load_lora_adapter(OUT, prefix="transformer")`` (and so through ``load_rcm_lora``) and changes
    the pipeline's output by the trained delta, equal to fusing it by hand to float32 round-off."""
    from diffusers import ClassifierFreeGuidance

    pipe_dir, data_dir, _ = hy
    batch = LatentDataset(data_dir).get([0, 1])
    noise = torch.randn(2, *SHAPE, generator=torch.Generator().manual_seed(5))

    def sample(pipe):
        pipe.guider = ClassifierFreeGuidance(guidance_scale=1.0)  # conditional only: the bare student
        return _call(pipe, batch, noise)

    base = sample(_stock_pipe(pipe_dir))
    pipe = _stock_pipe(pipe_dir)
    assert not hasattr(pipe, "load_lora_weights")
    pipe.transformer.load_lora_adapter(str(fd0_run), weight_name=WEIGHTS, prefix="transformer")
    lora = sample(pipe)
    fused = _stock_pipe(pipe_dir)  # W += (alpha / r) B A, alpha = r (lora_alpha unset in tiny-hunyuan15-test.yaml)
    sd = load_file(fd0_run / "pytorch_lora_weights.safetensors")
    mods = dict(fused.transformer.named_modules())
    with torch.no_grad():
        for k, A in sd.items():
            if k.endswith(".lora_A.weight"):
                mods[k[len("transformer.") : -len(".lora_A.weight")]].weight += sd[k.replace("lora_A", "lora_B")] @ A
    ref = sample(fused)
    assert (lora - base).abs().max() > 1e-3  # the trained delta shows
    assert (lora - ref).abs().max() <= 1e-5 * max(1.0, float(ref.abs().max()))
    from rcm_diffusers import load_rcm_lora  # the same file through load_rcm_lora: the same samples

    pipe = _stock_pipe(pipe_dir)
    assert load_rcm_lora(pipe, str(fd0_run), scheduler=False) == {"transformer": str(fd0_run / WEIGHTS)}
    assert torch.equal(sample(pipe), lora)
    pipe = _stock_pipe(pipe_dir)
    load_rcm_lora(pipe, str(fd0_run), weight=0.0, scheduler=False)  # strength 0: the base
    assert torch.equal(sample(pipe), base)
    with pytest.raises(ValueError, match="a HunyuanVideo-1.5 state dict"):  # rcm-lora: not taken for a Flux LoRA
        detect_arch(sd)


def test_hunyuan15_velocity_is_the_stock_pipeline_call(hy):
    """models.velocity_fn on data.model_inputs of dataset rows (padded prompts with masks, one without glyph text)
    equals, bit for bit, the transformer call HunyuanVideo15Pipeline makes (zero condition latents and mask
    concatenated, zero image embeddings, timestep sigma * 1000)."""
    from diffusers import ClassifierFreeGuidance

    from rcm_diffusers.models import velocity_fn

    pipe_dir, data_dir, _ = hy
    pipe = _stock_pipe(pipe_dir)
    pipe.guider = ClassifierFreeGuidance(guidance_scale=1.0)
    batch = LatentDataset(data_dir).get([0, 1])
    assert batch["prompt_embeds_mask_2"][1].sum() == 0 and not batch["prompt_embeds_mask"].all()
    noise = torch.randn(2, *SHAPE, generator=torch.Generator().manual_seed(1))
    calls = _record_transformer(pipe)
    _call(pipe, batch, noise)
    kw, out = calls[1]  # the second step: sigma < 1
    x, cond, _ = model_inputs("hunyuan15", {**batch, "latents": noise}, "cpu", torch.float32)
    for k in ("encoder_hidden_states", "encoder_attention_mask", "encoder_hidden_states_2", "encoder_attention_mask_2"):
        assert torch.equal(cond[k], kw[k]), k
    assert torch.equal(x.float(), calls[0][0]["hidden_states"][:, :C]) and not kw["hidden_states"][:, C:].any()
    assert kw["hidden_states"].shape[1] == 2 * C + 1 and not kw["image_embeds"].any()
    r = kw["timestep"][0].double() / 1000  # the pipeline's sigma * 1000: velocity_fn takes the RF time r
    assert 0 < r < 1
    v = velocity_fn(pipe.transformer)(kw["hidden_states"][:, :C], r, **cond)
    assert torch.equal(v, out)


def test_hunyuan15_teacher_cfg_is_the_stock_guider(hy):
    """The trainer's guided teacher (distill.terms.teacher_F, CFG scale 6) equals HunyuanVideo15Pipeline's
    ClassifierFreeGuidance at guidance_scale 6 (its published guider: no rescale) to float32 round-off."""
    from rcm_diffusers.distill.adapters import Networks
    from rcm_diffusers.distill.terms import teacher_F
    from rcm_diffusers.trigflow import r_to_t

    pipe_dir, data_dir, _ = hy
    pipe = _stock_pipe(pipe_dir)
    assert pipe.guider.guidance_scale == 6.0 and pipe.guider.guidance_rescale == 0.0
    batch = LatentDataset(data_dir).get([1, 2])
    noise = torch.randn(2, *SHAPE, generator=torch.Generator().manual_seed(2))
    calls, preds = _record_transformer(pipe), []
    step = pipe.scheduler.step
    pipe.scheduler.step = lambda v, *a, **k: (preds.append(v.clone()), step(v, *a, **k))[1]
    _call(pipe, batch, noise, negative=True)
    assert len(calls) == 4 and len(preds) == 2  # per step: conditional, then negative
    x_r, cond, uncond = model_inputs("hunyuan15", {**batch, "latents": noise}, "cpu", torch.float32)
    assert torch.equal(uncond["encoder_hidden_states"], calls[1][0]["encoder_hidden_states"])
    nets, _ = Networks.build(pipe.transformer, "shared", with_fake=False, lora_rank=4)
    r = calls[0][0]["timestep"][0].double() / 1000
    t = r_to_t(r).expand(2)
    s, c = torch.sin(t).view(2, 1, 1, 1, 1), torch.cos(t).view(2, 1, 1, 1, 1)
    x_t = x_r * (s + c)  # TrigFlow x_t of the pipeline's x_r at time r
    F = teacher_F(nets, x_t, t, cond, uncond, 6.0)
    v = F * (s + c) - (c - s) * x_t  # the guided velocity behind F (docs/math.md §1)
    want = preds[0].double()
    scale = float(want.abs().max())
    assert (v - want).abs().max() <= 2e-6 * scale
    assert (calls[0][1].double() - want).abs().max() > 1e-2 * scale  # the guidance matters here


# central differences of the float64 model carry the float32 round-off of what the model computes in float32 inside
# (the sinusoidal time embedding): the bound of tests/test_jvp_processors.py,
#   max |tangent - difference quotient| <= rtol max |tangent| + 8 u max |output| / h,   u = 2^-24
FD_STEPS = {"x": (1e-3, 1e-4), "t": (1e-4, 5e-3)}
U32 = 2.0**-24


def test_hunyuan15_exact_jvp_matches_central_differences(monkeypatch):
    """fd_type 0's tangent of the student's F through the HunyuanVideo-1.5 transformer (JVP attention with the joint
    text / image masks, one-product linears) in float64: equal to stock forward AD on the math SDPA backend to 1e-10,
    and to central differences in x and in t within their round-off bound. 9 (masked) image tokens instead of the
    pipeline's 729 keep the float64 passes short; they are masked out the same way."""
    monkeypatch.setattr("rcm_diffusers.models.HUNYUAN15_IMAGE_TOKENS", 9)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from rcm_diffusers.attention import enable_jvp_attention
    from rcm_diffusers.attention.function import STATS
    from rcm_diffusers.attention.linear_jvp import enable_linear_jvp
    from rcm_diffusers.distill.adapters import Networks

    tr = tiny_hunyuan15_transformer(dtype=torch.float64).eval()
    nets, _ = Networks.build(tr, "shared", with_fake=False, lora_rank=4)
    with torch.no_grad():  # a student that differs from the teacher
        for p in nets.trainable_parameters("student").values():
            p.normal_(0, 0.05)
    g = torch.Generator().manual_seed(3)
    m1 = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float64)
    m2 = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.float64)
    cond = {
        "encoder_hidden_states": torch.randn(2, 5, TEXT_DIM, generator=g, dtype=torch.float64) * m1[..., None],
        "encoder_attention_mask": m1,
        "encoder_hidden_states_2": torch.randn(2, 3, TEXT_2_DIM, generator=g, dtype=torch.float64) * m2[..., None],
        "encoder_attention_mask_2": m2,
    }
    x = torch.randn(2, C, 2, 2, 2, generator=g, dtype=torch.float64)
    t = torch.tensor([0.4, 1.1], dtype=torch.float64)
    dx, dt = torch.randn(x.shape, generator=g, dtype=torch.float64), torch.tensor([0.3, -0.7], dtype=torch.float64)

    def F(x, t):
        return nets.F("student", x, t, cond)

    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        _, want = torch.func.jvp(F, (x, t), (dx, dt))  # stock attention, the score matrix held
    enable_jvp_attention(tr)
    enable_linear_jvp(tr)
    calls = STATS["fused_calls"]
    with torch.no_grad():
        _, tangent = torch.func.jvp(F, (x, t), (dx, dt))
        assert STATS["fused_calls"] >= calls + 2  # the JVP pass ran our attention in both blocks
        assert (tangent - want).abs().max() <= 1e-10 * want.abs().max()
        scale = F(x, t).abs().max()
        for wrt, tx, tt in (("x", dx, torch.zeros_like(dt)), ("t", torch.zeros_like(dx), dt)):
            h, rtol = FD_STEPS[wrt]
            _, ty = torch.func.jvp(F, (x, t), (tx, tt))
            fd = (F(x + h * tx, t + h * tt) - F(x - h * tx, t - h * tt)) / (2 * h)
            assert ty.abs().max() > 1e-3 * scale  # the tangent is not lost in the round-off term
            assert (ty - fd).abs().max() <= rtol * ty.abs().max() + 8 * U32 * scale / h, wrt


# ----------------------------------------------------------------------------- prepare_data


def test_hunyuan15_prepare_latents_text_synthetic_and_decode(hy):
    """training/prepare_data.py's encoder on a HunyuanVideo15Pipeline: latents ``z * scaling_factor`` (what the
    pipeline divides by before decoding) ``[C, F, h, w]``, the grid decoder inverts it; the pipeline's own
    ``encode_prompt`` (the tiny pipeline has no Qwen2.5-VL / ByT5: stand-ins of its two encoder calls return what they
    return, padded embeddings and a long mask, zeros and a zero mask without glyph text) stored with float masks;
    teacher samples equal HunyuanVideo15Pipeline with the same scheduler and its guider's CFG."""
    from diffusers import ClassifierFreeGuidance

    from rcm_diffusers import TrigFlowEulerScheduler
    from rcm_diffusers.distill.prepare import PipelineEncoder, seed_noise, teacher_samples
    from rcm_diffusers.distill.previews import SampleDecoder

    pipe = _stock_pipe(hy[0])
    assert pipe.vae.config.scaling_factor == 1.5
    enc = PipelineEncoder(pipe, 64, 64, num_frames=5)
    assert enc.family == "hunyuan15" and enc.latent_shape == SHAPE
    g = torch.Generator().manual_seed(4)
    px = torch.rand(1, 3, 5, 64, 64, generator=g) * 2 - 1
    lat = enc.encode_media(px)
    ref = pipe.vae.encode(px).latent_dist.mode() * 1.5
    torch.testing.assert_close(lat, ref, rtol=1e-5, atol=1e-5)
    img = SampleDecoder(pipe.vae, "hunyuan15").decode(lat)
    torch.testing.assert_close(img, (pipe.vae.decode(ref / 1.5).sample / 2 + 0.5).clamp(0, 1))

    table = {"a cat": torch.randn(3, TEXT_DIM, generator=g), 'a "SALE" sign': torch.randn(5, TEXT_DIM, generator=g)}
    glyph = torch.randn(2, TEXT_2_DIM, generator=g)
    seen = {}

    def mllm(tokenizer, text_encoder, prompt, device, tokenizer_max_length, **kw):
        seen["max_length"] = tokenizer_max_length
        pe = torch.stack([torch.cat([table[p], torch.zeros(L - len(table[p]), TEXT_DIM)]) for p in prompt])
        return pe, torch.stack([(torch.arange(L) < len(table[p])).long() for p in prompt])

    def byt5(tokenizer, text_encoder, prompt, device, tokenizer_max_length):
        seen["max_length_2"] = tokenizer_max_length
        has = ['"' in p for p in prompt]
        pe = torch.stack(
            [torch.cat([glyph, torch.zeros(L2 - 2, TEXT_2_DIM)]) if h else torch.zeros(L2, TEXT_2_DIM) for h in has]
        )
        return pe, torch.stack([(torch.arange(L2) < (2 if h else 0)).long() for h in has])

    pipe._get_mllm_prompt_embeds, pipe._get_byt5_prompt_embeds = mllm, byt5
    for name in ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"):  # encode_text checks for them
        object.__setattr__(pipe, name, "stand-in")
    text = enc.encode_text(["a cat", 'a "SALE" sign'])
    assert seen == {"max_length": 1000, "max_length_2": 256}  # the pipeline's own lengths
    assert text["prompt_embeds"].shape == (2, L, TEXT_DIM) and text["prompt_embeds_mask"].dtype == torch.float32
    assert text["prompt_embeds_mask"].tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]]
    assert text["prompt_embeds_mask_2"].tolist() == [[0, 0, 0, 0], [1, 1, 0, 0]]
    assert torch.equal(text["prompt_embeds_2"][1, :2], glyph) and not text["prompt_embeds_2"][0].any()
    neg = enc.encode_text(["a cat"])
    for name in ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"):
        object.__setattr__(pipe, name, None)

    batch = {k: v[1:] for k, v in text.items()}
    batch.update({"negative_" + k: v for k, v in neg.items()})
    got = teacher_samples(
        pipe.transformer, "hunyuan15", batch, seed_noise(SHAPE, [11]), steps=3, shift=5.0, guidance_scale=6.0
    )
    pipe.scheduler = TrigFlowEulerScheduler(shift=5.0, sigma_max=5000.0)
    pipe.guider = ClassifierFreeGuidance(guidance_scale=6.0)
    want = pipe(
        **_conds(batch),
        **_conds(batch, "negative_"),
        height=64,
        width=64,
        num_frames=5,
        num_inference_steps=3,
        generator=torch.Generator().manual_seed(11),
        output_type="latent",
    ).frames
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_hunyuan15_synthetic_defaults_and_guider_checks(hy, tmp_path, capsys):
    """prepare_data's defaults for HunyuanVideo-1.5 are its pipeline's: the scheduler's shift 5 and the guider's
    scale 6. A guider the trainer's plain CFG cannot reproduce (guidance_rescale, a start/stop window, another
    guider class) is refused in one line by the trainer before any model loads, and by prepare_data."""
    import shutil

    from diffusers import ClassifierFreeGuidance

    from rcm_diffusers.distill import inputs
    from rcm_diffusers.distill.config import RCMConfig
    from rcm_diffusers.distill.prepare import PipelineEncoder, synthetic_defaults

    pipe = _stock_pipe(hy[0])
    enc = PipelineEncoder(pipe, 64, 64, num_frames=5)
    assert synthetic_defaults(enc, steps=100) == {"shift": 5.0, "guidance_scale": 6.0}
    pipe.guider = ClassifierFreeGuidance(guidance_scale=6.0, guidance_rescale=0.7)
    with pytest.raises(ValueError, match="ClassifierFreeGuidance has guidance_rescale=0.7"):
        synthetic_defaults(enc, steps=100)

    cfg = dict(data_dir=hy[1], output_dir=str(tmp_path / "run"))
    inputs.check_inputs(RCMConfig(pretrained=hy[0], **cfg))  # the stock guider passes
    capsys.readouterr()
    for change, said in (
        ({"guidance_rescale": 0.7}, "guidance_rescale=0.7"),
        ({"stop": 0.5}, "stop=0.5"),
        ({"_class_name": "AdaptiveProjectedGuidance"}, "guider is AdaptiveProjectedGuidance"),
    ):
        teacher = tmp_path / f"teacher_{said.split('=')[0].split()[-1]}"
        shutil.copytree(hy[0], teacher)
        path = teacher / "guider" / "guider_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
        with pytest.raises(SystemExit) as e:
            inputs.check_inputs(RCMConfig(pretrained=str(teacher), **cfg))
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and said in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()
