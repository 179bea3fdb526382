"""Tiny random Wan / Flux pipelines and latent datasets for the trainer tests (no hub access)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from rcm_diffusers.distill import launch as R

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT_DIM, TEXT_LEN = 16, 4


def tiny_wan_transformer(seed: int = 0, in_channels: int = 4, image_dim: int | None = None):
    """2-layer, 2-head Wan transformer; I2V: ``in_channels`` 12 (noise + mask + image latents), ``image_dim`` = width
    of the image tokens it also cross-attends to."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=in_channels,
        out_channels=4,
        text_dim=TEXT_DIM,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        rope_max_seq_len=32,
        image_dim=image_dim,
        added_kv_proj_dim=None if image_dim is None else 24,
    )


def make_tiny_wan(root: str) -> str:
    """Save a tiny WanPipeline (no text encoder) to ``root``; returns its path."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline

    if os.path.exists(os.path.join(root, "model_index.json")):
        return root
    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    pipe = WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=tiny_wan_transformer(),
    )
    pipe.save_pretrained(root)
    return root


def make_tiny_wan2(root: str, i2v: bool = False, boundary_ratio: float = 0.875, image_dim: int | None = None) -> str:
    """Save a tiny Wan 2.2-style two-expert pipeline (``transformer`` high noise, ``transformer_2`` low noise,
    ``boundary_ratio``): ``WanPipeline`` or, with ``i2v``, ``WanImageToVideoPipeline`` (image latents + mask on the
    channels, no CLIP image branch, as Wan2.2-I2V-A14B; with ``image_dim`` the experts also cross-attend to that
    many-wide image tokens, the Wan 2.1 I2V branch)."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanImageToVideoPipeline,
        WanPipeline,
        WanTransformer3DModel,
    )

    if os.path.exists(os.path.join(root, "model_index.json")):
        return root

    def expert(seed):
        torch.manual_seed(seed)
        return WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=12 if i2v else 4,
            out_channels=4,
            text_dim=TEXT_DIM,
            freq_dim=32,
            ffn_dim=32,
            num_layers=2,
            rope_max_seq_len=32,
            image_dim=image_dim,
            added_kv_proj_dim=None if image_dim is None else 24,
        )

    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=3,
        z_dim=4,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )
    kw = dict(
        tokenizer=None,
        text_encoder=None,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=expert(1),
        transformer_2=expert(2),
        boundary_ratio=boundary_ratio,
    )
    pipe = WanImageToVideoPipeline(image_encoder=None, image_processor=None, **kw) if i2v else WanPipeline(**kw)
    pipe.save_pretrained(root)
    return root


def tiny_flux_transformer():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=TEXT_DIM,
        pooled_projection_dim=8,
        guidance_embeds=False,
        axes_dims_rope=(2, 2, 4),
    )


def make_tiny_flux(root: str) -> str:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline

    if os.path.exists(os.path.join(root, "model_index.json")):
        return root
    torch.manual_seed(0)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(8,),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0,
        scaling_factor=1.0,
    )
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=tiny_flux_transformer(),
    )
    pipe.save_pretrained(root)
    return root


def make_dataset(
    root: str,
    family: str,
    n: int = 16,
    classes: int = 3,
    image_tokens: int = 0,
    image_dim: int = 8,
    frames: int = 1,
    noise: bool = False,
) -> str:
    """Random-but-structured latents (class-dependent means) with a class table of prompt embeddings; ``wan_i2v``
    with ``image_tokens``: also ``image_tokens`` x ``image_dim`` image embeddings per sample and prompts padded to
    the 512 tokens Wan I2V attention expects; ``frames``: latent frames of a Wan sample; ``noise``: a ``noise``
    field too, which makes the set ODE pairs for the regression term (random targets: its arithmetic, not quality)."""
    from rcm_diffusers.distill.data import write_latent_dataset

    if os.path.exists(os.path.join(root, "meta.json")):
        return root
    g = torch.Generator().manual_seed(0)
    label = torch.arange(n) % classes
    shape = (4, frames, 4, 4) if family.startswith("wan") else (4, 4, 4)
    means = torch.randn(classes, *shape, generator=g)
    lat = means[label] + 0.3 * torch.randn(n, *shape, generator=g)
    text_len = 512 if image_tokens else TEXT_LEN
    tables = {
        "prompt_embeds": torch.randn(classes, text_len, TEXT_DIM, generator=g),
        "negative_prompt_embeds": torch.zeros(1, text_len, TEXT_DIM),
    }
    index = {"prompt_embeds": "prompt_index", "negative_prompt_embeds": None}
    samples = {"latents": lat, "prompt_index": label}
    if family == "wan_i2v":  # first-frame mask (4 channels) + the image latents, as WanImageToVideoPipeline builds them
        samples["condition"] = torch.cat(
            [torch.ones(n, 4, frames, 4, 4), lat + 0.1 * torch.randn(n, *shape, generator=g)], dim=1
        )
        if image_tokens:
            samples["image_embeds"] = torch.randn(n, image_tokens, image_dim, generator=g)
    if family == "flux":
        tables["pooled_prompt_embeds"] = torch.randn(classes, 8, generator=g)
        index["pooled_prompt_embeds"] = "prompt_index"
    if noise:
        samples["noise"] = torch.randn(n, *shape, generator=g)
    return write_latent_dataset(root, samples, family=family, tables=tables, table_index=index)


def run_trainer(
    args: list[str],
    num_processes: int = 1,
    timeout: int = 300,
    check: bool = True,
    script: str = "rcm.py",
    env: dict | None = None,
):
    """``runs.cpu_launch_command`` of ``training/<script> args`` in a subprocess (``env``: extra variables)."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **(env or {}),
    }
    cmd = R.cpu_launch_command(os.path.join(REPO, "training", script), args, num_processes)
    # own session so a timeout kills the launcher's worker processes too
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        raise AssertionError(f"trainer timed out after {timeout}s:\n{out[-3000:]}\n{err[-6000:]}")
    p = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and p.returncode != 0:
        raise AssertionError(f"trainer failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return p


def kill_after(step: int) -> dict:
    """The environment of a trainer that hard-exits right after iteration ``step``, as if killed (a test aid that
    stays out of ``--help``: ``rcm_diffusers.distill.session.EXIT_AFTER_STEP_ENV``)."""
    from rcm_diffusers.distill.session import EXIT_AFTER_STEP_ENV

    return {EXIT_AFTER_STEP_ENV: str(step)}


def tiny_wan_run(tmp_path_factory, name: str):
    """``(pipeline dir, latent dataset dir, root)`` of a tiny Wan teacher and its data (module fixtures)."""
    root = tmp_path_factory.mktemp(name)
    return make_tiny_wan(str(root / "pipe")), make_dataset(str(root / "data"), "wan"), root


def trainer_args(config: str, run, out, *extra) -> list[str]:
    """Command-line of a trainer run on ``tiny_wan_run``'s teacher and data."""
    return ["--config", config, "--pretrained", run[0], "--data_dir", run[1], "--output_dir", str(out), *extra]


def run_script(args: list[str], script: str = "rcm.py", timeout: int = 300):
    """``python training/<script> args`` without the launcher (for runs that must stop before training)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        [sys.executable, os.path.join(REPO, "training", script), *args],
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
    )


class Payload:
    """Unpickling this creates ``path`` (``open(path, "w")``): the stand-in for code that a crafted pickle runs."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


# the file names accelerate's save_state writes; a resume must never unpickle any of them
ACCELERATE_SLOTS = (
    "custom_checkpoint_0.pkl",
    "custom_checkpoint_1.pkl",
    "random_states_0.pkl",
    "optimizer.bin",
    "optimizer_1.bin",
    "scheduler.bin",
    "scheduler_1.bin",
    "pytorch_model.bin",
)


def plant_pickles(ckpt_dir, marker) -> None:
    """Put a code-running pickle in each of accelerate's checkpoint file names in ``ckpt_dir``."""
    for n in ACCELERATE_SLOTS:
        torch.save({"state": Payload(marker)}, os.path.join(str(ckpt_dir), n))


def tiny_qwen_transformer(seed: int = 0, dtype: torch.dtype = torch.float32):
    """2-block, 2-head Qwen-Image transformer (4 latent channels packed 2 x 2 into 16, text width ``TEXT_DIM``)."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    m = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT_DIM,
        guidance_embeds=False,
        axes_dims_rope=(8, 4, 4),
    )
    return m if dtype == torch.float32 else m.to(dtype)


def make_tiny_qwen(root: str) -> str:
    """Save a tiny QwenImagePipeline (tiny VAE, no text encoder) to ``root``; returns its path."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    if os.path.exists(os.path.join(root, "model_index.json")):
        return root
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )
    # the scheduler settings of Qwen/Qwen-Image (dynamic exponential shift)
    sched = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, shift_terminal=0.02, time_shift_type="exponential"
    )
    pipe = QwenImagePipeline(
        scheduler=sched, vae=vae, text_encoder=None, tokenizer=None, transformer=tiny_qwen_transformer()
    )
    pipe.save_pretrained(root)
    return root


#: prompt lengths of the tiny Qwen-Image dataset's classes (padded to TEXT_LEN + 2 with a mask) and its negative
QWEN_LENGTHS, QWEN_NEG_LENGTH = (3, 6, 4), 2


def make_qwen_dataset(root: str, n: int = 16, noise: bool = False) -> str:
    """``make_dataset`` for Qwen-Image: latents ``[4, 4, 4]`` and a class table of prompt embeddings padded with
    zeros to ``TEXT_LEN + 2`` tokens, with ``prompt_embeds_mask`` (prompts of ``QWEN_LENGTHS`` tokens) and a
    negative prompt of ``QWEN_NEG_LENGTH`` tokens, as prepare_data stores QwenImagePipeline.encode_prompt's output."""
    from rcm_diffusers.distill.data import write_latent_dataset

    if os.path.exists(os.path.join(root, "meta.json")):
        return root
    g = torch.Generator().manual_seed(0)
    classes, L = len(QWEN_LENGTHS), TEXT_LEN + 2
    label = torch.arange(n) % classes
    shape = (4, 4, 4)
    means = torch.randn(classes, *shape, generator=g)
    lat = means[label] + 0.3 * torch.randn(n, *shape, generator=g)
    mask = torch.zeros(classes, L)
    for i, k in enumerate(QWEN_LENGTHS):
        mask[i, :k] = 1.0
    neg_mask = torch.zeros(1, L)
    neg_mask[0, :QWEN_NEG_LENGTH] = 1.0
    tables = {
        "prompt_embeds": torch.randn(classes, L, TEXT_DIM, generator=g) * mask[..., None],
        "prompt_embeds_mask": mask,
        "negative_prompt_embeds": torch.randn(1, L, TEXT_DIM, generator=g) * neg_mask[..., None],
        "negative_prompt_embeds_mask": neg_mask,
    }
    index = {
        "prompt_embeds": "prompt_index",
        "prompt_embeds_mask": "prompt_index",
        "negative_prompt_embeds": None,
        "negative_prompt_embeds_mask": None,
    }
    samples = {"latents": lat, "prompt_index": label}
    if noise:
        samples["noise"] = torch.randn(n, *shape, generator=g)
    return write_latent_dataset(root, samples, family="qwen", tables=tables, table_index=index)


def tiny_flux2_transformer(seed: int = 0, dtype: torch.dtype = torch.float32):
    """1 double + 1 single block, 2-head FLUX.2 transformer with the guidance embedding of FLUX.2 [dev] (4 VAE
    channels patchified 2 x 2 into 16, text width ``TEXT_DIM``)."""
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(seed)
    m = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=TEXT_DIM,
        timestep_guidance_channels=16,
        mlp_ratio=2.0,
        axes_dims_rope=(2, 2, 2, 2),
        guidance_embeds=True,
    )
    return m if dtype == torch.float32 else m.to(dtype)


def tiny_flux2_vae(seed: int = 0):
    """A one-level AutoencoderKLFlux2 (x1, 4 latent channels) with non-trivial batch-norm statistics."""
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(8,),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.linspace(-0.3, 0.3, 16))
        vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, 16))
    return vae.eval()


def make_tiny_flux2(root: str) -> str:
    """Save a tiny Flux2Pipeline (tiny VAE, no text encoder) to ``root``; returns its path."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline

    if os.path.exists(os.path.join(root, "model_index.json")):
        return root
    # the scheduler settings of black-forest-labs/FLUX.2-dev (dynamic exponential shift, mu from the pipeline)
    sched = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type="exponential", shift=3.0)
    pipe = Flux2Pipeline(
        scheduler=sched, vae=tiny_flux2_vae(), text_encoder=None, tokenizer=None, transformer=tiny_flux2_transformer()
    )
    pipe.save_pretrained(root)
    return root


def make_flux2_dataset(root: str, n: int = 16, noise: bool = False) -> str:
    """``make_dataset`` for FLUX.2: patchified latents ``[16, 4, 4]`` and a class table of prompt embeddings of
    ``TEXT_LEN`` tokens (no mask, no pooled text, no negative: Flux2Pipeline samples without CFG)."""
    from rcm_diffusers.distill.data import write_latent_dataset

    if os.path.exists(os.path.join(root, "meta.json")):
        return root
    g = torch.Generator().manual_seed(0)
    classes = 3
    label = torch.arange(n) % classes
    shape = (16, 4, 4)
    means = torch.randn(classes, *shape, generator=g)
    lat = means[label] + 0.3 * torch.randn(n, *shape, generator=g)
    tables = {"prompt_embeds": torch.randn(classes, TEXT_LEN, TEXT_DIM, generator=g)}
    samples = {"latents": lat, "prompt_index": label}
    if noise:
        samples["noise"] = torch.randn(n, *shape, generator=g)
    return write_latent_dataset(
        root, samples, family="flux2", tables=tables, table_index={"prompt_embeds": "prompt_index"}
    )
