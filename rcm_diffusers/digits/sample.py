"""Teacher and student samplers on the digits teacher (the diffusers schedulers this package ships), with timing."""

from __future__ import annotations

import resource
import time

import torch

from .teacher import NULL_CLASS

# ----------------------------------------------------------------------------- samplers


def _velocity(transformer, class_embeddings, labels, guidance_scale: float, time_input: str = "float"):
    """``v(x, r)`` with CFG ``v_u + s (v_c - v_u)`` (docs/math.md §2.2); one batched call for both branches; the network
    sees ``network_timestep(r, 1000, time_input)``."""
    from ..models import network_timestep

    cond = class_embeddings[labels]
    null = class_embeddings[NULL_CLASS:].expand_as(cond)

    def v(x, r):
        B = x.shape[0]
        ts = network_timestep(torch.full((B,), float(r), dtype=torch.float64), 1000.0, time_input).float().to(x.device)
        if guidance_scale == 1.0:
            return transformer(x, ts, cond, return_dict=False)[0].float()
        out = transformer(torch.cat([x, x]), torch.cat([ts, ts]), torch.cat([cond, null]), return_dict=False)[0].float()
        v_c, v_u = out[:B], out[B:]
        return v_u + guidance_scale * (v_c - v_u)

    return v


@torch.no_grad()
def sample_teacher(
    transformer,
    class_embeddings,
    labels: torch.Tensor,
    steps: int,
    solver: str = "euler",
    guidance_scale: float = 1.0,
    seed: int = 0,
    shift: float = 1.0,
    sigma_max: float = 5000.0,
    batch_size: int = 500,
) -> torch.Tensor:
    """Teacher ODE samples ``[B, 1, 1, 8, 8]`` with ``TrigFlowEulerScheduler`` / ``TrigFlowUniPCScheduler``
    (docs/math.md §2.2), starting from ``noise`` drawn by ``torch.Generator().manual_seed(seed)``. NFE = steps x (2
    with CFG, else 1)."""
    from ..schedulers import TrigFlowEulerScheduler, TrigFlowUniPCScheduler

    cls = {"euler": TrigFlowEulerScheduler, "unipc": TrigFlowUniPCScheduler}[solver]
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(len(labels), 1, 1, 8, 8, generator=g)
    outs = []
    for i in range(0, len(labels), batch_size):
        sch = cls(sigma_max=sigma_max, shift=shift)
        sch.set_timesteps(steps)
        x = noise[i : i + batch_size]
        v = _velocity(transformer, class_embeddings, labels[i : i + batch_size], guidance_scale)
        for k, ts in enumerate(sch.timesteps):
            x = sch.step(v(x, sch.rf_times[k]), ts, x).prev_sample
        outs.append(x)
    return torch.cat(outs)


@torch.no_grad()
def sample_student(
    transformer,
    class_embeddings,
    labels: torch.Tensor,
    steps: int,
    seed: int = 0,
    sigma_max: float = 80.0,
    mid_t=None,
    guidance_scale: float = 1.0,
    batch_size: int = 500,
    time_input: str = "bf16",
) -> torch.Tensor:
    """Few-step rCM samples with ``RCMScheduler`` (docs/math.md §2.1): ``x = r_0 noise``, then ``steps``
    x0-and-renoise moves with fresh noise from the same seeded generator. NFE = steps (x 2 with CFG). ``time_input``:
    the time the student saw in training (``RCMConfig.time_input``). ``mid_t``: None = the default angles, else any
    form ``RCMScheduler`` takes (a list, or per step count)."""
    from ..sampling import DEFAULT_MID_T
    from ..schedulers import RCMScheduler

    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(len(labels), 1, 1, 8, 8, generator=g)
    outs = []
    for i in range(0, len(labels), batch_size):
        sch = RCMScheduler(sigma_max=sigma_max, mid_t=mid_t or DEFAULT_MID_T, time_input=time_input)
        sch.set_timesteps(steps)
        sch.set_generator(g)
        x = sch.scale_initial_noise(noise[i : i + batch_size])
        v = _velocity(transformer, class_embeddings, labels[i : i + batch_size], guidance_scale, time_input)
        for k, ts in enumerate(sch.timesteps):
            x = sch.step(v(x, sch.rf_times[k]), ts, x).prev_sample
        outs.append(x)
    return torch.cat(outs)


@torch.no_grad()
def sample_pipeline(
    pipe, class_embeddings, labels: torch.Tensor, steps: int, seed: int = 0, batch_size: int = 500
) -> torch.Tensor:
    """Samples ``[B, 1, 1, 8, 8]`` by the stock ``pipe(...)`` call a user makes (64 px = 8x8 latents,
    ``guidance_scale=1``, ``output_type="latent"``): ``pipe.scheduler`` as it is, the pipeline's own unscaled initial
    noise from ``generator=torch.Generator().manual_seed(seed)`` and the scheduler's own re-noising. NFE = steps."""
    g = torch.Generator().manual_seed(seed)
    outs = []
    for i in range(0, len(labels), batch_size):
        outs.append(
            pipe(
                prompt_embeds=class_embeddings[labels[i : i + batch_size]],
                height=64,
                width=64,
                num_frames=1,
                num_inference_steps=steps,
                guidance_scale=1.0,
                output_type="latent",
                generator=g,
            ).frames.float()
        )
    return torch.cat(outs)


def timed(fn, *args, **kwargs):
    """``(result, seconds, peak_mb)``: wall clock of ``fn``; peak memory is CUDA's ``max_memory_allocated`` on GPU,
    else the process's resident-set high-water mark (``ru_maxrss``, process-wide, not per call)."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    peak = (
        torch.cuda.max_memory_allocated() / 2**20 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    return out, dt, peak
