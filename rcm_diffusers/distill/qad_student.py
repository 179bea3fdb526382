"""The pieces of the QAD run (docs/math.md §7) that ``training/qad.py`` strings together: the teacher (a base
model, or an rCM student LoRA fused into it), the quantized student in scope ``all`` or ``lora``,
training times, activation calibration, a fixed-seed distillation probe and the exports.

``rcm_diffusers.distill.qad_trainer.QADTrainer`` runs them inside the run session shared with the rCM trainer.
"""

from __future__ import annotations

import copy
import os

import torch

from ..models import _base_model, compute_dtype, velocity_fn
from ..quant.modules import DEFAULT_EXCLUDE, calibration, quantize_transformer
from .data import batch_indices, model_inputs
from .qad import GuidanceSchedule, qad_loss

__all__ = [
    "fuse_lora_file",
    "build_student",
    "training_times",
    "fixed_batches",
    "calibrate",
    "distill_probe",
    "export_student",
    "trainable",
    "ema_student",
    "full_delta",
    "save_full_delta",
    "save_qad_lora",
    "arch_of",
]


def arch_of(transformer) -> str:
    """``"wan"`` or ``"flux"`` from the transformer class name."""
    name = type(_base_model(transformer)).__name__
    if name.startswith("Wan"):
        return "wan"
    if name.startswith("Flux"):
        return "flux"
    raise ValueError(f"QAD supports Wan and Flux transformers, got {name}")


def fuse_lora_file(transformer, path: str) -> None:
    """Fuse a diffusers-format LoRA (a ``training/rcm.py`` output dir or a ``.safetensors`` file) into
    ``transformer``'s weights in place: ``W <- W + (alpha / r) B A`` (an rCM student as QAD teacher)."""
    if os.path.isdir(path):
        path = os.path.join(path, "pytorch_lora_weights.safetensors")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"teacher_lora: no LoRA file at {path}")
    transformer.load_lora_adapter(path, prefix="transformer", adapter_name="teacher_lora")
    transformer.fuse_lora(adapter_names=["teacher_lora"])
    transformer.unload_lora()


def build_student(teacher, cfg):
    """Quantized student initialised from ``teacher`` (docs/math.md §7); returns ``(student, {name: QuantLinear})``.

    The arithmetic is ``cfg.resolved_target`` (``comfyui``: what ComfyUI runs for the format; ``fake``:
    ``format`` / ``act_format`` as given). Scope ``all``: a full copy whose every weight trains through the fake
    quantizer. Scope ``lora``: the frozen quantized base shares the teacher's weight tensors (no copy) and a peft
    adapter ``"student"`` (rank ``lora_rank``) on top trains in the weight dtype.
    """
    if cfg.scope == "lora":
        student = copy.deepcopy(teacher, memo={id(p): p for p in teacher.parameters()})
    else:
        student = copy.deepcopy(teacher)
    layers = quantize_transformer(
        student,
        cfg.format,
        act_fmt=cfg.act_format or None,
        per_channel=cfg.per_channel if cfg.format == "fp8_e4m3" else None,
        exclude=DEFAULT_EXCLUDE,
        extra_exclude=tuple(cfg.exclude),
        overrides=cfg.quant_overrides(),
        target=cfg.resolved_target(arch_of(teacher)),
        act_scale=cfg.act_scale,
    )
    if cfg.scope == "all":
        student.requires_grad_(True)
        return student, layers
    from peft import LoraConfig

    from .adapters import default_lora_targets

    student.requires_grad_(False)
    targets = list(cfg.lora_target_modules or default_lora_targets(student))
    names = [n for n, _ in student.named_modules()]
    targets = [t for t in targets if any(n == t or n.endswith("." + t) for n in names)]
    student.add_adapter(
        LoraConfig(
            r=cfg.lora_rank, lora_alpha=cfg.lora_alpha or cfg.lora_rank, target_modules=targets, init_lora_weights=True
        ),
        adapter_name="student",
    )
    for n, p in student.named_parameters():
        p.requires_grad_(".student." in n)
    return student, layers


def training_times(cfg) -> list[float] | None:
    """``None`` (shifted uniform r) or the rCM student's ``rcm_steps`` sampling times ``r_k > 0``
    (docs/math.md §2.1)."""
    if cfg.r_source != "rcm":
        return None
    from ..sampling import DEFAULT_MID_T
    from ..schedulers import RCMScheduler

    sch = RCMScheduler(sigma_max=cfg.sigma_max, mid_t=cfg.mid_t or DEFAULT_MID_T)
    sch.set_timesteps(cfg.rcm_steps)
    return [float(r) for r in sch.rf_times if r > 0]


def fixed_batches(data, cfg, n: int, stream: int, device, dtype, flux_guidance):
    """``n`` rank-independent ``(x0, cond, uncond)`` batches (same on every process), keyed by ``stream``."""
    out = []
    for k in range(n):
        ids = batch_indices(len(data), cfg.batch_size, k, 0, 1, cfg.seed + 1000 * stream)
        out.append(model_inputs(data.family, data.get(ids), device, dtype, flux_guidance))
    return out


@torch.no_grad()
def calibrate(student, batches, times, cfg, accelerator=None) -> None:
    """Activation ranges ``input_amax = max |x|`` of the student on ``batches`` at training-time ``x_r``,
    max-reduced over processes."""
    v = velocity_fn(student, cfg.time_input)
    with calibration(student) as layers:
        for k, (x0, cond, _) in enumerate(batches):
            g = torch.Generator(device=x0.device).manual_seed(cfg.seed + 7 * k)
            qad_loss(
                v,
                v,
                x0,
                cond,
                None,
                alpha=1.0,
                guidance=GuidanceSchedule(1.0),
                generator=g,
                shift=cfg.shift,
                times=times,
                model_dtype=compute_dtype(student),
            )
    if accelerator is not None and accelerator.num_processes > 1:
        import torch.distributed as dist

        for m in layers.values():
            dist.all_reduce(m.input_amax, op=dist.ReduceOp.MAX)


@torch.no_grad()
def distill_probe(student, teacher, batches, times, cfg) -> float:
    """Mean ``||v_S - v_T^g||^2`` over fixed batches with fixed noise and times (the distillation term, alpha = 0)."""
    v_S, v_T = velocity_fn(student, cfg.time_input), velocity_fn(teacher, cfg.time_input)
    dtype = compute_dtype(teacher)
    total = 0.0
    for k, (x0, cond, uncond) in enumerate(batches):
        g = torch.Generator(device=x0.device).manual_seed(cfg.seed + 31 * k + 5)
        total += qad_loss(
            v_S,
            v_T,
            x0,
            cond,
            uncond,
            alpha=0.0,
            guidance=GuidanceSchedule(cfg.guidance_knots()),
            generator=g,
            shift=cfg.shift,
            times=times,
            model_dtype=dtype,
        )[1]["loss_distill"]
    return total / max(1, len(batches))


def export_student(student, out_dir: str, cfg, teacher=None) -> dict:
    """Write ``quantized_transformer.safetensors`` (``export_quantized``: ComfyUI layout for Wan by default)
    and, for scope ``lora``, the LoRA via ``save_lora_weights``; for scope ``all`` with ``export_delta`` and a
    ``teacher``, the bf16 full-weight delta ``delta_comfyui.safetensors`` (``save_full_delta``). Returns
    ``{what: path}``."""
    from ..quant.export import export_quantized

    arch = arch_of(student)
    layout = cfg.export_layout if cfg.export_layout != "auto" else ("comfyui" if arch == "wan" else "diffusers")
    os.makedirs(out_dir, exist_ok=True)
    paths = {"quantized": os.path.join(out_dir, "quantized_transformer.safetensors")}
    export_quantized(student, paths["quantized"], layout=layout, arch=arch)
    meta = {
        "base_model": cfg.pretrained,
        "made_by": "training/qad.py",
        "quantized_base": cfg.format,
        "quantized_layout": layout,
        "target": cfg.resolved_target(arch),
    }
    if cfg.scope == "lora":
        paths.update(save_qad_lora(student, out_dir, arch, meta))
    elif cfg.export_delta and teacher is not None:
        paths["delta_comfyui"] = os.path.join(out_dir, "delta_comfyui.safetensors")
        save_full_delta(student, teacher, paths["delta_comfyui"], arch, meta)
    return paths


def trainable(model) -> dict:
    """``{name: parameter}`` of the parameters that train (what the QAD EMA averages)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def ema_student(student, shadow: dict):
    """A deep copy of ``student`` whose trainable weights are replaced by the EMA weights ``shadow``
    (keyed like ``trainable``); the frozen ones are shared, not copied."""
    frozen = {id(p): p for p in student.parameters() if not p.requires_grad}
    m = copy.deepcopy(student, memo=frozen)
    params = trainable(m)
    if set(params) != set(shadow):
        raise KeyError(f"EMA weights do not match the trainable parameters: {sorted(set(params) ^ set(shadow))[:3]}")
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(shadow[k].to(p.dtype))
    return m


def full_delta(student, teacher) -> dict:
    """``{target.diff | target.diff_b: W_student - W_teacher}`` in bf16 for every parameter that changed
    (diffusers names, the canonical suffixes of ``rcm_diffusers.lora.keys``). Raises on a key/shape mismatch."""
    t = dict(_base_model(teacher).named_parameters())
    out = {}
    for name, p in _base_model(student).named_parameters():
        if name not in t or t[name].shape != p.shape:
            raise ValueError(f"full delta: student parameter {name} {tuple(p.shape)} has no teacher counterpart")
        d = p.detach().float() - t[name].detach().float()
        if torch.any(d):
            target, kind = (
                (name[: -len(".bias")], "diff_b")
                if name.endswith(".bias")
                else (name[: -len(".weight")] if name.endswith(".weight") else name, "diff")
            )
            out[f"{target}.{kind}"] = d.to(torch.bfloat16).cpu().contiguous()
    return out


def save_full_delta(student, teacher, path: str, arch: str, metadata: dict) -> dict:
    """The bf16 full-weight delta (``full_delta``) in ComfyUI's LoRA layout (``.diff`` / ``.diff_b``),
    written atomically: ``teacher + delta`` is the trained student (docs/math.md §7 export)."""
    from ..lora.io import save_lora

    return save_lora(path, full_delta(student, teacher), arch=arch, format="comfyui", metadata=metadata)


def save_qad_lora(student, out_dir: str, arch: str, metadata: dict) -> dict:
    """The ``"student"`` adapter in bf16 as ``pytorch_lora_weights.safetensors`` (diffusers layout,
    ``pipe.load_lora_weights(out_dir)``) and ``lora_comfyui.safetensors`` (ComfyUI layout). It is trained
    on top of the *quantized* base: apply it to the quantized checkpoint."""
    from peft.utils import get_peft_model_state_dict

    from ..lora.io import save_lora

    base = _base_model(student)
    conf = base.peft_config["student"]
    sd = {
        k: v.detach().to(torch.bfloat16).cpu().contiguous()
        for k, v in get_peft_model_state_dict(base, adapter_name="student").items()
    }
    for k in list(sd):
        if k.endswith(".lora_A.weight"):
            sd[k[: -len("lora_A.weight")] + "alpha"] = torch.tensor(float(conf.lora_alpha))
    paths = {
        "lora_diffusers": os.path.join(out_dir, "pytorch_lora_weights.safetensors"),
        "lora_comfyui": os.path.join(out_dir, "lora_comfyui.safetensors"),
    }
    save_lora(paths["lora_diffusers"], sd, arch=arch, format="diffusers", metadata=metadata)
    save_lora(paths["lora_comfyui"], sd, arch=arch, format="comfyui", metadata=metadata)
    return paths
