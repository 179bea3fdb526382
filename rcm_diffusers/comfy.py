"""Logic of the ComfyUI node pack (``comfy_nodes/``), importable and tested without ComfyUI.

ComfyUI runs Wan and Flux with CONST model sampling: a SIGMAS value is the RF time ``r``,
``x_r = (1 - r) x0 + r noise``, and the denoiser a sampler calls returns ``x0``. So the rCM
RF times of :mod:`rcm_diffusers.sampling` are ComfyUI sigmas as they are, and the sampler
below is the docs/math.md §2.1 loop over ``x0`` through :func:`rcm_diffusers.sampling.rcm_update`,
the same move the diffusers ``RCMScheduler`` makes.

The node classes only parse widgets, call these functions and wrap the results.
"""

from __future__ import annotations

import math
import os
import re
import sys
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from .models import TIME_INPUTS, network_timestep
from .sampling import (
    DEFAULT_MID_T,
    SPACINGS,
    _per_step_items,
    _per_step_table,
    format_mid_t,
    rcm_rf_times,
    rcm_update,
    teacher_rf_grid,
    validate_rf_times,
)

__all__ = [
    "DEFAULT_MID_T_TEXT",
    "PER_STEP_MID_T_EXAMPLE",
    "WAN22_BOUNDARY",
    "parse_mid_t",
    "rcm_sigmas",
    "check_rcm_sigmas_widgets",
    "teacher_sigmas",
    "check_flow_model_sampling",
    "seeded_noise_sampler",
    "sample_rcm",
    "split_sigmas_at_boundary",
    "ARCH_NAMES",
    "KEY_MAP_FAMILIES",
    "model_arch",
    "load_lora_file",
    "lora_key_map_problems",
    "lora_targets_missing",
    "split_parameter_patches",
    "check_stochastic",
    "model_weight_shapes",
    "check_lora_against_model",
    "resolve_lora_name",
    "wan_lora_variant",
    "wan_model_variant",
]

DEFAULT_MID_T_TEXT = ", ".join(str(m) for m in DEFAULT_MID_T)
#: the per-step-count form of the mid_t widget: n steps take the entry for n (else the next larger), cut to n - 1 angles
PER_STEP_MID_T_EXAMPLE = "2: 1.0; 4: 1.5, 1.4, 0.8"
#: Wan 2.2 A14B switches from the high-noise to the low-noise expert at this RF time (I2V; T2V uses 0.875).
WAN22_BOUNDARY = 0.9
_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


# ----------------------------------------------------------------------------- sigmas


def parse_mid_t(text: str | Sequence[float] | Mapping) -> tuple[float, ...] | dict[int, tuple[float, ...]]:
    """Intermediate TrigFlow angles from a widget string (docs/math.md §2.1).

    One list for every step count, ``"1.5, 1.4, 1.0"``: commas, spaces or brackets separate the numbers; an
    empty string means no intermediate angle (1 step only). Or per step count, ``"2: 1.0; 4: 1.5, 1.4, 0.8"``
    (``steps: angles`` entries separated by semicolons; a mapping ``{2: [1.0], ...}`` also works): ``n`` steps take
    the entry for ``n``, else the one for the next larger count, cut to ``n - 1`` angles
    (:func:`rcm_diffusers.sampling.mid_t_for_steps`); returned as ``{steps: angles}``. Every angle must lie in
    (0, pi/2) and each list must strictly decrease.
    """
    if isinstance(text, Mapping) or (isinstance(text, str) and ":" in text):
        return _parse_per_step(text)
    values = _read_angles(text, text)
    _check_angles(values, "")
    return values


def _read_angles(part, text) -> tuple[float, ...]:
    if not isinstance(part, str):
        return tuple(float(v) for v in part)
    tokens = [t for t in re.split(r"[\s,;\[\]()]+", part.strip()) if t]
    bad = [t for t in tokens if not _NUMBER.match(t)]
    if bad:
        raise ValueError(
            f"mid_t: cannot read {bad} as numbers in {text!r}; write the intermediate TrigFlow angles "
            f"as decreasing numbers separated by commas, e.g. '{DEFAULT_MID_T_TEXT}' (or per step count, "
            f"'{PER_STEP_MID_T_EXAMPLE}')."
        )
    return tuple(float(t) for t in tokens)


def _parse_per_step(text) -> dict[int, tuple[float, ...]]:
    """``"2: 1.0; 4: 1.5, 1.4, 0.8"`` (or a mapping) -> ``{2: (1.0,), 4: (1.5, 1.4, 0.8)}``, every entry checked: the
    sampler's own splitting and table checks (keys, lengths, duplicates, finiteness), the widget's number reading."""
    if isinstance(text, str):
        items = [
            (k, _read_angles(part, text)) for k, part in _per_step_items(text, "mid_t: entry {entry!r} of {text!r}")
        ]
    else:
        items = text.items()
    table = {k: tuple(v) for k, v in _per_step_table(items).items()}
    for k, values in table.items():
        _check_angles(values, f" (the entry for {k} steps)")
    return table


def _check_angles(values: tuple[float, ...], where: str) -> None:
    if any(not math.isfinite(v) for v in values):
        raise ValueError(f"mid_t: angles must be finite numbers, got {list(values)}{where}.")
    outside = [v for v in values if not 0.0 < v < math.pi / 2]
    if outside:
        raise ValueError(
            f"mid_t: angles {outside}{where} are outside (0, {math.pi / 2:.5f}); TrigFlow angles lie strictly between "
            f"0 (clean) and pi/2 (pure noise), e.g. '{DEFAULT_MID_T_TEXT}'."
        )
    if any(b >= a for a, b in zip(values, values[1:])):
        raise ValueError(
            f"mid_t: angles must strictly decrease (noisy to clean), got {list(values)}{where}; "
            f"e.g. '{DEFAULT_MID_T_TEXT}'."
        )


def _as_sigmas(r: np.ndarray) -> torch.Tensor:
    # ComfyUI's SIGMAS are float32 CPU tensors (its schedulers return them so); the grid itself
    # was computed in float64.
    return torch.from_numpy(np.ascontiguousarray(r)).to(torch.float32)


def rcm_sigmas(steps: int, sigma_max: float = 80.0, mid_t: str | Sequence[float] = DEFAULT_MID_T_TEXT) -> torch.Tensor:
    """SIGMAS of the ``steps``-step rCM sampler: docs/math.md §2.1's RF times, ``steps + 1`` values ending at 0.

    ``sigma_max`` is the EDM-scale start (80 for Wan T2V, 200 for Wan I2V); ``mid_t`` the
    intermediate TrigFlow angles (text or numbers; one list, or per step count as :func:`parse_mid_t` reads).
    Steps beyond ``len(mid_t) + 1`` (per step count: beyond the largest count) need more angles.
    """
    angles = parse_mid_t(mid_t)
    steps = _whole_steps(steps)
    if isinstance(angles, dict):
        if not 1 <= steps <= max(angles):
            fix = f"lower steps or add an entry for {steps} steps to mid_t" if steps > 1 else "use at least 1 step"
            raise ValueError(
                f"steps={steps} is out of range: with mid_t='{format_mid_t(angles)}' the rCM sampler takes "
                f"1..{max(angles)} steps (angles for {', '.join(str(k) for k in angles)} steps; each entry also serves "
                f"fewer steps); {fix}."
            )
    elif not 1 <= steps <= len(angles) + 1:
        raise ValueError(
            f"steps={steps} is out of range: with mid_t={list(angles)} the rCM sampler takes 1..{len(angles) + 1} "
            f"steps (4 is the usual); lower steps or add intermediate angles to mid_t."
        )
    return _as_sigmas(rcm_rf_times(steps, sigma_max, angles))


def _whole_steps(steps) -> int:
    # widget values arrive as int, but API workflows and scripts may pass "4" or 4.0
    try:
        value = float(steps.strip()) if isinstance(steps, str) else float(steps)
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(steps, bool) or not math.isfinite(value) or value != int(value):
        raise ValueError(f"steps must be a whole number such as 4, got {steps!r}.")
    return int(value)


def check_rcm_sigmas_widgets(steps, sigma_max, mid_t) -> str | None:
    """The error :func:`rcm_sigmas` would raise for these widget values, as text (None when they are fine).

    Lets the node reject a bad ``steps``/``sigma_max``/``mid_t`` when the workflow is queued, before sampling.
    """
    try:
        rcm_sigmas(steps, sigma_max, mid_t)
    except ValueError as e:
        return str(e)
    return None


def teacher_sigmas(
    steps: int,
    sigma_max: float = 5000.0,
    spacing: str = "linear",
    shift: float = 1.0,
    rho: float = 7.0,
    sigma_min: float = 0.002,
) -> torch.Tensor:
    """SIGMAS of the teacher ODE grid (docs/math.md §2.2) from ``r_max = sigma_max / (1 + sigma_max)`` to 0."""
    if spacing not in SPACINGS:
        raise ValueError(f"spacing={spacing!r} is unknown; choose one of {list(SPACINGS)}.")
    return _as_sigmas(teacher_rf_grid(steps, sigma_max, spacing, shift=shift, rho=rho, sigma_min=sigma_min))


def check_flow_model_sampling(model_sampling) -> None:
    """Raise unless ``model_sampling`` is ComfyUI's CONST (rectified-flow) kind, where sigma = RF time."""
    names = [c.__name__ for c in type(model_sampling).__mro__]
    if "CONST" not in names:
        raise ValueError(
            f"this model samples as {type(model_sampling).__name__} ({', '.join(names[1:4])}), not as a rectified-flow "
            "(CONST) model: rCM sigmas are RF times for Wan and Flux models; connect a Wan or Flux model, or none."
        )


def split_sigmas_at_boundary(
    sigmas: torch.Tensor, boundary: float = WAN22_BOUNDARY
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split SIGMAS for Wan 2.2's two experts: steps starting at ``r >= boundary`` go to the high-noise expert.

    Returns ``(high, low)`` sharing the switch sigma (``high[-1] == low[0]``), the same chaining as
    ComfyUI's SplitSigmas: the high-noise sampler stops at the switch sigma, the low-noise one starts there.
    Raises if either expert would get no step.
    """
    if not isinstance(sigmas, (torch.Tensor, np.ndarray, list, tuple)):
        raise ValueError(f"rCM Expert Split: sigmas must be SIGMAS (connect rCM Sigmas), got {type(sigmas).__name__}.")
    if isinstance(boundary, bool) or not isinstance(boundary, (int, float)) or not math.isfinite(boundary):
        raise ValueError(f"rCM Expert Split: boundary must be a number in (0, 1), got {boundary!r}.")
    r = _checked_sigmas(sigmas)
    if not 0.0 < boundary < 1.0:
        raise ValueError(f"boundary={boundary} must lie in (0, 1) (Wan 2.2 A14B: 0.9 for I2V, 0.875 for T2V).")
    k = int(np.argmax(r < boundary))  # first sigma below the boundary (the final 0 qualifies)
    if k == 0:
        raise ValueError(
            f"boundary={boundary}: all steps start below it (sigmas {np.round(r, 5).tolist()}), so the high-noise "
            "expert gets no step; raise sigma_max or lower the boundary."
        )
    if k == len(r) - 1:
        raise ValueError(
            f"boundary={boundary}: every step starts above it (sigmas {np.round(r, 5).tolist()}), so the low-noise "
            "expert gets no step; use more steps or raise the boundary (or use one expert)."
        )
    sigmas = torch.as_tensor(sigmas)
    return sigmas[: k + 1].clone(), sigmas[k:].clone()


def _checked_sigmas(sigmas) -> np.ndarray:
    r = np.asarray(torch.as_tensor(sigmas).detach().cpu().to(torch.float64).reshape(-1))
    if r.size < 2:
        raise ValueError(f"SIGMAS needs at least 2 values (one step), got {r.tolist()}.")
    if r[-1] < 0 or np.any(r > 1):
        raise ValueError(
            f"SIGMAS {r.tolist()} are not RF times in [0, 1]: the rCM sampler is for rectified-flow (CONST) "
            "models such as Wan and Flux; build the sigmas with RCMSigmas or TrigFlowTeacherSigmas."
        )
    validate_rf_times(r, append_zero=False, name="SIGMAS")
    return r


# ----------------------------------------------------------------------------- sampler


def check_stochastic(stochastic) -> bool:
    """``stochastic`` as a bool; ValueError for anything else (a string such as "maybe" is not taken as True)."""
    if isinstance(stochastic, (bool, np.bool_)):
        return bool(stochastic)
    raise ValueError(f"rCM Sampler: stochastic must be true or false, got {stochastic!r}.")


def seeded_noise_sampler(x: torch.Tensor, seed: int | None = None) -> Callable:
    """``noise(sigma, sigma_next)`` drawing the fresh noise of the stochastic steps for ``seed``.

    Inside ComfyUI this is ComfyUI's own ``comfy.k_diffusion.sampling.default_noise_sampler`` (what
    the built-in ``lcm`` sampler uses), so ``RCMSampler`` and ``lcm`` draw the same noise in every
    ComfyUI version. Without ComfyUI (tests, scripts) the fallback follows current ComfyUI: a CPU
    generator is seeded with ``seed + 1``, so its first draw is not the initial noise again (the
    initial noise is ``randn`` from ``seed``); other devices use ``seed``.
    """
    comfy_sampling = sys.modules.get("comfy.k_diffusion.sampling")
    if comfy_sampling is not None and hasattr(comfy_sampling, "default_noise_sampler"):
        return comfy_sampling.default_noise_sampler(x, seed=seed)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=x.device)
        generator.manual_seed(int(seed) + 1 if x.device.type == "cpu" else int(seed))

    def noise(sigma=None, sigma_next=None):
        return torch.randn(x.size(), dtype=x.dtype, layout=x.layout, device=x.device, generator=generator)

    return noise


@torch.no_grad()
def sample_rcm(
    model,
    x,
    sigmas,
    extra_args=None,
    callback=None,
    disable=None,
    noise_sampler=None,
    stochastic=True,
    time_input="float",
):
    """rCM few-step sampler (docs/math.md §2.1) over a denoiser ``model(x, sigma) -> x0``, k-diffusion signature.

    ``x`` arrives already noised to ``sigmas[0]`` (ComfyUI does ``r_0 noise + (1 - r_0) latent``).
    Each step asks the model for ``x0`` and moves with :func:`rcm_update`: stochastic (default)
    re-noises ``x0`` to the next RF time with fresh noise; deterministic is the Euler/ODE move.
    ``time_input="bf16"`` calls the model at ``s = bf16(1000 r) / 1000`` (the network then sees the official
    rounded time, as ``RCMScheduler(time_input="bf16")``) and re-anchors its ``x0 = x - s v`` at the exact
    ``r``: ``x0 = x - r v``; ``"float"`` calls it at ``r``.
    """
    extra_args = {} if extra_args is None else extra_args
    stochastic = check_stochastic(stochastic)
    if time_input not in TIME_INPUTS:
        raise ValueError(
            f"time_input must be one of {TIME_INPUTS} (the time the student was trained with), got {time_input!r}."
        )
    r = _checked_sigmas(sigmas)
    if stochastic and noise_sampler is None:
        noise_sampler = seeded_noise_sampler(x, extra_args.get("seed"))
    s_in = x.new_ones([x.shape[0]])
    steps = range(len(r) - 1)
    if not disable:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc="rCM", leave=False)
    for i in steps:
        r_cur, r_next = float(r[i]), float(r[i + 1])
        if time_input == "float":
            x0 = model(x, sigmas[i] * s_in, **extra_args)
        else:
            s = float(network_timestep(torch.tensor(r_cur, dtype=torch.float64), 1.0, time_input))
            x0_s = model(x, torch.full_like(s_in, s), **extra_args)
            x0 = (x.double() - (r_cur / s) * (x.double() - x0_s.double())).to(x0_s.dtype)  # v = (x - x0_s) / s
        if not torch.isfinite(x0).all():
            raise ValueError(
                f"rCM Sampler: the model output holds NaN or inf at step {i} (sigma={r_cur:.5f}); "
                "check the model and its inputs."
            )
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": x0})
        noise = noise_sampler(sigmas[i], sigmas[i + 1]) if stochastic and r_next > 0 else None
        x = rcm_update(x, x0, r_cur, r_next, noise=noise, stochastic=stochastic)
    return x


# ----------------------------------------------------------------------------- LoRA glue

#: ComfyUI model classes (``model_patcher.model``, comfy/model_base.py) -> LoRA families of the key converter
# (subclasses such as WAN22, WAN21_Vace, Chroma or HunyuanVideo15_SR_Distilled resolve through the MRO; Flux2
# subclasses Flux, and the MRO meets Flux2 first)
_COMFY_ARCH = {
    "WAN21": "wan",
    "Flux2": "flux2",
    "Flux": "flux",
    "QwenImage": "qwen_image",
    "HunyuanVideo15": "hunyuan_video15",
}
#: the family names messages use
ARCH_NAMES = {
    "wan": "Wan",
    "flux": "Flux",
    "flux2": "FLUX.2",
    "qwen_image": "Qwen-Image",
    "hunyuan_video15": "HunyuanVideo-1.5",
}
#: families whose LoRA the loader reads through :func:`rcm_diffusers.lora.io.load_comfyui_as_is` (keys named as
#: ComfyUI's LoRA key map takes them; FLUX.2's land on row slices of fused weights) and checks against that key map
KEY_MAP_FAMILIES = ("flux2", "qwen_image", "hunyuan_video15")
_ALL_NAMES = "Wan, Flux, FLUX.2, Qwen-Image and HunyuanVideo-1.5"


def model_arch(comfy_model) -> str:
    """The LoRA family of a ComfyUI BaseModel (``model_patcher.model``): "wan", "flux" (FLUX.1, Chroma), "flux2",
    "qwen_image" or "hunyuan_video15"; ValueError for anything else."""
    for cls in type(comfy_model).__mro__:
        if cls.__name__ in _COMFY_ARCH:
            return _COMFY_ARCH[cls.__name__]
    raise ValueError(
        f"RCMLoraLoader supports {_ALL_NAMES} models; this model is {type(comfy_model).__name__}. "
        "Use ComfyUI's LoraLoaderModelOnly for other architectures."
    )


def load_lora_file(path: str, arch: str) -> dict[str, torch.Tensor]:
    """Read a LoRA file into ComfyUI keys for a model of family ``arch`` (:func:`model_arch`).

    Wan and Flux layouts: diffusers/peft, ComfyUI (lora_up/down or lora_A/B, .alpha, .diff, .diff_b), LightX2V
    (``.diff_m``), Kijai (``.modulation.diff``), kohya/musubi (``lora_unet_*``), through the one key converter
    (:func:`rcm_diffusers.lora.io.load_lora`). FLUX.2, Qwen-Image and HunyuanVideo-1.5: diffusers/peft names (the
    trainer's export) or ``rcm-lora convert --format comfyui``'s file, through
    :func:`rcm_diffusers.lora.io.load_comfyui_as_is` (FLUX.2 and Qwen-Image keep the diffusers names ComfyUI's key map
    takes; HunyuanVideo-1.5 is renamed to ComfyUI's model names, q/k/v fused). Both restore alphas kept in a
    diffusers file's header; ``.safetensors`` or ``.pt`` (weights_only). Raises FileNotFoundError for a missing file,
    ValueError for an unreadable file, a LoRA of another family, or keys no rule maps (listed). A ValueError is one
    sentence, the problem and what to do, about "this LoRA" without its file name: the caller names the file once
    (the loader node: ``lora_name=...``).
    """
    from .lora import checkpoint as lora_checkpoint
    from .lora import io as lora_io
    from .lora import keys as lora_keys

    if not path or not os.path.isfile(path):
        raise FileNotFoundError(
            f"LoRA file not found: {path!r}; put the .safetensors file in ComfyUI's models/loras folder "
            "(or a folder listed under 'loras' in extra_model_paths.yaml) and refresh."
        )
    try:
        raw = lora_checkpoint.load_state_dict(path, unwrap=False)
    except ValueError as e:
        raise ValueError(f"cannot read LoRA file: {e}") from e
    if not raw:
        raise ValueError("the LoRA file holds no tensors; is it complete?")
    lora_arch = lora_keys.comfyui_as_is_family(raw)
    if lora_arch is None:
        try:
            lora_arch = lora_keys.detect_arch(raw)
        except ValueError as e:
            raise ValueError(
                f"not a LoRA of a family this loader takes: no key names a {_ALL_NAMES.replace(' and ', ' or ')} "
                f"layer (first keys: {sorted(raw)[:3]}); pick a LoRA made for the model."
            ) from e
    name, lora_name = ARCH_NAMES[arch], ARCH_NAMES[lora_arch]
    if lora_arch != arch:
        raise ValueError(
            f"this LoRA is for {lora_name} but the model is {name}; pick a {name} LoRA or connect a {lora_name} model."
        )
    try:
        if arch in KEY_MAP_FAMILIES:
            _, state_dict, _ = lora_io.load_comfyui_as_is(path)
        else:
            state_dict, _ = lora_io.load_lora(path, format="comfyui", arch=arch)
    except ValueError as e:
        layouts = (
            "diffusers or rcm-lora's ComfyUI file"
            if arch in KEY_MAP_FAMILIES
            else "diffusers, ComfyUI, LightX2V, Kijai or kohya"
        )
        raise ValueError(f"{e}; pick a {name} LoRA in a layout this loader reads ({layouts}).") from e
    return state_dict


def lora_key_map_problems(
    comfy_state_dict: dict[str, torch.Tensor], key_map: dict, shapes: dict[str, tuple[int, ...]]
) -> list[str]:
    """What keeps ComfyUI's key map from applying a LoRA whose keys it takes as written (a :data:`KEY_MAP_FAMILIES`
    file), one line each; empty when every module fits.

    ``key_map`` is ``comfy.lora.model_lora_keys_unet(model)``: LoRA module name -> model weight, or
    ``(weight, (dim, offset, size))`` for a slice of a fused weight (FLUX.2's q/k/v); ``shapes`` the model's logical
    weight shapes (:func:`model_weight_shapes`). Each module must be in the key map, be a lora_A/lora_B pair (with an
    optional ``.alpha``) of one rank, and its delta ``[out, in]`` must fit the weight or its slice.
    """
    groups: dict[str, dict[str, torch.Tensor]] = {}
    problems = []
    for key, v in comfy_state_dict.items():
        suffix = next((s for s in ("lora_A.weight", "lora_B.weight", "alpha") if key.endswith("." + s)), None)
        if suffix is None:
            problems.append(f"{key}: not a lora_A/lora_B factor or alpha")
            continue
        groups.setdefault(key[: -len(suffix) - 1], {})[suffix] = v
    for target, g in sorted(groups.items()):
        entry = key_map.get(target)
        if entry is None:
            problems.append(f"{target}: no weight of this model")
            continue
        weight, part = (entry, None) if isinstance(entry, str) else (entry[0], entry[1])
        w = shapes.get(weight.removeprefix("diffusion_model."))
        A, B = g.get("lora_A.weight"), g.get("lora_B.weight")
        if w is None:
            problems.append(f"{target}: no weight of this model")
        elif A is None or B is None:
            problems.append(f"{target}: lora_A without lora_B (or the reverse)")
        elif A.dim() < 2 or B.dim() < 2 or A.shape[0] != B.shape[1]:
            problems.append(f"{target}: lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)} are not one LoRA")
        else:
            rows = w[0] if part is None or part[0] != 0 else part[2]
            delta = (B.shape[0], math.prod(A.shape[1:]))
            if delta != (rows, math.prod(w[1:])):
                where = "" if part is None else f" rows {part[1]}:{part[1] + part[2]} of"
                problems.append(f"{target}: LoRA delta {delta} vs{where} weight {w}")
    return problems


def lora_targets_missing(comfy_state_dict: dict[str, torch.Tensor], key_map: dict) -> list[str]:
    """Targets of a ComfyUI-layout LoRA that ComfyUI's key map for the model does not know (sorted).

    ``key_map`` is ``comfy.lora.model_lora_keys_unet(model)``: LoRA target name -> model weight.
    """
    from .lora import keys as lora_keys

    missing = []
    for target in lora_keys.lora_modules(comfy_state_dict):
        name = "diffusion_model." + target
        if name not in key_map and f"{name}.weight" not in key_map:
            missing.append(target)
    return sorted(missing)


def split_parameter_patches(patches: dict) -> tuple[dict, dict]:
    """Split ComfyUI LoRA patches into module weight/bias patches and raw-parameter patches.

    Stock ComfyUI registers patches on raw parameters (Wan's ``blocks.N.modulation``,
    ``head.modulation``) but never applies them when it patches the model; the loader applies
    those as object patches instead. Keys are ComfyUI model paths (``diffusion_model....``).
    """
    module, raw = {}, {}
    for key, patch in patches.items():
        name = key[0] if isinstance(key, tuple) else key
        (module if str(name).endswith((".weight", ".bias")) else raw)[key] = patch
    return module, raw


def model_weight_shapes(diffusion_model) -> dict[str, tuple[int, ...]]:
    """Logical shapes of a ComfyUI diffusion model's parameters and buffers, by name: what a LoRA delta must match.

    ``state_dict()`` is no guide for quantized layers: ComfyUI stores them as their packed storage
    (NVFP4: uint8 ``[N, K/2]``, padded to 16; MXFP8: padded to 32) plus scales. The logical ``[N, K]``
    is the layer's ``_orig_shape`` (ComfyUI's quantized Linear records it), else the quantized tensor's
    own ``orig_shape`` parameter, else the parameter's shape (comfy-kitchen's QuantizedTensor reports the
    logical shape; FP8, INT8 and plain weights store it as it is).
    """
    shapes = {}
    modules = dict(diffusion_model.named_modules())
    for name, p in [*diffusion_model.named_parameters(), *diffusion_model.named_buffers()]:
        owner, _, leaf = name.rpartition(".")
        logical = getattr(modules.get(owner), "_orig_shape", None) if leaf == "weight" else None
        if logical is None:
            logical = getattr(getattr(p, "_params", None), "orig_shape", None)
        shapes[name] = tuple(int(d) for d in (logical if logical is not None else p.shape))
    return shapes


def check_lora_against_model(comfy_state_dict: dict[str, torch.Tensor], diffusion_model) -> None:
    """ValueError listing the LoRA targets that are missing from ``diffusion_model`` or do not fit its logical
    shapes."""
    from .lora import keys as lora_keys

    lora_keys.check_against_model(comfy_state_dict, model_weight_shapes(diffusion_model))


def resolve_lora_name(lora_name, folder_paths) -> str:
    """The file of ``lora_name`` in ComfyUI's ``loras`` list (``folder_paths``: ComfyUI's module of that name).

    Only names ComfyUI lists are accepted: a name outside the list (a raw path such as ``../../x``, a
    file removed since the list was read) is refused instead of being opened as a path.
    """
    names = folder_paths.get_filename_list("loras")
    path = folder_paths.get_full_path("loras", lora_name) if isinstance(lora_name, str) and lora_name in names else None
    if path is None:
        raise ValueError(
            f"rCM LoRA Loader: lora_name={lora_name!r} is not in ComfyUI's loras list ({len(names)} "
            "file(s)); put the file in models/loras, refresh and pick it from the list."
        )
    return path


#: key fragments that only Wan image-to-video models have (the CLIP image branch of Wan 2.1 I2V / FLF2V)
_I2V_KEYS = (
    ".k_img",
    ".v_img",
    ".norm_k_img",
    "img_emb.",
    "add_k_proj",
    "add_v_proj",
    "norm_added_k",
    "image_embedder",
)
_VARIANT_WORDS = {
    "i2v": ("i2v", "image-to-video", "image_to_video", "flf2v"),
    "t2v": ("t2v", "text-to-video", "text_to_video"),
}


def wan_lora_variant(keys, metadata: dict | None = None) -> tuple[str | None, str]:
    """``("i2v" | "t2v" | None, why)``: the Wan variant a LoRA file was made for, from its keys or header metadata.

    Keys of the image branch (``k_img``, ``v_img``, ``img_emb``; diffusers ``add_k_proj``...) say I2V;
    otherwise metadata values naming a variant (e.g. ``base_model: Wan2.1-I2V-14B``, kohya ``ss_base_model_version``)
    decide. ``None`` when neither tells (a Wan 2.2 I2V LoRA has no image-branch keys).
    """
    hits = sorted({k for k in keys if any(f in k for f in _I2V_KEYS)})
    if hits:
        return "i2v", f"its keys target the image branch of Wan I2V ({hits[0]}{', ...' if len(hits) > 1 else ''})"
    found = {}
    for key, value in (metadata or {}).items():
        text = str(value).lower()
        if len(text) > 2000:  # adapter configs and the like: too long to name a base model
            continue
        for variant, words in _VARIANT_WORDS.items():
            if any(w in text for w in words):
                found.setdefault(variant, f"its metadata says {key}={str(value)[:80]!r}")
    if len(found) == 1:
        return next(iter(found.items()))
    return None, ""


def wan_model_variant(diffusion_model) -> str | None:
    """ "i2v" or "t2v" for a ComfyUI Wan diffusion model from its input channels (16: T2V, 36: I2V), else None."""
    shapes = model_weight_shapes(diffusion_model)
    shape = shapes.get("patch_embedding.weight")
    if shape is None or len(shape) < 2:
        return None
    return {16: "t2v", 36: "i2v"}.get(shape[1])
