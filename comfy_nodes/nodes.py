"""rCM nodes for ComfyUI, declared once and built for either node API (see ``schema.py``).

Thin adapters: the logic is in ``rcm_diffusers.comfy``. Each node is a :class:`~.schema.Node`
(inputs, outputs, an ``execute`` function and an optional ``validate`` function that ComfyUI
calls when a workflow is queued, so bad widget values come back in ``/prompt``'s error response).
"""

from __future__ import annotations

from rcm_diffusers import comfy as rcm

from .schema import Input, Node, Output, Result

CATEGORY = "sampling/custom_sampling/rcm"
#: smallest sigma_max the widget takes: the node refuses sigma_max <= 0, and ComfyUI's range check is val < min
SIGMA_MAX_MIN = 0.01


def _check_model(model):
    if model is not None:
        rcm.check_flow_model_sampling(model.get_model_object("model_sampling"))


# ----------------------------------------------------------------------------- RCMSigmas


def _rcm_sigmas(steps, sigma_max, mid_t, model=None):
    _check_model(model)
    try:
        return (rcm.rcm_sigmas(steps, sigma_max, mid_t),)
    except ValueError as e:
        raise ValueError(f"rCM Sigmas: {e}") from None


def _rcm_sigmas_validate(cls, mid_t=None):
    # Only mid_t goes through this check: ComfyUI reports a failed validate once per input the function
    # takes, so taking steps and sigma_max as well would flag a bad mid_t three times (and steps first).
    # steps and sigma_max are refused by their widget ranges; a combination that does not fit (more steps
    # than angles, arctan(sigma_max) below the first angle) is one error when the node runs.
    if mid_t is None:  # a widget converted to an input arrives as None (its value is not known before the run)
        return True
    try:
        rcm.parse_mid_t(mid_t)
    except ValueError as e:
        return f"rCM Sigmas: {e}"
    return True


RCM_SIGMAS = Node(
    node_id="RCMSigmas",
    display_name="rCM Sigmas",
    category=f"{CATEGORY}/schedulers",
    description="SIGMAS (RF times) of the rCM few-step sampler: arctan(sigma_max), mid_t..., 0 as RF times. "
    "1-4 steps with the distilled angles 1.5, 1.4, 1.0; more steps need more angles in mid_t, "
    "which may also give other angles per step count.",
    inputs=[
        Input(
            "INT",
            "steps",
            default=4,
            min=1,
            max=8,
            tooltip="1 to 4 with the default mid_t (the angles rCM was distilled at); n steps need n-1 angles.",
        ),
        Input(
            "FLOAT",
            "sigma_max",
            default=80.0,
            min=SIGMA_MAX_MIN,
            max=100000.0,
            step=0.5,
            round=False,
            tooltip=f"Start noise on the EDM scale, at least {SIGMA_MAX_MIN}: 80 for Wan T2V, 200 for Wan I2V; "
            "arctan(sigma_max) must exceed the first mid_t angle.",
        ),
        Input(
            "STRING",
            "mid_t",
            default=rcm.DEFAULT_MID_T_TEXT,
            tooltip="Intermediate TrigFlow angles, strictly decreasing, inside (0, pi/2): one list for every step "
            "count (n steps take the first n-1), or per step count as 'steps: angles' entries separated "
            f"by semicolons, e.g. '{rcm.PER_STEP_MID_T_EXAMPLE}' (n steps take the entry for n, else the "
            "one for the next larger count, cut to n-1 angles).",
        ),
        Input("MODEL", "model", optional=True, tooltip="Optional: checks that the model is a flow model (Wan, Flux)."),
    ],
    outputs=[
        Output(
            "SIGMAS",
            tooltip="steps + 1 RF times from arctan(sigma_max) down to 0, for a SamplerCustom "
            "or SamplerCustomAdvanced with rCM Sampler.",
        )
    ],
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
        Input("INT", "steps", default=50, min=1, max=10000, tooltip="Teacher steps (Wan: 50)."),
        Input(
            "FLOAT",
            "sigma_max",
            default=5000.0,
            min=0.01,
            max=1e7,
            step=1.0,
            round=False,
            tooltip="Start noise on the EDM scale; the grid starts at sigma_max / (1 + sigma_max).",
        ),
        Input(
            "COMBO",
            "spacing",
            options=list(rcm.SPACINGS),
            default="linear",
            tooltip="linear: uniform in the shifted RF time; karras / exponential: in the EDM sigma.",
        ),
        Input(
            "FLOAT",
            "shift",
            default=1.0,
            min=0.01,
            max=100.0,
            step=0.1,
            round=False,
            tooltip="Time shift for linear spacing (Wan 480p: 3 to 5).",
        ),
        Input("FLOAT", "rho", default=7.0, min=0.01, max=100.0, step=0.1, round=False, tooltip="Karras rho."),
        Input(
            "FLOAT",
            "sigma_min",
            default=0.002,
            min=1e-6,
            max=1000.0,
            step=0.001,
            round=False,
            tooltip="Karras/exponential end noise (EDM scale).",
        ),
        Input("MODEL", "model", optional=True, tooltip="Optional: checks that the model is a flow model (Wan, Flux)."),
    ],
    outputs=[Output("SIGMAS", tooltip="steps + 1 RF times ending at 0, for the teacher with euler or uni_pc.")],
    execute=_teacher_sigmas,
)


# ----------------------------------------------------------------------------- RCMSampler


def _rcm_sampler_options(stochastic, time_input="bf16"):
    """``sample_rcm``'s keyword options for the widget values (ValueError for an unknown ``time_input``)."""
    if time_input not in rcm.TIME_INPUTS:
        raise ValueError(
            f"rCM Sampler: time_input={time_input!r}; use one of {list(rcm.TIME_INPUTS)} "
            "(the time the student was trained with)."
        )
    return {"stochastic": rcm.check_stochastic(stochastic), "time_input": time_input}


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
        Input(
            "BOOLEAN",
            "stochastic",
            default=True,
            label_on="stochastic",
            label_off="deterministic (ode)",
            tooltip="Stochastic re-noising is the rCM default; deterministic takes Euler steps. An API prompt sends "
            "JSON true or false: ComfyUI turns any other value into a bool before the node runs (the "
            'string "false" into true).',
        ),
        Input(
            "COMBO",
            "time_input",
            options=list(rcm.TIME_INPUTS),
            default="bf16",
            optional=True,
            tooltip="The time the model is called at. bf16: 1000*sigma rounded to bfloat16, the time official rCM "
            "checkpoints and training/rcm.py (default time_input: bf16) were trained with; the step itself "
            "stays at the exact sigma. float: the exact sigma (what ComfyUI's built-in lcm sampler feeds); "
            "use it for students trained with time_input: float, e.g. the digits demo. "
            "Optional, so API prompts written before the widget existed still run (with bf16).",
        ),
    ],
    outputs=[Output("SAMPLER", tooltip="The rCM sampler, for SamplerCustom or SamplerCustomAdvanced with rCM Sigmas.")],
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
        Input("SIGMAS", "sigmas", tooltip="The schedule to split, e.g. rCM Sigmas with sigma_max 200 (I2V)."),
        Input(
            "FLOAT",
            "boundary",
            default=rcm.WAN22_BOUNDARY,
            min=0.001,
            max=0.999,
            step=0.005,
            round=False,
            tooltip="0.9 for Wan 2.2 I2V, 0.875 for T2V.",
        ),
    ],
    outputs=[
        Output(
            "SIGMAS",
            "high_noise_sigmas",
            tooltip="The first steps, down to the switch sigma: sample them with the high-noise expert.",
        ),
        Output(
            "SIGMAS",
            "low_noise_sigmas",
            tooltip="The rest, from the switch sigma to 0: the low-noise expert, "
            "chained after the high-noise sampler with DisableNoise.",
        ),
    ],
    execute=_expert_split,
)


# ----------------------------------------------------------------------------- RCMLoraLoader


def _lora_names():
    import folder_paths

    return folder_paths.get_filename_list("loras")


def _lora_loader(model, lora_name, strength_model):
    """The patched model; with a Wan variant warning (an I2V LoRA on a T2V model or the reverse) a :class:`Result`
    whose text shows the warning on the node (it also goes to ComfyUI's log, as before)."""
    import logging

    import folder_paths

    path = rcm.resolve_lora_name(lora_name, folder_paths)  # only names ComfyUI lists, never a raw path
    arch = rcm.model_arch(model.model)
    diffusion_model = model.model.diffusion_model
    where = (
        f"rCM LoRA Loader, lora_name={lora_name!r}"  # every message names the file once, then one problem and its fix
    )
    try:
        lora = rcm.load_lora_file(path, arch)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    if arch in rcm.KEY_MAP_FAMILIES:
        # FLUX.2, Qwen-Image, HunyuanVideo-1.5: the names ComfyUI's key map takes, each module against the logical
        # shape of the weight (or the row slice of a fused weight) it lands on
        import comfy.lora

        key_map = comfy.lora.model_lora_keys_unet(model.model, {})
        problems = rcm.lora_key_map_problems(lora, key_map, rcm.model_weight_shapes(diffusion_model))
        if problems:
            raise ValueError(
                f"{where}: {len(problems)} LoRA module(s) do not match this {rcm.ARCH_NAMES[arch]} model: "
                f"{'; '.join(problems[:20])}; pick a LoRA made for this model size and variant."
            )
    else:
        try:
            # names and logical shapes against the model's own weights (quantized layers included), then ComfyUI's
            # key map
            rcm.check_lora_against_model(lora, diffusion_model)
        except ValueError as e:
            raise ValueError(f"{where}: {e}; pick a LoRA made for this model size and variant.") from e
    warning = _wan_variant_warning(path, lora_name, diffusion_model) if arch == "wan" else None
    if warning:
        logging.warning(warning)
    patched = _apply_lora(model, lora, arch, strength_model, where)
    return (patched,) if warning is None else Result((patched,), (warning,))


def _apply_lora(model, lora, arch, strength_model, where):
    import comfy.lora
    import comfy.utils
    import torch

    key_map = comfy.lora.model_lora_keys_unet(model.model, {})
    missing = [] if arch in rcm.KEY_MAP_FAMILIES else rcm.lora_targets_missing(lora, key_map)  # checked before
    if missing:
        raise ValueError(
            f"{where}: {len(missing)} LoRA target(s) have no weight in this {rcm.ARCH_NAMES[arch]} model: "
            f"{missing[:20]}; pick a LoRA made for this model size and variant."
        )
    patches = comfy.lora.load_lora(lora, key_map)
    if strength_model == 0 or not patches:
        return model
    patched = model.clone()
    module_patches, raw_patches = rcm.split_parameter_patches(patches)
    applied = set(patched.add_patches(module_patches, strength_model))
    not_applied = sorted(str(k) for k in module_patches if k not in applied)
    if not_applied:
        raise ValueError(f"{where}: ComfyUI did not apply {len(not_applied)} patch(es): {not_applied[:20]}.")
    # raw parameters (Wan modulation): ComfyUI registers but never applies these patches; swap in
    # the patched parameter as an object patch instead (the shared base model stays untouched)
    for key, patch in raw_patches.items():
        base = comfy.utils.get_attr(model.model, key)
        new = comfy.lora.calculate_weight(
            [(strength_model, patch, 1.0, None, None)], base.detach().to(torch.float32, copy=True), key
        )
        patched.add_object_patch(key, torch.nn.Parameter(new.to(base.dtype), requires_grad=False))
    return patched


def _wan_variant_warning(path, lora_name, diffusion_model):
    """The warning for a Wan LoRA made for I2V on a T2V model or the other way round (None when fine or unknown)."""
    from rcm_diffusers.lora import checkpoint as lora_checkpoint

    model_variant = rcm.wan_model_variant(diffusion_model)
    if str(path).endswith(".safetensors"):  # the header only: names and metadata, no tensor read
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            keys, metadata = list(f.keys()), dict(f.metadata() or {})
    else:
        keys, metadata = list(lora_checkpoint.load_state_dict(path, unwrap=False)), {}
    lora_variant, why = rcm.wan_lora_variant(keys, metadata)
    if model_variant is None or lora_variant is None or lora_variant == model_variant:
        return None
    wanted = model_variant.upper()
    return (
        f"rCM LoRA Loader, lora_name={lora_name!r}: this LoRA was made for Wan {lora_variant.upper()} ({why}) but "
        f"the model is Wan {wanted}; the shapes fit, so it is applied, but pick "
        f"{'an' if wanted[0] in 'AEIOU' else 'a'} "
        f"{wanted} LoRA unless this is intended."
    )


LORA_LOADER = Node(
    node_id="RCMLoraLoader",
    display_name="rCM LoRA Loader",
    category="loaders",
    description="Apply a Wan, Flux, FLUX.2, Qwen-Image or HunyuanVideo-1.5 LoRA (Wan and Flux: diffusers, ComfyUI, "
    "LightX2V, Kijai or kohya layout, modulation deltas included; FLUX.2, Qwen-Image and HunyuanVideo-1.5: the "
    "trainer's diffusers file or its rcm-lora ComfyUI file); fails, listing them, when keys do not match the model "
    "instead of skipping them, and refuses a LoRA made for another family.",
    inputs=[
        Input(
            "MODEL",
            "model",
            tooltip="A Wan, Flux, FLUX.2, Qwen-Image or HunyuanVideo-1.5 diffusion model (Load Diffusion Model); "
            "quantized files (NVFP4, FP8, INT8, MXFP8) too.",
        ),
        Input(
            "COMBO",
            "lora_name",
            options=_lora_names,
            tooltip="A LoRA file from models/loras, of the model's family: Wan and Flux in diffusers, ComfyUI, "
            "LightX2V, Kijai or kohya layout; FLUX.2, Qwen-Image and HunyuanVideo-1.5 in diffusers names (as the "
            "trainer saves them) or as rcm-lora convert --format comfyui writes them.",
        ),
        Input(
            "FLOAT",
            "strength_model",
            default=1.0,
            min=-100.0,
            max=100.0,
            step=0.01,
            tooltip="LoRA scale; 1.0 for rCM LoRAs (0 returns the model unchanged).",
        ),
    ],
    outputs=[Output("MODEL", tooltip="The model with the LoRA applied (the input model is left unchanged).")],
    execute=_lora_loader,
    shows_text=True,  # the I2V / T2V mismatch warning, on the node
)


NODES = [RCM_SIGMAS, RCM_SAMPLER, TEACHER_SIGMAS, LORA_LOADER, EXPERT_SPLIT]
