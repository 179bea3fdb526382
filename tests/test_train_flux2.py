"""FLUX.2 [dev] (Flux2Pipeline) as a teacher of the rCM trainer, on a tiny random model (CPU): the family by exact
class, sCM (exact JVP, fd_type 0) + DMD and dCM runs through training/rcm.py, kill / resume bit for bit, the exported
LoRA in a stock Flux2Pipeline, and the model call and guidance embedding against the stock pipeline's own."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import (
    REPO,
    kill_after,
    make_flux2_dataset,
    make_tiny_flux2,
    run_trainer,
    tiny_flux2_transformer,
    tiny_flux2_vae,
)

from rcm_diffusers.distill.alternation import plan_step
from rcm_diffusers.distill.data import LatentDataset, model_inputs
from rcm_diffusers.lora.keys import detect_arch

CONFIG = os.path.join(REPO, "training", "configs", "tiny-flux2-test.yaml")
STEPS, WARMUP, FREQ = 8, 2, 2  # tiny-flux2-test.yaml


@pytest.fixture(scope="module")
def flux2(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux2")
    return make_tiny_flux2(str(root / "pipe")), make_flux2_dataset(str(root / "data")), root


def _args(flux2, out, *extra):
    return ["--config", CONFIG, "--pretrained", flux2[0], "--data_dir", flux2[1], "--output_dir", str(out), *extra]


@pytest.fixture(scope="module")
def fd0_run(flux2):
    """sCM with the exact JVP (fd_type 0, through rcm_diffusers.attention) + DMD, 8 iterations."""
    out = flux2[2] / "run_fd0"
    run_trainer(_args(flux2, out))
    return out


def _stock_pipe(pipe_dir):
    from diffusers import Flux2Pipeline

    return Flux2Pipeline.from_pretrained(pipe_dir, text_encoder=None, tokenizer=None)


# ----------------------------------------------------------------------------- family


def _fake_teacher(root, pipeline):
    (root / "transformer").mkdir(parents=True)
    index = {"_class_name": pipeline, "transformer": ["diffusers", "Flux2Transformer2DModel"]}
    (root / "model_index.json").write_text(json.dumps(index))
    (root / "transformer" / "config.json").write_text(json.dumps({"_class_name": "Flux2Transformer2DModel"}))
    (root / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"not a model")
    return root


def test_flux2_family_by_exact_class(flux2, tmp_path, capsys):
    """Flux2Pipeline is the family; the FLUX.2 [klein] pipelines (same transformer class, another text encoder, true
    CFG, no guidance embedding) are refused in one line naming the supported teachers, before the teacher loads
    (training/rcm.py on such a folder: tests/test_families.py); QAD refuses FLUX.2."""
    from rcm_diffusers.distill import inputs
    from rcm_diffusers.distill.config import QADConfig, RCMConfig
    from rcm_diffusers.distill.families import UnsupportedTeacher, supported, teacher_family

    with open(os.path.join(flux2[0], "model_index.json")) as f:
        assert teacher_family(json.load(f)).name == "flux2"
    for pipeline in ("Flux2KleinPipeline", "Flux2KleinKVPipeline", "Flux2KleinInpaintPipeline"):
        index = {"_class_name": pipeline, "transformer": ["diffusers", "Flux2Transformer2DModel"]}
        with pytest.raises(UnsupportedTeacher, match=f"a {pipeline} with Flux2Transformer2DModel is not"):
            teacher_family(index)
    with pytest.raises(SystemExit) as e:
        inputs.check_inputs(QADConfig(pretrained=flux2[0], data_dir=flux2[1], output_dir=str(tmp_path / "qad")))
    assert e.value.code == 2 and "QAD (training/qad.py) supports Wan and FLUX.1 teachers" in capsys.readouterr().err
    teacher = _fake_teacher(tmp_path / "teacher", "Flux2KleinPipeline")
    cfg = RCMConfig(pretrained=str(teacher), data_dir=flux2[1], output_dir=str(tmp_path / "run"))
    with pytest.raises(SystemExit) as e:
        inputs.check_inputs(cfg)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert "a Flux2KleinPipeline with Flux2Transformer2DModel is not a supported teacher" in err
    assert err.strip().endswith(supported()) and "Flux2Pipeline (Flux2Transformer2DModel)" in err
    assert not (tmp_path / "run").exists()


def test_flux2_default_lora_targets_cover_both_block_kinds():
    """The family's LoRA targets: every attention and MLP Linear of the double and single blocks, nothing else (the
    double blocks' ``to_out`` ModuleList is not taken for a Linear)."""
    from rcm_diffusers.distill.adapters import default_lora_targets

    m = tiny_flux2_transformer()
    t = default_lora_targets(m)
    lin = [n for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)]
    hit = [n for n in lin if any(n == x or n.endswith("." + x) for x in t)]
    assert hit == [n for n in lin if "transformer_blocks." in n]


# ----------------------------------------------------------------------------- training runs


def test_flux2_scm_fd0_dmd_trains(fd0_run):
    recs = [json.loads(line) for line in open(fd0_run / "metrics.jsonl")]
    want = [plan_step(i, WARMUP, FREQ, 2) for i in range(STEPS)]
    assert [r["net"] for r in recs] == ["student" if p.student else "fake" for p in want]
    student = [r for r in recs if r["net"] == "student"]
    assert all(r["nan_scm"] == 0 and 0 < r["loss_scm"] <= 1 for r in student)
    assert any("loss_dmd" in r and r["nan_dmd"] == 0 for r in student)
    sd = load_file(fd0_run / "pytorch_lora_weights.safetensors")
    for t in (
        "transformer_blocks.0.attn.to_q",
        "transformer_blocks.0.attn.to_out.0",
        "transformer_blocks.0.attn.add_k_proj",
        "transformer_blocks.0.ff.linear_in",
        "transformer_blocks.0.ff_context.linear_out",
        "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
        "single_transformer_blocks.0.attn.to_out",
    ):
        assert f"transformer.{t}.lora_B.weight" in sd, t
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in sd.items())


def test_flux2_dcm_trains(flux2):
    out = flux2[2] / "run_dcm"
    run_trainer(_args(flux2, out, "--cm_type", "dcm", "--max_steps", "4", "--checkpoint_every", "0"))
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(recs) == 4 and all(r["nan_dcm"] == 0 and r["loss_dcm"] > 0 for r in recs if "loss_dcm" in r)
    assert sum("loss_dcm" in r for r in recs) >= 2 and (out / "pytorch_lora_weights.safetensors").exists()


def test_flux2_kill_and_resume_is_bitwise(flux2, fd0_run):
    out = flux2[2] / "run_resume"
    p = run_trainer(_args(flux2, out), check=False, env=kill_after(5))
    assert p.returncode != 0 and "exit_after_step 5: hard exit" in p.stdout, p.stderr[-3000:]
    assert sorted(os.listdir(out / "checkpoints")) == ["step-00000004"]
    p = run_trainer(_args(flux2, out, "--resume", "latest"))
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
    pe = LatentDataset(data_dir).get([0, 1])["prompt_embeds"]
    return pipe(
        prompt_embeds=pe,
        height=8,
        width=8,
        num_inference_steps=2,
        guidance_scale=4.0,
        generator=torch.Generator().manual_seed(0),
        output_type="latent",
    ).images


def test_flux2_lora_loads_in_stock_pipeline_as_its_fused_delta(flux2, fd0_run):
    pipe_dir, data_dir, _ = flux2
    base = _sample(_stock_pipe(pipe_dir), data_dir)
    pipe = _stock_pipe(pipe_dir)
    pipe.load_lora_weights(str(fd0_run))
    lora = _sample(pipe, data_dir)
    # the same delta fused by hand: W += (alpha / r) B A, alpha = r (lora_alpha unset in tiny-flux2-test.yaml)
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
    with pytest.raises(ValueError, match="a FLUX.2 state dict"):  # rcm-lora: not taken for a FLUX.1 LoRA
        detect_arch(sd)


# ----------------------------------------------------------------------------- parity with the stock pipeline


def _record_transformer(pipe):
    calls = []

    def hook(module, args, kwargs, out):
        calls.append((dict(kwargs), out[0].detach().clone()))

    pipe.transformer.register_forward_hook(hook, with_kwargs=True)
    return calls


def test_flux2_velocity_and_guidance_are_the_stock_pipeline_call(flux2):
    """models.velocity_fn on data.model_inputs (flux_guidance 4) equals, bit for bit, the transformer call
    Flux2Pipeline makes at guidance_scale 4 (tokens, (t, h, w, l) ids, timestep / 1000, guidance embedding); the
    trainer's teacher (distill.terms.teacher_F, no CFG) is that velocity to float64 round-off of the TrigFlow map,
    and another guidance value moves it."""
    from rcm_diffusers.distill.adapters import Networks
    from rcm_diffusers.distill.terms import teacher_F
    from rcm_diffusers.models import velocity_fn
    from rcm_diffusers.trigflow import r_to_t

    pipe_dir, data_dir, _ = flux2
    pipe = _stock_pipe(pipe_dir)
    batch = LatentDataset(data_dir).get([0, 2])
    noise = torch.randn(2, 16, 4, 4, generator=torch.Generator().manual_seed(1))
    calls = _record_transformer(pipe)
    pipe(
        prompt_embeds=batch["prompt_embeds"],
        latents=noise,
        height=8,
        width=8,
        num_inference_steps=2,
        guidance_scale=4.0,
        output_type="latent",
    )
    kw, out = calls[0]
    x, cond, uncond = model_inputs("flux2", {**batch, "latents": noise}, "cpu", torch.float32, 4.0)
    assert uncond is None and set(cond) == {"encoder_hidden_states", "txt_ids", "img_ids", "guidance"}
    for k in cond:
        assert torch.equal(cond[k], kw[k]), k
    assert torch.equal(x.float(), kw["hidden_states"])
    r = kw["timestep"][0].double()  # the pipeline's timestep / 1000: velocity_fn takes the RF time r itself
    assert torch.equal(velocity_fn(pipe.transformer)(x.float(), r, **cond), out)

    nets, _ = Networks.build(pipe.transformer, "shared", with_fake=False, lora_rank=4)
    t = r_to_t(r).expand(2)
    s, c = torch.sin(t)[:, None, None], torch.cos(t)[:, None, None]
    x_t = x * (s + c)
    F = teacher_F(nets, x_t, t, cond, None, 1.0)
    v = F * (s + c) - (c - s) * x_t
    assert (v - out.double()).abs().max() <= 1e-6 * out.abs().max()
    other = teacher_F(nets, x_t, t, {**cond, "guidance": cond["guidance"] * 0 + 1.0}, None, 1.0)
    assert (other - F).abs().max() > 1e-3 * F.abs().max()  # the guidance embedding is live


# central differences of the float64 model carry the float32 round-off of what FLUX.2 computes in float32 inside
# (RoPE tables, the sinusoidal time and guidance embeddings) divided by the step: the bound of
# tests/test_jvp_processors.py,  max |tangent - difference quotient| <= rtol max |tangent| + 8 u max |output| / h
FD_STEPS = {"x": (1e-3, 1e-4), "t": (1e-4, 5e-3)}
U32 = 2.0**-24


def test_flux2_exact_jvp_matches_forward_ad_and_central_differences():
    """fd_type 0's tangent of the student's F through the FLUX.2 transformer (JVP attention, one-product linears) in
    float64: equal to stock forward AD on the math SDPA backend to 1e-10, and to central differences in x and in t
    within their round-off bound."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from rcm_diffusers.attention import enable_jvp_attention
    from rcm_diffusers.attention.function import STATS
    from rcm_diffusers.attention.linear_jvp import enable_linear_jvp
    from rcm_diffusers.distill.adapters import Networks
    from rcm_diffusers.distill.data import flux2_ids

    tr = tiny_flux2_transformer(dtype=torch.float64).eval()
    nets, _ = Networks.build(tr, "shared", with_fake=False, lora_rank=4)
    with torch.no_grad():  # a student that differs from the teacher
        for p in nets.trainable_parameters("student").values():
            p.normal_(0, 0.05)
    g = torch.Generator().manual_seed(3)
    img_ids, txt_ids = flux2_ids(2, 2, 3, 5)
    cond = {
        "encoder_hidden_states": torch.randn(2, 5, 16, generator=g, dtype=torch.float64),
        "txt_ids": txt_ids,
        "img_ids": img_ids,
        "guidance": torch.full((2,), 4.0),
    }
    x = torch.randn(2, 6, 16, generator=g, dtype=torch.float64)
    t = torch.tensor([0.4, 1.1], dtype=torch.float64)
    dx, dt = torch.randn(2, 6, 16, generator=g, dtype=torch.float64), torch.tensor([0.3, -0.7], dtype=torch.float64)

    def F(x, t):
        return nets.F("student", x, t, cond)

    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        _, want = torch.func.jvp(F, (x, t), (dx, dt))
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
            assert ty.abs().max() > 1e-3 * scale
            assert (ty - fd).abs().max() <= rtol * ty.abs().max() + 8 * U32 * scale / h, wrt


# ----------------------------------------------------------------------------- prepare_data


def test_flux2_prepare_latents_text_synthetic_and_decode(flux2):
    """training/prepare_data.py's encoder on a Flux2Pipeline: latents = Flux2Pipeline._encode_vae_image's (VAE mode,
    patchified 2 x 2, batch-norm stats), stored ``[4C, h, w]``; the grid decoder inverts it on tokens as the
    pipeline decodes; ``encode_prompt``'s output as it is (a stand-in for the Mistral encoder returns what
    encode_prompt returns); teacher samples with the guidance embedding equal Flux2Pipeline with the same
    scheduler."""
    from rcm_diffusers import TrigFlowEulerScheduler
    from rcm_diffusers.distill.data import pack_latents
    from rcm_diffusers.distill.prepare import PipelineEncoder, seed_noise, teacher_samples
    from rcm_diffusers.distill.previews import SampleDecoder

    pipe = _stock_pipe(flux2[0])
    pipe.vae = tiny_flux2_vae(seed=1)
    enc = PipelineEncoder(pipe, 8, 8, max_sequence_length=4)
    assert enc.family == "flux2" and enc.latent_shape == (16, 4, 4)
    g = torch.Generator().manual_seed(4)
    px = torch.rand(2, 3, 1, 8, 8, generator=g) * 2 - 1
    lat = enc.encode_media(px)
    ref = pipe._encode_vae_image(px[:, :, 0], generator=None)
    torch.testing.assert_close(lat, ref, rtol=1e-6, atol=1e-6)
    assert (lat - pipe._patchify_latents(pipe.vae.encode(px[:, :, 0]).latent_dist.mode())).abs().max() > 0.1
    img = SampleDecoder(pipe.vae, "flux2").decode(pack_latents("flux2", lat), (4, 4))
    want_img = pipe.vae.decode(
        pipe._unpatchify_latents(
            lat * torch.sqrt(pipe.vae.bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
            + pipe.vae.bn.running_mean.view(1, -1, 1, 1)
        )
    ).sample
    torch.testing.assert_close(img[:, :, 0], (want_img / 2 + 0.5).clamp(0, 1), rtol=1e-5, atol=1e-5)

    table = {"a cat": torch.randn(4, 16, generator=g), "a dog": torch.randn(4, 16, generator=g)}

    def encode_prompt(prompt, device=None, max_sequence_length=512, **kw):
        pe = torch.stack([table[p] for p in prompt])
        return pe, pipe._prepare_text_ids(pe)

    pipe.encode_prompt = encode_prompt
    for name in ("text_encoder", "tokenizer"):
        object.__setattr__(pipe, name, "stand-in")
    text = enc.encode_text(["a cat", "a dog"])
    assert set(text) == {"prompt_embeds"} and torch.equal(text["prompt_embeds"][1], table["a dog"])
    for name in ("text_encoder", "tokenizer"):
        object.__setattr__(pipe, name, None)
    del pipe.encode_prompt

    batch = {"prompt_embeds": text["prompt_embeds"][1:]}
    got = teacher_samples(
        pipe.transformer, "flux2", batch, seed_noise((16, 4, 4), [11]), steps=4, shift=3.0, flux_guidance=4.0
    )
    pipe.scheduler = TrigFlowEulerScheduler(shift=3.0, sigma_max=5000.0)
    want = pipe(
        prompt_embeds=table["a dog"][None],
        guidance_scale=4.0,
        height=8,
        width=8,
        num_inference_steps=4,
        generator=torch.Generator().manual_seed(11),
        output_type="latent",
    ).images
    torch.testing.assert_close(pack_latents("flux2", got), want, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- cost and memory models


def test_flux2_cost_model_counts_the_products_of_a_forward_and_backward():
    """distill.cost's FLUX.2 graph (SwiGLU feed-forwards, fused single-block projections, shared modulations, no
    pooled text) equals the matrix products torch counts in a forward (teacher, student) and the student's backward,
    on the real FLUX.2 [dev] config cut to 1 + 1 blocks of 2 heads; the memory model builds its setup."""
    from test_cost import _counted, _model
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from rcm_diffusers.arch import build_transformer
    from rcm_diffusers.distill import cost
    from rcm_diffusers.distill.adapters import Networks
    from rcm_diffusers.distill.memory import TrainSetup, predict_training

    over = dict(num_layers=1, num_single_layers=1, num_attention_heads=2)
    m = build_transformer("flux.2-dev", **over)
    nets, _ = Networks.build(m, "shared", with_fake=False, lora_rank=4)
    g = torch.Generator().manual_seed(0)
    batch = {"latents": torch.randn(1, 128, 4, 4, generator=g), "prompt_embeds": torch.randn(1, 8, 15360, generator=g)}
    x0, cond, _ = model_inputs("flux2", batch, "cpu", torch.float32, 4.0)
    arch = cost.Arch.from_arch("flux.2-dev", **over)
    pf = cost.pass_flops(arch, x0.shape[1], 8, lora_rank=4, attention_backward=2.0)
    t = torch.tensor([0.7], dtype=torch.float64)
    # totals: torch counts a Linear as a batched product (bmm) when its input is a non-contiguous 3-D view (the
    # token-flattened latents, as Flux2Pipeline._pack_latents makes them; attention outputs split off the joint stream)
    for role in ("teacher", "student"):
        with torch.no_grad():
            assert sum(_counted(lambda: nets.F(role, x0, t, cond))) == sum(_model(pf, role, "forward")), role
    with sdpa_kernel(SDPBackend.MATH):
        out = nets.F("student", x0, t, cond)
    assert sum(_counted(lambda: out.double().square().sum().backward())) == sum(_model(pf, "student", "backward"))
    s = TrainSetup.from_arch("flux.2-dev", tokens=64 * 64, text_tokens=512, lora_rank=64)
    assert s.params == 32_223_281_152 and s.num_single_layers == 48 and predict_training(s)["total"] > s.params * 2


def test_flux2_data_checked_against_the_teacher(flux2, tmp_path):
    """Before any model loads: FLUX.2 data needs a FLUX.2 teacher (and FLUX.1 data is refused for one), and its
    latents the transformer's in_channels (the patchified channels) and its text the joint_attention_dim."""
    from rcm_diffusers.distill.data import DataError, check_dataset, write_latent_dataset

    with open(os.path.join(flux2[0], "transformer", "config.json")) as f:
        conf = json.load(f)
    assert check_dataset(flux2[1], conf)["family"] == "flux2"
    with pytest.raises(DataError, match="the data is family 'flux2' but the teacher is a FluxTransformer2DModel"):
        check_dataset(flux2[1], {**conf, "_class_name": "FluxTransformer2DModel"})
    with pytest.raises(DataError, match="latents have 16 channels, the teacher's transformer takes 64"):
        check_dataset(flux2[1], {**conf, "in_channels": 64})
    with pytest.raises(DataError, match="prompt_embeds are 16 wide, the teacher's transformer takes 32"):
        check_dataset(flux2[1], {**conf, "joint_attention_dim": 32})
    g = torch.Generator().manual_seed(0)
    flux1 = write_latent_dataset(
        str(tmp_path / "flux1"),
        {"latents": torch.randn(2, 4, 4, 4, generator=g)},
        family="flux",
        tables={"prompt_embeds": torch.randn(1, 4, 16, generator=g), "pooled_prompt_embeds": torch.randn(1, 8)},
        table_index={"prompt_embeds": None, "pooled_prompt_embeds": None},
    )
    with pytest.raises(DataError, match="the data is family 'flux' but the teacher is a Flux2Transformer2DModel"):
        check_dataset(flux1, conf)
