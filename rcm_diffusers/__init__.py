"""rcm-diffusers: rCM few-step sampling and distillation for diffusers and ComfyUI.

Top-level names are imported lazily so that ``import rcm_diffusers`` stays cheap
(ComfyUI imports the package at start-up) while ``DiffusionPipeline.from_pretrained``
still finds ``rcm_diffusers.RCMScheduler`` through ``getattr``.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "RCMScheduler": "rcm_diffusers.schedulers",
    "TrigFlowEulerScheduler": "rcm_diffusers.schedulers",
    "TrigFlowUniPCScheduler": "rcm_diffusers.schedulers",
    "rcm_rf_times": "rcm_diffusers.sampling",
    "teacher_rf_grid": "rcm_diffusers.sampling",
    "TrigFlowDenoiser": "rcm_diffusers.trigflow",
    "denoiser": "rcm_diffusers.models",
    "enable_jvp_attention": "rcm_diffusers.attention",
    "disable_jvp_attention": "rcm_diffusers.attention",
    "jvp_attention": "rcm_diffusers.attention",
    "save_lora": "rcm_diffusers.lora.io",
    "load_lora": "rcm_diffusers.lora.io",
    "to_comfy_keys": "rcm_diffusers.lora",
    "from_any": "rcm_diffusers.lora",
    "extract_lora": "rcm_diffusers.lora.extract",
    "load_full_lora": "rcm_diffusers.lora.pipeline",
    "load_rcm_lora": "rcm_diffusers.lora.pipeline",
}

__all__ = sorted(_LAZY) + ["__version__"]

# DiffusionPipeline.from_pretrained resolves a component declared as ["rcm_diffusers", "RCMScheduler"]
# by looking up the diffusers base classes *in this package* to pick the loading method.
_LAZY.update({"SchedulerMixin": "diffusers", "ModelMixin": "diffusers"})


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rcm_diffusers' has no attribute {name!r}")


def __dir__():
    return __all__
