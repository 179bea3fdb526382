"""The QAD trainer: ``QADTrainer(config).train()`` distills a frozen teacher (a base model, or an rCM few-step
student: ``teacher_lora``) into a student initialised from it whose Linear layers run through low-bit fake
quantization (docs/math.md §7): ``L = alpha ||v_S - (eps - x0)||^2 + (1 - alpha) ||v_S - v_T^g||^2``, with the
teacher's CFG folded in by the schedule ``s(r)``. Scope ``all`` trains every weight, scope ``lora`` a LoRA on the
frozen quantized base; an optional block-wise warm start runs first.

From a shell: ``accelerate launch training/qad.py --config FILE.yaml [--key value ...]`` in a clone, or
``accelerate launch -m rcm_diffusers.distill.qad_trainer ...`` / ``rcm-qad ...`` after ``pip install``. Outputs in
``output_dir``: ``env.json``, ``metrics.jsonl`` (step -1 rows: the distillation probe after quantization and after
the warm start), ``warm_start.json``, ``checkpoints/step-*``, ``final.json``, ``quantized_transformer.safetensors``
(ComfyUI layout for Wan), for scope ``lora`` ``pytorch_lora_weights.safetensors`` + ``lora_comfyui.safetensors``,
for scope ``all`` the bf16 full-weight delta ``delta_comfyui.safetensors``; with ``ema_rate > 0`` the same from the
power-EMA weights in ``ema/``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time

import torch

from ..models import velocity_fn
from . import qad_student as Q
from .checkpoints import Checkpointer
from .config import QADConfig, noise_seeding_of
from .data import LatentDataset, batch_indices, batch_rows, model_inputs, step_noise
from .ema import PowerEMA
from .guards import grad_norm, note_skip
from .optim import adamw, lr_lambda
from .qad import GuidanceSchedule, blockwise_warm_start, qad_loss, sample_r
from .session import DTYPES, RunSession, make_accelerator, merge_logs, peak_memory_mb, write_json

__all__ = ["QADTrainer", "main"]


class QADTrainer:
    """One QAD run: ``__init__`` checks the inputs before anything is written; ``train()`` takes the run folder,
    quantizes the student, calibrates, probes, optionally warm-starts, trains and exports."""

    def __init__(self, config: QADConfig):
        from .inputs import check_inputs

        self.cfg = config.validate()
        check_inputs(self.cfg)

    def _teacher(self, device, dtype):
        import diffusers

        from .inputs import model_index

        cfg = self.cfg
        index = model_index(cfg.pretrained)
        transformer_cls = getattr(diffusers, index[cfg.transformer_subfolder][1])
        teacher = transformer_cls.from_pretrained(
            cfg.pretrained, subfolder=cfg.transformer_subfolder, torch_dtype=dtype
        ).to(device)
        if cfg.teacher_lora:
            Q.fuse_lora_file(teacher, cfg.teacher_lora)
        return teacher.requires_grad_(False).eval()

    def _warm_start(self, session, student, teacher, data, times, dtype, flux_g, probe):
        cfg, device = self.cfg, self.acc.device
        warm = Q.fixed_batches(data, cfg, cfg.warm_start_batches, 3, device, dtype, flux_g)

        def runner(k, x0, cond):
            g = torch.Generator(device=x0.device).manual_seed(cfg.seed + 13 * k)
            r = sample_r(x0.shape[0], cfg.shift, times, g, x0.device)
            eps = torch.randn(x0.shape, dtype=torch.float64, generator=g, device=x0.device)
            rb = r.reshape(-1, *[1] * (x0.dim() - 1))
            x_r = ((1 - rb) * x0 + rb * eps).to(dtype)
            return lambda m: velocity_fn(m, cfg.time_input)(x_r, r.float(), **cond)

        stats = blockwise_warm_start(
            student,
            teacher,
            [runner(k, x0, c) for k, (x0, c, _) in enumerate(warm)],
            steps_per_batch=cfg.warm_start_steps_per_batch,
            lr=cfg.warm_start_lr,
            max_grad_norm=cfg.max_grad_norm or 1.0,
        )
        if session.main:
            write_json(session.path("warm_start.json"), [dataclasses.asdict(s) for s in stats])
        session.metrics.write(
            {"step": -1, "phase": "warm_start", "eval_distill": Q.distill_probe(student, teacher, probe, times, cfg)}
        )

    def train(self) -> str:
        """Run (or resume) QAD; returns ``output_dir`` once ``final.json`` is written."""
        cfg = self.cfg
        acc = self.acc = make_accelerator(cfg)
        device, rank, world = acc.device, acc.process_index, acc.num_processes
        dtype = DTYPES[cfg.weight_dtype]
        session = RunSession(cfg, acc, "qad")

        torch.manual_seed(cfg.seed)  # LoRA init draws from the global RNG: the same on every rank
        teacher = self._teacher(device, dtype)
        student, layers = Q.build_student(teacher, cfg)
        v_T = velocity_fn(teacher, cfg.time_input)
        guidance = GuidanceSchedule(cfg.guidance_knots())
        times = Q.training_times(cfg)

        data = LatentDataset(cfg.data_dir)
        flux_g = cfg.flux_guidance if getattr(teacher.config, "guidance_embeds", False) else None
        probe = Q.fixed_batches(data, cfg, cfg.eval_batches, 2, device, dtype, flux_g)
        if any(m.static_act for m in layers.values()):
            Q.calibrate(
                student, Q.fixed_batches(data, cfg, cfg.calibration_batches, 1, device, dtype, flux_g), times, cfg, acc
            )
        if session.fresh:
            # probe the naive post-training quantization, then the optional block-wise warm start
            session.open_metrics(-1).write(
                {"step": -1, "phase": "ptq", "eval_distill": Q.distill_probe(student, teacher, probe, times, cfg)}
            )
            if cfg.warm_start_batches:
                self._warm_start(session, student, teacher, data, times, dtype, flux_g, probe)

        # optimizer, accelerate, checkpointed state (trainable weights only; the quantized base is rebuilt)
        opt = adamw([p for p in student.parameters() if p.requires_grad], cfg.lr, cfg)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.lr_warmup_steps))
        student, opt, sched = acc.prepare(student, opt, sched)
        params = [p for p in student.parameters() if p.requires_grad]
        named = {n: p for n, p in student.named_parameters() if p.requires_grad}
        # the EMA is a float32 shadow of the trainable weights (scope lora: the adapter only)
        ema = PowerEMA(Q.trainable(acc.unwrap_model(student)), s=cfg.ema_rate) if cfg.ema_rate > 0 else None
        checkpointer = Checkpointer(
            acc, ([student], ["student"]), {"student": (opt, named)}, {"student": sched}, session.state, ema
        )
        session.start(
            checkpointer,
            params,
            {"quantized_layers": {n: m.fmt for n, m in sorted(layers.items())}, "training_times": times},
            keep_metrics_before=-1,
        )
        state = session.state

        v_S = velocity_fn(student, cfg.time_input)
        n_micro, B, seeding = cfg.gradient_accumulation_steps, cfg.batch_size, noise_seeding_of(cfg)
        bar = session.progress("QAD")
        for i in bar:
            t0 = time.perf_counter()
            # the process's batch_size x n_micro samples, as n_micro micro-batches; accelerator.backward divides
            # each micro-batch's mean loss by n_micro: the mean over the whole batch
            ids = batch_indices(len(data), B * n_micro, i, rank, world, cfg.seed)
            x0_all, cond_all, uncond_all = model_inputs(data.family, data.get(ids), device, dtype, flux_g)
            gen_all = step_noise(
                seeding, cfg.seed, i, rank, B * n_micro, device=device.type if device.type != "mps" else "cpu"
            )
            opt.zero_grad(set_to_none=True)
            parts = []
            for m in range(n_micro):
                rows = (m * B, (m + 1) * B, B * n_micro)
                x0, cond, uncond = (batch_rows(v, *rows) for v in (x0_all, cond_all, uncond_all))
                with acc.accumulate(student):
                    loss, part = qad_loss(
                        v_S,
                        v_T,
                        x0,
                        cond,
                        uncond,
                        alpha=cfg.alpha,
                        guidance=guidance,
                        generator=gen_all[m * B : (m + 1) * B] if n_micro > 1 else gen_all,
                        shift=cfg.shift,
                        times=times,
                        model_dtype=dtype,
                    )
                    acc.backward(loss.mean())
                parts.append(part)
            logs = merge_logs(parts)
            norm = float(acc.clip_grad_norm_(params, cfg.max_grad_norm)) if cfg.max_grad_norm > 0 else grad_norm(params)
            if math.isfinite(norm) or not cfg.skip_nonfinite:
                opt.step()
                sched.step()
                if ema is not None:
                    ema.update(Q.trainable(acc.unwrap_model(student)), i + 1)
            else:
                note_skip(state, cfg, i, "student", norm, ids, acc.print)
            record = {
                "step": i,
                "lr": sched.get_last_lr()[0],
                "grad_norm": norm,
                "skipped": state.skipped,
                "step_time": time.perf_counter() - t0,
                "peak_mem_mb": peak_memory_mb(device),
                **logs,
            }
            bar.set_postfix({k: f"{v:.3g}" for k, v in logs.items() if k.startswith("loss")})
            session.end_of_step(i, record)
            session.exit_if_asked(i)

        sums = session.finish({n: p for n, p in student.named_parameters() if p.requires_grad})
        extra = {}
        if acc.is_main_process:
            base = acc.unwrap_model(student)
            extra["eval_distill"] = Q.distill_probe(base, teacher, probe, times, cfg)
            extra["exports"] = Q.export_student(base, cfg.output_dir, cfg, teacher=teacher)
            if ema is not None:
                extra["exports_ema"] = Q.export_student(
                    Q.ema_student(base, ema.shadow), os.path.join(cfg.output_dir, "ema"), cfg, teacher=teacher
                )
        session.write_final(sums, extra)
        return cfg.output_dir


def main(argv=None, default_config: str | None = None) -> None:
    """Command line: ``--verify RUN_DIR`` checks a finished run; else ``QADTrainer(load_config(argv)).train()``."""
    from .errors import load_config_or_exit, run_main
    from .run_folder import verify_main

    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["--verify"]:
        raise SystemExit(verify_main(args[1:]))

    def run():
        cfg = load_config_or_exit(args, default_config=default_config, config_cls=QADConfig)
        QADTrainer(cfg).train()

    run_main(run)


if __name__ == "__main__":
    main()
