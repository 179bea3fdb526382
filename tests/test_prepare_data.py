"""training/prepare_data.py on a tiny Wan pipeline with a real (tiny, offline) UMT5 text encoder and tokenizer:
real images/videos, errors, synthetic teacher samples vs the diffusers pipeline, I2V conditions, sample grids."""

import os
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from train_helpers import REPO, TEXT_DIM, tiny_wan_transformer

from rcm_diffusers.distill.data import LatentDataset

sys.path.insert(0, os.path.join(REPO, "training"))
import prepare_data  # noqa: E402

WORDS = "a red cat blue dog green tree on the grass sky".split()
MEAN, STD = [0.1, -0.2, 0.3, 0.0], [0.5, 2.0, 1.0, 1.5]
L = 6  # max_sequence_length


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def _vae():
    from diffusers import AutoencoderKLWan

    torch.manual_seed(1)
    return AutoencoderKLWan(
        base_dim=3,
        z_dim=4,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=MEAN,
        latents_std=STD,
    ).eval()


def _smooth(seed, n=1, size=32):
    """Low-frequency random RGB frames (uint8) so the VAE sees image-like input."""
    g = np.random.default_rng(seed)
    small = g.uniform(0, 255, (n, 4, 4, 3))
    return [np.asarray(Image.fromarray(f.astype(np.uint8)).resize((size, size), Image.BILINEAR)) for f in small]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    root = tmp_path_factory.mktemp("prep")
    torch.manual_seed(0)
    te = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(WORDS) + 3,
            d_model=TEXT_DIM,
            d_kv=8,
            d_ff=32,
            num_layers=1,
            num_heads=2,
            relative_attention_num_buckets=8,
        )
    ).eval()
    WanPipeline(
        tokenizer=_tokenizer(),
        text_encoder=te,
        vae=_vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=tiny_wan_transformer(),
    ).save_pretrained(str(root / "pipe"))
    imgs = root / "imgs"
    imgs.mkdir()
    for k, cap in enumerate(["a red cat", "blue dog on the grass", "a red cat"]):
        Image.fromarray(_smooth(k)[0]).save(imgs / f"im{k}.png")
        (imgs / f"im{k}.txt").write_text(cap + "\n")
    vids = root / "vids"
    vids.mkdir()
    for k in range(2):
        frames = [Image.fromarray(f) for f in _smooth(10 + k, n=6)]
        frames[0].save(vids / f"v{k}.gif", save_all=True, append_images=frames[1:], duration=100, loop=0)
    (vids / "m.jsonl").write_text('{"file": "v0.gif", "caption": "green tree"}\n{"video": "v1.gif", "text": "sky"}\n')
    pipe = WanPipeline.from_pretrained(str(root / "pipe"))
    return root, pipe


def _prepare(env, *args):
    root = env[0]
    prepare_data.main(
        [
            "--pretrained",
            str(root / "pipe"),
            "--height",
            "32",
            "--width",
            "32",
            "--max_sequence_length",
            str(L),
            "--no_progress",
            "--device",
            "cpu",
            *args,
        ]
    )


def _pixels(path, n):
    """Frames of ``path`` read by Pillow, ``[1, 3, n, 32, 32]`` in [-1, 1], written independently of rcm_diffusers."""
    im = Image.open(path)
    fr = []
    for k in range(n):
        im.seek(k)
        fr.append(np.asarray(im.convert("RGB"), dtype=np.float32))
    return torch.from_numpy(np.stack(fr)).permute(3, 0, 1, 2)[None] / 127.5 - 1


def _direct_latents(pipe, px):
    z = pipe.vae.encode(px).latent_dist.mode()
    return (z - torch.tensor(MEAN).view(1, 4, 1, 1, 1)) / torch.tensor(STD).view(1, 4, 1, 1, 1)


def _direct_text(pipe, caption):
    """T5 hidden states of the real tokens, zero-padded to L (as Wan trims and pads)."""
    t = pipe.tokenizer([caption], padding="max_length", max_length=L, truncation=True, return_tensors="pt")
    h = pipe.text_encoder(t.input_ids, t.attention_mask).last_hidden_state[0]
    n = int(t.attention_mask.sum())
    return torch.cat([h[:n], torch.zeros(L - n, TEXT_DIM)])


@pytest.fixture(scope="module")
def ds_img(env):
    out = env[0] / "ds_img"
    _prepare(env, "--source", str(env[0] / "imgs"), "--output_dir", str(out), "--shard_size", "2")
    return out


@pytest.fixture(scope="module")
def ds_vid(env):
    out = env[0] / "ds_vid"
    _prepare(
        env,
        "--source",
        str(env[0] / "vids" / "m.jsonl"),
        "--output_dir",
        str(out),
        "--num_frames",
        "5",
        "--negative_prompt",
        "grass",
    )
    return out


@torch.no_grad()
def test_images_folder_roundtrip(env, ds_img):
    root, pipe = env
    out = ds_img
    ds = LatentDataset(str(out))
    assert ds.family == "wan" and len(ds) == 3 and [s["num_samples"] for s in ds.meta["shards"]] == [2, 1]
    b = ds.get([0, 1, 2])
    assert b["latents"].shape == (3, 4, 1, 4, 4) and "prompt_index" not in b  # mostly unique captions: per sample
    for k in range(3):
        ref = _direct_latents(pipe, _pixels(root / "imgs" / f"im{k}.png", 1))[0]
        torch.testing.assert_close(b["latents"][k], ref, rtol=1e-5, atol=1e-5)
    for k, cap in enumerate(["a red cat", "blue dog on the grass", "a red cat"]):
        torch.testing.assert_close(b["prompt_embeds"][k], _direct_text(pipe, cap), rtol=1e-5, atol=1e-6)
    assert b["prompt_embeds"][0, :3].abs().min() > 0 and b["prompt_embeds"][1].abs().sum(-1).gt(0).sum() == 5
    # negative prompt "" -> no tokens -> all-zero rows, broadcast from one table row
    assert b["negative_prompt_embeds"].shape == (3, L, TEXT_DIM) and b["negative_prompt_embeds"].abs().max() == 0
    # the latents decode to what the VAE makes of the inputs (denormalised with the pipeline's formula)
    x = b["latents"][:1] / (1.0 / torch.tensor(STD).view(1, 4, 1, 1, 1)) + torch.tensor(MEAN).view(1, 4, 1, 1, 1)
    rec = pipe.vae.decode(x).sample
    ref = pipe.vae.decode(pipe.vae.encode(_pixels(root / "imgs" / "im0.png", 1)).latent_dist.mode()).sample
    torch.testing.assert_close(rec, ref, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_video_manifest_roundtrip(env, ds_vid):
    root, pipe = env
    out = ds_vid
    ds = LatentDataset(str(out))
    b = ds.get([0, 1])
    assert b["latents"].shape == (2, 4, 2, 4, 4)  # (5 - 1) / 4 + 1 latent frames
    for k in range(2):
        torch.testing.assert_close(
            b["latents"][k], _direct_latents(pipe, _pixels(root / "vids" / f"v{k}.gif", 5))[0], rtol=1e-5, atol=1e-5
        )
    torch.testing.assert_close(b["negative_prompt_embeds"][1], _direct_text(pipe, "grass"), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b["prompt_embeds"][1], _direct_text(pipe, "sky"), rtol=1e-5, atol=1e-6)


def test_clear_errors(env, tmp_path):
    root, _ = env
    bad = tmp_path / "bad"
    bad.mkdir()
    Image.fromarray(_smooth(0, size=40)[0]).save(bad / "x.png")
    with pytest.raises(FileNotFoundError, match="without a .txt caption"):
        _prepare(env, "--source", str(bad), "--output_dir", str(tmp_path / "o"))
    (bad / "x.txt").write_text("a cat")
    with pytest.raises(ValueError, match=r"40x40 \(WxH\), expected 32x32"):
        _prepare(env, "--source", str(bad), "--output_dir", str(tmp_path / "o"))
    _prepare(env, "--source", str(bad), "--output_dir", str(tmp_path / "o"), "--resize", "crop")
    assert LatentDataset(str(tmp_path / "o")).get([0])["latents"].shape == (1, 4, 1, 4, 4)
    (bad / "y.png").write_bytes(b"not a png")
    (bad / "y.txt").write_text("dog")
    with pytest.raises(ValueError, match="cannot read .*y.png"):
        _prepare(env, "--source", str(bad), "--output_dir", str(tmp_path / "o2"), "--resize", "crop")
    with pytest.raises(ValueError, match="4 k \\+ 1"):
        _prepare(
            env, "--source", str(root / "vids" / "m.jsonl"), "--output_dir", str(tmp_path / "o3"), "--num_frames", "4"
        )
    with pytest.raises(ValueError, match="has 6 frame\\(s\\), --num_frames asks for 9"):
        _prepare(
            env, "--source", str(root / "vids" / "m.jsonl"), "--output_dir", str(tmp_path / "o3"), "--num_frames", "9"
        )
    (tmp_path / "m.csv").write_text("file,caption\nmissing.png,a cat\n")
    with pytest.raises(FileNotFoundError, match="missing.png does not exist"):
        _prepare(env, "--source", str(tmp_path / "m.csv"), "--output_dir", str(tmp_path / "o4"))
    assert (
        not (tmp_path / "o2" / "meta.json").exists() and not (tmp_path / "o3" / "meta.json").exists()
    )  # no half dataset


def test_help_explains_options(capsys):
    with pytest.raises(SystemExit):
        prepare_data.main(["--help"])
    h = capsys.readouterr().out
    for opt in (
        "--source",
        "--synthetic",
        "--num_samples",
        "--resize",
        "--negative_prompt",
        "--guidance_scale",
        "--solver",
    ):
        assert opt in h


@pytest.mark.parametrize("solver", ["euler", "unipc"])
@torch.no_grad()
def test_synthetic_equals_pipeline_with_teacher_scheduler(env, solver):
    """Sample i == WanPipeline(prompt_i, TrigFlow scheduler, CFG s, generator seed+i, output_type='latent'), and its
    stored ``noise`` is the pipeline's starting noise for that seed."""
    from rcm_diffusers import TrigFlowEulerScheduler, TrigFlowUniPCScheduler

    root, pipe = env
    prompts = ["a red cat", "green tree on the grass"]
    (root / f"p_{solver}.txt").write_text("\n".join(prompts) + "\n")
    out = root / f"ds_syn_{solver}"
    n = 4 if solver == "euler" else 1  # euler: 4 samples of 2 prompts -> a prompt table
    _prepare(
        env,
        "--synthetic",
        "--prompts",
        str(root / f"p_{solver}.txt"),
        "--num_samples",
        str(n),
        "--steps",
        "6",
        "--shift",
        "3",
        "--guidance_scale",
        "3",
        "--seed",
        "7",
        "--solver",
        solver,
        "--output_dir",
        str(out),
        "--batch_size",
        "2",
    )
    b = LatentDataset(str(out)).get(list(range(n)))
    assert LatentDataset(str(out)).meta["source"] == "synthetic"
    if n == 4:
        assert b["prompt_index"].tolist() == [0, 1, 0, 1] and LatentDataset(str(out)).tables["prompt_embeds"].shape == (
            2,
            L,
            TEXT_DIM,
        )
    cls = TrigFlowEulerScheduler if solver == "euler" else TrigFlowUniPCScheduler
    pipe.scheduler = cls(shift=3.0, sigma_max=5000.0)
    for i in range(n):
        ref = pipe(
            prompt=prompts[i % 2],
            negative_prompt="",
            height=32,
            width=32,
            num_frames=1,
            num_inference_steps=6,
            guidance_scale=3.0,
            generator=torch.Generator().manual_seed(7 + i),
            output_type="latent",
            max_sequence_length=L,
        ).frames[0]
        torch.testing.assert_close(b["latents"][i], ref, rtol=1e-4, atol=1e-5)
        noise = torch.randn((4, 1, 4, 4), generator=torch.Generator().manual_seed(7 + i))
        assert (b["latents"][i] - noise).abs().max() > 0.1  # the teacher moved it
        assert torch.equal(b["noise"][i], noise)  # stored beside it: the dataset is also ODE pairs


@torch.no_grad()
def test_i2v_condition_matches_pipeline():
    from tiny import tiny_wan_i2v_pipeline

    from rcm_diffusers.distill.prepare import PipelineEncoder

    pipe = tiny_wan_i2v_pipeline()
    enc = PipelineEncoder(pipe, 32, 32, num_frames=5)
    assert enc.family == "wan_i2v" and enc.latent_shape == (4, 2, 4, 4)
    img = Image.fromarray(_smooth(3)[0])
    px = pipe.video_processor.preprocess(img, height=32, width=32)
    got = enc.encode_condition(px)
    _, ref = pipe.prepare_latents(
        px, 1, 4, 32, 32, 5, torch.float32, torch.device("cpu"), torch.Generator().manual_seed(0)
    )
    assert got["condition"].shape == (1, 8, 2, 4, 4)
    torch.testing.assert_close(got["condition"], ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["image_embeds"], pipe.encode_image(img, device="cpu"), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_sample_grid_png_and_gif(env, ds_img, ds_vid, tmp_path):
    from safetensors.torch import load_file

    from rcm_diffusers.distill.adapters import Networks
    from rcm_diffusers.distill.config import RCMConfig
    from rcm_diffusers.distill.previews import SampleDecoder, write_samples

    root, pipe = env
    tr = tiny_wan_transformer()
    nets, _ = Networks.build(tr, "shared", with_fake=False, lora_rank=4)
    cfg = RCMConfig(output_dir=str(tmp_path), sample_steps=[1, 2, 4], seed=0, sigma_max=80.0)
    dec = SampleDecoder.from_pretrained(str(root / "pipe"), "wan")
    path = write_samples(nets, LatentDataset(str(ds_img)), cfg, 5, torch.device("cpu"), tr, n=4, decoder=dec)
    png = Image.open(path.replace(".safetensors", ".png"))
    assert png.size == (3 * 32, 3 * 32)  # 3 conditions x 3 step counts, 32x32 pixels each
    lat = load_file(path)
    grid = np.asarray(png)
    for r, k in enumerate(
        [1, 2, 4]
    ):  # row r = k steps; cell = VAE decode of the saved latents, independently denormalised
        z = lat[f"steps_{k}"] * torch.tensor(STD).view(1, 4, 1, 1, 1) + torch.tensor(MEAN).view(1, 4, 1, 1, 1)
        px = (
            ((pipe.vae.decode(z).sample[:, :, 0] / 2 + 0.5).clamp(0, 1) * 255)
            .round()
            .byte()
            .permute(0, 2, 3, 1)
            .numpy()
        )
        for c in range(3):
            cell = grid[32 * r : 32 * (r + 1), 32 * c : 32 * (c + 1)].astype(int)
            assert np.abs(cell - px[c].astype(int)).max() <= 1
    vid = write_samples(nets, LatentDataset(str(ds_vid)), cfg, 6, torch.device("cpu"), tr, decoder=dec)
    assert Image.open(vid.replace(".safetensors", ".png")).size == (2 * 32, 3 * 32)
    gif = Image.open(vid.replace(".safetensors", ".gif"))
    assert gif.size == (64, 96) and gif.n_frames == 5
    # no VAE in the pipeline (the shipped digits teacher): latents only
    assert (
        SampleDecoder.from_pretrained(os.path.join(REPO, "rcm_diffusers", "digits", "assets", "digits_teacher"), "wan")
        is None
    )


@torch.no_grad()
def test_flux_latents_synthetic_and_decode():
    """Flux: (z - shift) * scaling, unpacked [C, h, w]; teacher samples == FluxPipeline with the same scheduler,
    true CFG and guidance embedding; the grid decoder inverts the normalisation on packed tokens."""
    from tiny import flux_embeds, tiny_flux_pipeline

    from rcm_diffusers import TrigFlowEulerScheduler
    from rcm_diffusers.distill.data import pack_flux_latents
    from rcm_diffusers.distill.prepare import PipelineEncoder, seed_noise, teacher_samples
    from rcm_diffusers.distill.previews import SampleDecoder

    pipe = tiny_flux_pipeline()
    enc = PipelineEncoder(pipe, 32, 32)
    assert enc.family == "flux" and enc.latent_shape == (4, 16, 16)
    px = torch.from_numpy(np.stack(_smooth(5))).permute(3, 0, 1, 2)[None].float() / 127.5 - 1  # [1, 3, 1, 32, 32]
    lat = enc.encode_media(px)
    ref = (pipe.vae.encode(px[:, :, 0]).latent_dist.mode() - 0.0609) * 1.5035
    torch.testing.assert_close(lat, ref, rtol=1e-5, atol=1e-5)
    img = SampleDecoder(pipe.vae, "flux").decode(pack_flux_latents(lat), (16, 16))
    torch.testing.assert_close(img[:, :, 0], (pipe.vae.decode(ref / 1.5035 + 0.0609).sample / 2 + 0.5).clamp(0, 1))

    pe, pooled = flux_embeds(seed=1)
    ne, npooled = flux_embeds(seed=2)
    batch = {
        "prompt_embeds": pe,
        "pooled_prompt_embeds": pooled,
        "negative_prompt_embeds": ne,
        "negative_pooled_prompt_embeds": npooled,
    }
    got = teacher_samples(
        pipe.transformer,
        "flux",
        batch,
        seed_noise((4, 16, 16), [11]),
        steps=4,
        shift=3.0,
        guidance_scale=2.0,
        flux_guidance=3.5,
    )
    pipe.scheduler = TrigFlowEulerScheduler(shift=3.0, sigma_max=5000.0)
    want = pipe(
        prompt_embeds=pe,
        pooled_prompt_embeds=pooled,
        negative_prompt_embeds=ne,
        negative_pooled_prompt_embeds=npooled,
        true_cfg_scale=2.0,
        guidance_scale=3.5,
        height=32,
        width=32,
        num_inference_steps=4,
        generator=torch.Generator().manual_seed(11),
        output_type="latent",
    ).images
    torch.testing.assert_close(pack_flux_latents(got), want, rtol=1e-4, atol=1e-5)


def test_trainer_reads_prepared_data_and_writes_grid(env, ds_img, tmp_path):
    """accelerate launch training/rcm.py on the prepared dataset: trains, and its sample grid is a decoded PNG."""
    from train_helpers import run_trainer

    root, _ = env
    out = tmp_path / "run"
    p = run_trainer(
        [
            "--config",
            os.path.join(REPO, "training", "configs", "tiny-wan-test.yaml"),
            "--pretrained",
            str(root / "pipe"),
            "--data_dir",
            str(ds_img),
            "--output_dir",
            str(out),
            "--max_steps",
            "2",
            "--sample_every",
            "2",
            "--checkpoint_every",
            "0",
            "--sample_steps",
            "[1, 2]",
        ]
    )
    assert "PNG decoded with the pipeline's VAE" in p.stdout + p.stderr
    assert Image.open(out / "samples" / "step-00000002.png").size == (3 * 32, 2 * 32)
    assert (out / "pytorch_lora_weights.safetensors").exists()
    import rcm

    # synthetic data is made before training (training/prepare_data.py --synthetic), not a trainer option
    with pytest.raises(SystemExit, match=r"^error: unknown config option\(s\): --synthetic true; see --help$"):
        rcm.main(["--pretrained", str(root / "pipe"), "--data_dir", str(ds_img), "--synthetic", "true"])


def _bare(cls, **components):
    """A stock pipeline object holding only ``components`` (the others None): enough for its config and defaults."""
    import inspect

    names = [n for n in inspect.signature(cls.__init__).parameters if n != "self"]
    return cls(**{**dict.fromkeys(names), **components})


@pytest.mark.parametrize(
    "pipeline, family, latent_shape, tokens, guidance",
    [
        ("FluxPipeline", "flux", (16, 128, 128), 64 * 64, 1.0),  # 1024 x 1024: 2x2-packed latent pixels
        ("FluxPipeline", "flux", (16, 64, 96), 32 * 48, 1.0),  # 512 x 768
        ("QwenImagePipeline", "qwen", (16, 64, 64), 32 * 32, 4.0),  # QwenImagePipeline true_cfg_scale default
        ("Flux2Pipeline", "flux2", (128, 64, 64), 64 * 64, 1.0),  # one token per patchified latent pixel
    ],
)
def test_synthetic_defaults_shift_is_the_pipelines_dynamic_shift(pipeline, family, latent_shape, tokens, guidance):
    """Under dynamic shifting the default shift gives the grid the stock scheduler makes with the pipeline's ``mu``
    at this token count: FlowMatchEulerDiscreteScheduler(shift=s) == the dynamic scheduler at ``mu``, to float32
    round-off; FLUX.1 / Qwen-Image's mu is the linear interpolation 0.5 -> 1.15 over 256 -> 4096 tokens (written
    out here), FLUX.2's is its pipeline's ``compute_empirical_mu``."""
    import math
    from types import SimpleNamespace

    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler as FM

    from rcm_diffusers.distill.prepare import synthetic_defaults

    dyn = FM(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    pipe = _bare(getattr(diffusers, pipeline), scheduler=dyn)
    got = synthetic_defaults(SimpleNamespace(pipe=pipe, family=family, latent_shape=latent_shape), steps=50)
    if family == "flux2":
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        mu = compute_empirical_mu(tokens, 50)
    else:
        mu = 0.5 + (tokens - 256) * (1.15 - 0.5) / (4096 - 256)
    assert got == {"shift": pytest.approx(math.exp(mu), rel=1e-12), "guidance_scale": guidance}
    sigmas = np.linspace(1.0, 1 / 50, 50)
    dyn.set_timesteps(sigmas=sigmas, mu=mu)
    static = FM(shift=got["shift"])
    static.set_timesteps(sigmas=sigmas)
    torch.testing.assert_close(static.sigmas, dyn.sigmas, rtol=1e-6, atol=1e-6)
    assert (static.sigmas[1:-1] - torch.from_numpy(sigmas[1:]).float()).abs().max() > 0.05  # the shift moved it


def test_synthetic_defaults_wan_and_explicit_values_win(env, tmp_path):
    """Wan: the scheduler's flow_shift and WanPipeline's guidance_scale default 5; prepare_data takes them when
    --shift / --guidance_scale are not given, says so, records them, and takes given values as given."""
    from types import SimpleNamespace

    import diffusers

    from rcm_diffusers.distill.prepare import synthetic_defaults

    sch = diffusers.UniPCMultistepScheduler(flow_shift=7.0, use_flow_sigmas=True, prediction_type="flow_prediction")
    pipe = _bare(diffusers.WanPipeline, scheduler=sch)
    got = synthetic_defaults(SimpleNamespace(pipe=pipe, family="wan", latent_shape=(16, 21, 60, 104)), steps=100)
    assert got == {"shift": 7.0, "guidance_scale": 5.0}
    root, _ = env
    (root / "p_def.txt").write_text("a red cat\n")
    common = ["--synthetic", "--prompts", str(root / "p_def.txt"), "--steps", "2", "--batch_size", "1"]
    _prepare(env, *common, "--output_dir", str(tmp_path / "d"))
    meta = LatentDataset(str(tmp_path / "d")).meta
    assert (meta["shift"], meta["guidance_scale"]) == (3.0, 5.0)  # the tiny pipeline's FlowMatch shift 3
    _prepare(env, *common, "--shift", "2", "--guidance_scale", "1.5", "--output_dir", str(tmp_path / "e"))
    meta = LatentDataset(str(tmp_path / "e")).meta
    assert (meta["shift"], meta["guidance_scale"]) == (2.0, 1.5)
