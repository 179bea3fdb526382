"""Sample grids of the student during training: decode with the pipeline's VAE, tile, save PNG (+ GIF for video).

Grid layout: one row per sampler step count (e.g. 1/2/4), one column per dataset condition; video
samples show their first frame in the PNG and play all frames in the GIF. Without a VAE in the
pretrained pipeline the trainer keeps latents only (``samples/step-*.safetensors``).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from .data import unpack_flux_latents, unpack_latents

__all__ = ["SampleDecoder", "grid_frames", "save_grid", "sample_student", "write_samples"]


class SampleDecoder:
    """The pipeline's VAE as a decoder of model-layout latents into pixels in ``[0, 1]``."""

    def __init__(self, vae, family: str):
        c = vae.config
        if family not in ("flux", "flux2", "hunyuan15") and (
            len(c.latents_mean) != c.z_dim or len(c.latents_std) != c.z_dim
        ):
            raise ValueError(
                f"VAE latents_mean/std have {len(c.latents_mean)}/{len(c.latents_std)} entries, z_dim is {c.z_dim}: "
                "fix the VAE config (sample grids decode with them)"
            )
        self.vae, self.family = vae.eval(), family

    @classmethod
    def from_pretrained(cls, pretrained: str, family: str, device="cpu", dtype=torch.float32) -> "SampleDecoder | None":
        """Load ``<pretrained>/vae`` (the class named in ``model_index.json``); ``None`` when the pipeline has none."""
        import diffusers

        index = diffusers.DiffusionPipeline.load_config(pretrained)
        entry = index.get("vae")
        if not entry or entry[0] is None or entry[1] is None:
            return None
        vae = getattr(diffusers, entry[1]).from_pretrained(pretrained, subfolder="vae", torch_dtype=dtype).to(device)
        return cls(vae, family)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, latent_hw: tuple[int, int] | None = None) -> torch.Tensor:
        """Pixels ``[B, 3, F, H, W]`` in [0, 1] from dataset-normalised latents (Wan ``[B, C, T, h, w]``:
        ``z = x std + mean``; Flux packed tokens ``[B, L, 4C]``: unpack, ``z = x / scaling + shift``; Qwen-Image
        packed tokens: unpack to one latent frame, ``z = x std + mean``)."""
        vae, p = self.vae, next(self.vae.parameters())
        x = latents.float()
        if self.family == "flux2":  # tokens -> [B, 4C, h, w], the batch-norm stats undone, unpatchified
            if x.dim() == 3:
                x = unpack_latents("flux2", x, *latent_hw)
            bn = vae.bn
            mean = bn.running_mean.detach().float().cpu().view(1, -1, 1, 1)
            std = torch.sqrt(bn.running_var.detach().float().cpu().view(1, -1, 1, 1) + vae.config.batch_norm_eps)
            B, C4, h, w = x.shape
            z = (x * std + mean).view(B, C4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
            z = z.reshape(B, C4 // 4, 2 * h, 2 * w)
            img = vae.decode(z.to(p.device, p.dtype)).sample[:, :, None]
        elif self.family == "hunyuan15":  # [B, C, T, h, w]; HunyuanVideo15Pipeline decodes latents / scaling_factor
            img = vae.decode((x / vae.config.scaling_factor).to(p.device, p.dtype)).sample
        elif self.family == "flux":
            if x.dim() == 3:
                x = unpack_flux_latents(x, *latent_hw)
            c = vae.config
            img = vae.decode((x / c.scaling_factor + c.shift_factor).to(p.device, p.dtype)).sample[:, :, None]
        else:
            if self.family == "qwen":
                if x.dim() == 3:
                    x = unpack_flux_latents(x, *latent_hw)
                x = x[:, :, None]  # AutoencoderKLQwenImage decodes [B, C, 1, h, w]
            z = vae.config.z_dim
            mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32).view(1, z, 1, 1, 1)
            std = torch.tensor(vae.config.latents_std, dtype=torch.float32).view(1, z, 1, 1, 1)
            img = vae.decode((x * std + mean).to(p.device, p.dtype)).sample
        return (img.float().cpu() / 2 + 0.5).clamp(0, 1)


def grid_frames(rows: list[torch.Tensor]) -> np.ndarray:
    """Tile ``rows`` (each ``[B, 3, F, H, W]`` in [0, 1]) into uint8 frames ``[F, R H, B W, 3]``."""
    R, (B, _, F, H, W) = len(rows), rows[0].shape
    out = np.zeros((F, R * H, B * W, 3), dtype=np.uint8)
    for i, r in enumerate(rows):
        a = (r.permute(2, 3, 0, 4, 1).reshape(F, H, B * W, 3) * 255).round().to(torch.uint8).numpy()
        out[:, i * H : (i + 1) * H] = a
    return out


def save_grid(path_stem: str, rows: list[torch.Tensor], gif: bool = True) -> list[str]:
    """Write ``<stem>.png`` (first frame) and, for video, ``<stem>.gif`` (all frames, 8 fps); atomic."""
    from PIL import Image

    frames = grid_frames(rows)
    written = []
    tmp = path_stem + ".png.tmp"
    Image.fromarray(frames[0]).save(tmp, format="PNG")
    os.replace(tmp, path_stem + ".png")
    written.append(path_stem + ".png")
    if gif and frames.shape[0] > 1:
        tmp = path_stem + ".gif.tmp"
        ims = [Image.fromarray(f) for f in frames]
        ims[0].save(tmp, format="GIF", save_all=True, append_images=ims[1:], duration=125, loop=0)
        os.replace(tmp, path_stem + ".gif")
        written.append(path_stem + ".gif")
    return written


@torch.no_grad()
def sample_student(
    nets, cond, shape, steps: int, sigma_max: float, generator, device, role: str = "student", mid_t=None
):
    """Few-step student samples with ``RCMScheduler`` (docs/math.md §2.1; ``mid_t`` empty = its default angles, else
    a list or per step count), model-layout float32 latents; the network sees its time as in training
    (``nets.time_input``), the update runs on the exact RF times."""
    from ..models import velocity_fn
    from ..sampling import DEFAULT_MID_T
    from ..schedulers import RCMScheduler

    sch = RCMScheduler(sigma_max=sigma_max, mid_t=mid_t or DEFAULT_MID_T, time_input=nets.time_input)
    sch.set_timesteps(steps)
    x = sch.scale_initial_noise(torch.randn(shape, generator=generator, dtype=torch.float32).to(device))
    with nets.role(role):
        v_fn = velocity_fn(nets.modules[role], nets.time_input)
        for k, ts in enumerate(sch.timesteps):
            r = torch.tensor(float(sch.rf_times[k]), dtype=torch.float64, device=device)
            v = v_fn(x.to(nets.model_dtype), r, **cond).float()
            x = sch.step(v, ts, x, generator=generator).prev_sample
    return x


def write_samples(nets, data, cfg, step: int, device, transformer, n: int = 4, decoder=None) -> str:
    """Student samples at each of ``cfg.sample_steps`` for the first ``n`` dataset conditions, fixed
    seed, saved as ``samples/step-XXXXXXXX.safetensors`` (model-layout latents) and, with a
    ``previews.SampleDecoder``, a PNG grid (rows = step counts, columns = conditions; + GIF for video)."""
    from safetensors.torch import save_file

    from .data import model_inputs

    ids = list(range(min(n, len(data))))
    batch = data.get(ids)
    x0, cond, _ = model_inputs(
        data.family,
        batch,
        device,
        nets.model_dtype,
        cfg.flux_guidance if getattr(transformer.config, "guidance_embeds", False) else None,
    )
    out = {}
    for k in cfg.sample_steps:
        gen = torch.Generator().manual_seed(cfg.seed)
        out[f"steps_{k}"] = sample_student(
            nets, cond, tuple(x0.shape), int(k), cfg.sigma_max, gen, device, mid_t=cfg.mid_t
        ).cpu()
    d = os.path.join(cfg.output_dir, "samples")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"step-{step:08d}.safetensors")
    save_file({k: v.contiguous() for k, v in out.items()}, path + ".tmp")
    os.replace(path + ".tmp", path)
    if decoder is not None:
        hw = tuple(batch["latents"].shape[-2:])
        save_grid(path[: -len(".safetensors")], [decoder.decode(out[f"steps_{k}"], hw) for k in cfg.sample_steps])
    return path
