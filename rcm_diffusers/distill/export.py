"""The exports of an rCM run: the student LoRA (diffusers format), its EMA variant, ``scheduler/``."""

from __future__ import annotations

import os

import torch

__all__ = ["export_student", "save_student_lora"]


def export_student(pipeline_cls, cfg, base, ema) -> None:
    """Write the student: its LoRA (``pytorch_lora_weights.safetensors``, diffusers ``save_lora_weights``) and the EMA
    variant in ``ema/`` (shared mode), or ``student_transformer/`` (full mode). Two experts: the high-noise
    expert's files where a one-network run puts them, the low-noise expert's in a ``transformer_2/`` subfolder
    of each (``rcm_diffusers.load_rcm_lora`` loads the pair). Next to each: ``scheduler/``, the
    ``RCMScheduler`` config the student was trained for (``sigma_max``, ``mid_t``, ``time_input``), so that
    ``RCMScheduler.from_pretrained(run_dir, subfolder="scheduler")`` samples it as the trainer's previews do."""
    from ..schedulers import RCMScheduler
    from .experts import HIGH, LOW, expert_lora_weights, switch_of

    sched = RCMScheduler(
        sigma_max=cfg.sigma_max, time_input=cfg.time_input, **({"mid_t": cfg.mid_t} if cfg.mid_t else {})
    )
    for d in [cfg.output_dir] + ([os.path.join(cfg.output_dir, "ema")] if ema is not None else []):
        sched.save_pretrained(os.path.join(d, "scheduler"))

    sw = switch_of(base)
    parts = [("", HIGH, sw.transformer), (LOW, LOW, sw.transformer_2)] if sw is not None else [("", None, base)]
    shadow = None if ema is None else ema.shadow
    for sub, expert, model in parts:

        def pick(w):
            return w if expert is None else expert_lora_weights(w, expert)

        if cfg.mode == "shared":
            lora_cfg = model.peft_config["student"]
            save_student_lora(pipeline_cls, os.path.join(cfg.output_dir, sub), model, lora_cfg)
            if shadow is not None:
                save_student_lora(
                    pipeline_cls, os.path.join(cfg.output_dir, "ema", sub), model, lora_cfg, weights=pick(shadow)
                )
            continue
        name = "student_" + (LOW if sub else "transformer")
        model.save_pretrained(os.path.join(cfg.output_dir, name))
        if shadow is not None:
            with torch.no_grad():
                live = dict(model.named_parameters())
                backup = {k: p.detach().clone() for k, p in live.items()}
                for k, v in pick(shadow).items():
                    live[k].copy_(v)
                model.save_pretrained(os.path.join(cfg.output_dir, "ema", name))
                for k, p in live.items():
                    p.copy_(backup[k])


def save_student_lora(pipeline_cls, out_dir: str, transformer, lora_config, weights: dict | None = None) -> None:
    """Save the ``"student"`` adapter with diffusers' own ``save_lora_weights`` so that
    ``pipe.load_lora_weights(out_dir)`` works; ``weights`` (e.g. EMA, keyed like the peft params)
    replaces the live values."""
    from peft.utils import get_peft_model_state_dict

    sd = get_peft_model_state_dict(transformer, adapter_name="student")
    if weights is not None:
        live = {k.replace(".student.", "."): k for k in weights}
        sd = {k: weights[live[k]].detach().clone() if k in live else v for k, v in sd.items()}
        missing = [k for k in sd if k not in live]
        if missing:
            raise KeyError(f"EMA weights lack {missing[:3]}")
    sd = {k: v.detach().to(torch.float32).cpu().contiguous() for k, v in sd.items()}
    meta = lora_config.to_dict()
    meta = {k: (sorted(v) if isinstance(v, set) else v) for k, v in meta.items()}
    os.makedirs(out_dir, exist_ok=True)
    if not hasattr(pipeline_cls, "save_lora_weights"):
        # HunyuanVideo15Pipeline has no LoRA loader mixin (diffusers 0.42): the transformer-only file of a
        # one-transformer loader, which the pipeline's transformer reads with load_lora_adapter(prefix="transformer")
        from diffusers.loaders.lora_pipeline import HunyuanVideoLoraLoaderMixin as pipeline_cls
    pipeline_cls.save_lora_weights(out_dir, transformer_lora_layers=sd, transformer_lora_adapter_metadata=meta)
