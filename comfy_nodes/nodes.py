"""rCM nodes for ComfyUI (new node schema). Thin adapters: the logic is in ``rcm_diffusers.comfy``."""

from __future__ import annotations

import comfy.lora
import comfy.samplers
import comfy.utils
import folder_paths
import torch
from comfy_api.latest import io

from rcm_diffusers import comfy as rcm
from rcm_diffusers.lora import keys as lora_keys

CATEGORY = "sampling/custom_sampling/rcm"


def _check_model(model):
    if model is not None:
        rcm.check_flow_model_sampling(model.get_model_object("model_sampling"))


class RCMSigmas(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="RCMSigmas",
            display_name="rCM Sigmas",
            category=f"{CATEGORY}/schedulers",
            description="SIGMAS (RF times) of the rCM few-step sampler: arctan(sigma_max), mid_t..., 0 as RF times.",
            inputs=[
                io.Int.Input("steps", default=4, min=1, max=8, tooltip="1 to 4 with the default mid_t (more needs more angles)."),
                io.Float.Input("sigma_max", default=80.0, min=0.01, max=100000.0, step=0.5, round=False,
                               tooltip="Start noise on the EDM scale: 80 for Wan T2V, 200 for Wan I2V."),
                io.String.Input("mid_t", default=rcm.DEFAULT_MID_T_TEXT,
                                tooltip="Intermediate TrigFlow angles, strictly decreasing, inside (0, pi/2)."),
                io.Model.Input("model", optional=True, tooltip="Optional: checks that the model is a flow model (Wan, Flux)."),
            ],
            outputs=[io.Sigmas.Output()],
        )

    @classmethod
    def execute(cls, steps, sigma_max, mid_t, model=None) -> io.NodeOutput:
        _check_model(model)
        return io.NodeOutput(rcm.rcm_sigmas(steps, sigma_max, mid_t))


class TrigFlowTeacherSigmas(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="TrigFlowTeacherSigmas",
            display_name="TrigFlow Teacher Sigmas",
            category=f"{CATEGORY}/schedulers",
            description="Full-step teacher grid from sigma_max/(1+sigma_max) to 0, for reference sampling with Euler/UniPC.",
            inputs=[
                io.Int.Input("steps", default=50, min=1, max=10000),
                io.Float.Input("sigma_max", default=5000.0, min=0.01, max=1e7, step=1.0, round=False),
                io.Combo.Input("spacing", options=list(rcm.SPACINGS), default="linear"),
                io.Float.Input("shift", default=1.0, min=0.01, max=100.0, step=0.1, round=False,
                               tooltip="Time shift for linear spacing (Wan 480p: 3 to 5)."),
                io.Float.Input("rho", default=7.0, min=0.01, max=100.0, step=0.1, round=False, tooltip="Karras rho."),
                io.Float.Input("sigma_min", default=0.002, min=1e-6, max=1000.0, step=0.001, round=False,
                               tooltip="Karras/exponential end noise (EDM scale)."),
                io.Model.Input("model", optional=True),
            ],
            outputs=[io.Sigmas.Output()],
        )

    @classmethod
    def execute(cls, steps, sigma_max, spacing, shift, rho, sigma_min, model=None) -> io.NodeOutput:
        _check_model(model)
        return io.NodeOutput(rcm.teacher_sigmas(steps, sigma_max, spacing, shift=shift, rho=rho, sigma_min=sigma_min))


class RCMSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="RCMSampler",
            display_name="rCM Sampler",
            category=f"{CATEGORY}/samplers",
            description="rCM consistency sampler: x0 from the model, then re-noise to the next sigma (noise from the seed).",
            inputs=[
                io.Boolean.Input("stochastic", default=True, label_on="stochastic", label_off="deterministic (ode)",
                                 tooltip="Stochastic re-noising is the rCM default; deterministic takes Euler steps."),
            ],
            outputs=[io.Sampler.Output()],
        )

    @classmethod
    def execute(cls, stochastic) -> io.NodeOutput:
        return io.NodeOutput(comfy.samplers.KSAMPLER(rcm.sample_rcm, extra_options={"stochastic": bool(stochastic)}))


class RCMExpertSplit(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="RCMExpertSplit",
            display_name="rCM Expert Split (Wan 2.2)",
            category=f"{CATEGORY}/schedulers",
            description="Split SIGMAS at the Wan 2.2 A14B expert boundary: steps starting at sigma >= boundary go to the "
                        "high-noise expert; chain the low-noise sampler after it (no added noise).",
            inputs=[
                io.Sigmas.Input("sigmas"),
                io.Float.Input("boundary", default=rcm.WAN22_BOUNDARY, min=0.001, max=0.999, step=0.005, round=False,
                               tooltip="0.9 for Wan 2.2 I2V, 0.875 for T2V."),
            ],
            outputs=[io.Sigmas.Output(display_name="high_noise_sigmas"), io.Sigmas.Output(display_name="low_noise_sigmas")],
        )

    @classmethod
    def execute(cls, sigmas, boundary) -> io.NodeOutput:
        return io.NodeOutput(*rcm.split_sigmas_at_boundary(sigmas, boundary))


class RCMLoraLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="RCMLoraLoader",
            display_name="rCM LoRA Loader",
            category="loaders",
            description="Apply a Wan or Flux LoRA (diffusers, ComfyUI, LightX2V, Kijai or kohya layout; modulation "
                        "deltas included); fails, listing them, when keys do not match the model instead of skipping them.",
            inputs=[
                io.Model.Input("model"),
                io.Combo.Input("lora_name", options=folder_paths.get_filename_list("loras")),
                io.Float.Input("strength_model", default=1.0, min=-100.0, max=100.0, step=0.01),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, lora_name, strength_model) -> io.NodeOutput:
        path = folder_paths.get_full_path("loras", lora_name)
        arch = rcm.model_arch(model.model)
        lora = rcm.load_lora_file(path if path is not None else lora_name, arch)
        # names and shapes against the model's own weights, then against ComfyUI's key map
        lora_keys.check_against_model(lora, model.model.diffusion_model.state_dict())
        key_map = comfy.lora.model_lora_keys_unet(model.model, {})
        missing = rcm.lora_targets_missing(lora, key_map)
        if missing:
            raise ValueError(f"{lora_name}: {len(missing)} LoRA target(s) have no weight in this {arch} model: "
                             f"{missing[:20]}; is it a LoRA for this model size and variant?")
        patches = comfy.lora.load_lora(lora, key_map)
        if strength_model == 0 or not patches:
            return io.NodeOutput(model)
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
        return io.NodeOutput(patched)


NODES = [RCMSigmas, RCMSampler, TrigFlowTeacherSigmas, RCMLoraLoader, RCMExpertSplit]
