"""rCM nodes for ComfyUI, declared once and built for either node API (see ``schema.py``).

Thin adapters: the logic is in ``rcm_diffusers.comfy``. Each node is a :class:`~.schema.Node`
(inputs, outputs, an ``execute`` function and an optional ``validate`` function that ComfyUI
calls when a workflow is queued, so bad widget values come back in ``/prompt``'s error response).
"""

from __future__ import annotations

from rcm_diffusers import comfy as rcm

from .schema import Input, Node, Output

CATEGORY = "sampling/custom_sampling/rcm"


def _check_model(model):
    if model is not None:
        rcm.check_flow_model_sampling(model.get_model_object("model_sampling"))


# ----------------------------------------------------------------------------- RCMSigmas


def _rcm_sigmas(steps, sigma_max, mid_t, model=None):
    _check_model(model)
    return (rcm.rcm_sigmas(steps, sigma_max, mid_t),)


def _rcm_sigmas_validate(cls, steps=None, sigma_max=None, mid_t=None):
    # a widget converted to an input arrives as None here (its value is not known before the run)
    if steps is None or sigma_max is None or mid_t is None:
        return True
    error = rcm.check_rcm_sigmas_widgets(steps, sigma_max, mid_t)
    return True if error is None else f"rCM Sigmas: {error}"


RCM_SIGMAS = Node(
    node_id="RCMSigmas",
    display_name="rCM Sigmas",
    category=f"{CATEGORY}/schedulers",
    description="SIGMAS (RF times) of the rCM few-step sampler: arctan(sigma_max), mid_t..., 0 as RF times. "
                "1-4 steps with the distilled angles 1.5, 1.4, 1.0; more steps need more angles in mid_t.",
    inputs=[
        Input("INT", "steps", default=4, min=1, max=8,
              tooltip="1 to 4 with the default mid_t (the angles rCM was distilled at); n steps need n-1 angles."),
        Input("FLOAT", "sigma_max", default=80.0, min=0.0, max=100000.0, step=0.5, round=False,
              tooltip="Start noise on the EDM scale, > 0: 80 for Wan T2V, 200 for Wan I2V."),
        Input("STRING", "mid_t", default=rcm.DEFAULT_MID_T_TEXT,
              tooltip="Intermediate TrigFlow angles, strictly decreasing, inside (0, pi/2)."),
        Input("MODEL", "model", optional=True, tooltip="Optional: checks that the model is a flow model (Wan, Flux)."),
    ],
    outputs=[Output("SIGMAS")],
    execute=_rcm_sigmas,
    validate=_rcm_sigmas_validate,
)


# ----------------------------------------------------------------------------- TrigFlowTeacherSigmas


def _teacher_sigmas(steps, sigma_max, spacing, shift, rho, sigma_min, model=None):
    _check_model(model)
    return (rcm.teacher_sigmas(steps, sigma_max, spacing, shift=shift, rho=rho, sigma_min=sigma_min),)


TEACHER_SIGMAS = Node(
    node_id="TrigFlowTeacherSigmas",
    display_name="TrigFlow Teacher Sigmas",
    category=f"{CATEGORY}/schedulers",
    description="Full-step teacher grid from sigma_max/(1+sigma_max) to 0, for reference sampling with Euler/UniPC.",
    inputs=[
        Input("INT", "steps", default=50, min=1, max=10000),
        Input("FLOAT", "sigma_max", default=5000.0, min=0.01, max=1e7, step=1.0, round=False),
        Input("COMBO", "spacing", options=list(rcm.SPACINGS), default="linear"),
        Input("FLOAT", "shift", default=1.0, min=0.01, max=100.0, step=0.1, round=False,
              tooltip="Time shift for linear spacing (Wan 480p: 3 to 5)."),
        Input("FLOAT", "rho", default=7.0, min=0.01, max=100.0, step=0.1, round=False, tooltip="Karras rho."),
        Input("FLOAT", "sigma_min", default=0.002, min=1e-6, max=1000.0, step=0.001, round=False,
              tooltip="Karras/exponential end noise (EDM scale)."),
        Input("MODEL", "model", optional=True),
    ],
    outputs=[Output("SIGMAS")],
    execute=_teacher_sigmas,
)


# ----------------------------------------------------------------------------- RCMSampler


def _rcm_sampler_options(stochastic, time_input="bf16"):
    """``sample_rcm``'s keyword options for the widget values (ValueError for an unknown ``time_input``)."""
    if time_input not in rcm.TIME_INPUTS:
        raise ValueError(f"rCM Sampler: time_input={time_input!r}; use one of {list(rcm.TIME_INPUTS)} "
                         "(the time the student was trained with).")
    return {"stochastic": bool(stochastic), "time_input": time_input}


def _rcm_sampler(stochastic, time_input="bf16"):
    import comfy.samplers

    return (comfy.samplers.KSAMPLER(rcm.sample_rcm, extra_options=_rcm_sampler_options(stochastic, time_input)),)


RCM_SAMPLER = Node(
    node_id="RCMSampler",
    display_name="rCM Sampler",
    category=f"{CATEGORY}/samplers",
    description="rCM consistency sampler: x0 from the model, then re-noise to the next sigma with ComfyUI's own "
                "seeded noise (the same draws as the built-in lcm sampler; with time_input float, the same sample).",
    inputs=[
        Input("BOOLEAN", "stochastic", default=True, label_on="stochastic", label_off="deterministic (ode)",
              tooltip="Stochastic re-noising is the rCM default; deterministic takes Euler steps."),
        Input("COMBO", "time_input", options=list(rcm.TIME_INPUTS), default="bf16", optional=True,
              tooltip="The time the model is called at. bf16: 1000*sigma rounded to bfloat16, the time official rCM "
                      "checkpoints and training/rcm.py (default time_input: bf16) were trained with; the step itself "
                      "stays at the exact sigma. float: the exact sigma (what ComfyUI's built-in lcm sampler feeds); "
                      "use it for students trained with time_input: float, e.g. the digits demo. "
                      "Optional, so API prompts written before the widget existed still run (with bf16)."),
    ],
    outputs=[Output("SAMPLER")],
    execute=_rcm_sampler,
)


# ----------------------------------------------------------------------------- RCMExpertSplit


def _expert_split(sigmas, boundary):
    return rcm.split_sigmas_at_boundary(sigmas, boundary)


EXPERT_SPLIT = Node(
    node_id="RCMExpertSplit",
    display_name="rCM Expert Split (Wan 2.2)",
    category=f"{CATEGORY}/schedulers",
    description="Split SIGMAS at the Wan 2.2 A14B expert boundary: steps starting at sigma >= boundary go to the "
                "high-noise expert; chain the low-noise sampler after it (no added noise).",
    inputs=[
        Input("SIGMAS", "sigmas"),
        Input("FLOAT", "boundary", default=rcm.WAN22_BOUNDARY, min=0.001, max=0.999, step=0.005, round=False,
              tooltip="0.9 for Wan 2.2 I2V, 0.875 for T2V."),
    ],
    outputs=[Output("SIGMAS", "high_noise_sigmas"), Output("SIGMAS", "low_noise_sigmas")],
    execute=_expert_split,
)


# ----------------------------------------------------------------------------- RCMLoraLoader


def _lora_names():
    import folder_paths

    return folder_paths.get_filename_list("loras")


def _lora_loader(model, lora_name, strength_model):
    import comfy.lora
    import comfy.utils
    import folder_paths
    import torch

    from rcm_diffusers.lora import keys as lora_keys

    path = folder_paths.get_full_path("loras", lora_name)
    arch = rcm.model_arch(model.model)
    try:
        lora = rcm.load_lora_file(path if path is not None else lora_name, arch)
        # names and shapes against the model's own weights, then against ComfyUI's key map
        lora_keys.check_against_model(lora, model.model.diffusion_model.state_dict())
    except ValueError as e:
        raise ValueError(f"rCM LoRA Loader, lora_name={lora_name!r}: {e} Pick a LoRA made for this model.") from e
    key_map = comfy.lora.model_lora_keys_unet(model.model, {})
    missing = rcm.lora_targets_missing(lora, key_map)
    if missing:
        raise ValueError(f"rCM LoRA Loader, lora_name={lora_name!r}: {len(missing)} LoRA target(s) have no weight in "
                         f"this {arch} model: {missing[:20]}; pick a LoRA for this model size and variant.")
    patches = comfy.lora.load_lora(lora, key_map)
    if strength_model == 0 or not patches:
        return (model,)
    patched = model.clone()
    module_patches, raw_patches = rcm.split_parameter_patches(patches)
    applied = set(patched.add_patches(module_patches, strength_model))
    not_applied = sorted(str(k) for k in module_patches if k not in applied)
    if not_applied:
        raise ValueError(f"{lora_name}: ComfyUI did not apply {len(not_applied)} patch(es): {not_applied[:20]}.")
    # raw parameters (Wan modulation): ComfyUI registers but never applies these patches; swap in
    # the patched parameter as an object patch instead (the shared base model stays untouched)
    for key, patch in raw_patches.items():
        base = comfy.utils.get_attr(model.model, key)
        new = comfy.lora.calculate_weight([(strength_model, patch, 1.0, None, None)],
                                          base.detach().to(torch.float32, copy=True), key)
        patched.add_object_patch(key, torch.nn.Parameter(new.to(base.dtype), requires_grad=False))
    return (patched,)


LORA_LOADER = Node(
    node_id="RCMLoraLoader",
    display_name="rCM LoRA Loader",
    category="loaders",
    description="Apply a Wan or Flux LoRA (diffusers, ComfyUI, LightX2V, Kijai or kohya layout; modulation "
                "deltas included); fails, listing them, when keys do not match the model instead of skipping them.",
    inputs=[
        Input("MODEL", "model"),
        Input("COMBO", "lora_name", options=_lora_names),
        Input("FLOAT", "strength_model", default=1.0, min=-100.0, max=100.0, step=0.01),
    ],
    outputs=[Output("MODEL")],
    execute=_lora_loader,
)


NODES = [RCM_SIGMAS, RCM_SAMPLER, TEACHER_SIGMAS, LORA_LOADER, EXPERT_SPLIT]
