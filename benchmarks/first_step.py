"""How much the first-step input matters for RCMScheduler inside stock pipelines (docs/benchmarks.md, First-step input).

Three ways to start a 4-step rCM run:
  exact   : latents = scheduler.scale_initial_noise(noise) -> the model sees r_0 * noise (official sampler)
  stock   : latents = noise (what WanPipeline/FluxPipeline do by themselves) at r_0 = 80/81
  r=1     : sigma_max = 1e9, so r_0 ~ 1 and unscaled noise is exact, but the first time differs

Two models: (1) a tiny random WanTransformer3DModel in a WanPipeline (sensitivity of a real network),
(2) the exact consistency function (flow map) of Gaussian data x0 ~ N(0, s^2 I), where the right answer is known: the
sample std must come out as s. Prints a markdown table; CPU, a few seconds.

    python benchmarks/first_step.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from rcm_diffusers import RCMScheduler  # noqa: E402


def gaussian_velocity(x, r, s):
    """A perfect consistency model for x0 ~ N(0, s^2): the flow map x0 = s x_r / sqrt((1-r)^2 s^2 + r^2)
    (the PF-ODE keeps quantiles), returned as the velocity v = (x_r - x0) / r the scheduler expects."""
    x0 = s * x / ((1 - r) ** 2 * s**2 + r**2) ** 0.5
    return (x - x0) / r


def run_gaussian(mode: str, s: float = 0.5, n: int = 200_000, steps: int = 4, stochastic: bool = True) -> float:
    sched = RCMScheduler(sigma_max=1e9 if mode == "r=1" else 80.0, stochastic=stochastic)
    sched.set_timesteps(steps)
    sched.set_generator(torch.Generator().manual_seed(1))
    noise = torch.randn(n, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = sched.scale_initial_noise(noise) if mode == "exact" else noise
    for i, t in enumerate(sched.timesteps):
        x = sched.step(gaussian_velocity(x, float(sched.rf_times[i]), s), t, x).prev_sample
    return float(x.std())


def run_wan(mode: str) -> torch.Tensor:
    from tiny import tiny_wan_pipeline, wan_embeds

    pipe = tiny_wan_pipeline()
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = RCMScheduler.from_config(pipe.scheduler.config, sigma_max=1e9 if mode == "r=1" else 80.0)
    pipe.scheduler.set_generator(torch.Generator().manual_seed(1))
    noise = torch.randn(4, 4, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    latents = pipe.scheduler.scale_initial_noise(noise) if mode == "exact" else noise
    return pipe(
        prompt_embeds=wan_embeds(4),
        num_inference_steps=4,
        guidance_scale=1.0,
        latents=latents,
        height=32,
        width=32,
        num_frames=9,
        output_type="latent",
    ).frames.double()


def main() -> None:
    s = 0.5
    print(
        f"| start | Gaussian data, stochastic: std (target {s}) | Gaussian data, ode: std (target {s}) "
        "| tiny Wan: rel. L2 diff vs exact |"
    )
    print("|---|---|---|---|")
    ref = run_wan("exact")
    for mode in ("exact", "stock", "r=1"):
        std = run_gaussian(mode, s)
        std_ode = run_gaussian(mode, s, stochastic=False)
        out = run_wan(mode)
        rel = float((out - ref).norm() / ref.norm())
        print(f"| {mode} | {std:.4f} | {std_ode:.4f} | {rel:.2e} |")


if __name__ == "__main__":
    main()
