"""Quantization-aware distillation: ``accelerate launch training/qad.py --config training/configs/<name>.yaml [--key value ...]``.

A frozen teacher (a base model, or an rCM few-step student: ``--teacher_lora``) is distilled into
a student initialised from it whose Linear layers run through low-bit fake quantization (docs/math.md §7):
``L = alpha ||v_S - (eps - x0)||^2 + (1 - alpha) ||v_S - v_T^g||^2``, with the teacher's CFG folded
in by the schedule ``s(r)`` (the student runs one branch). Scope ``all`` trains every weight, scope
``lora`` a bf16 LoRA on the frozen quantized base. Optional block-wise warm start first.
``--help`` lists every option. Outputs in ``output_dir``: ``env.json``, ``metrics.jsonl`` (step -1
rows: the distillation probe after quantization and after the warm start), ``warm_start.json``,
``checkpoints/step-*`` (``--resume latest`` continues exactly), ``final.json``,
``quantized_transformer.safetensors`` (ComfyUI layout for Wan; ``--target comfyui``, the default there,
trains the arithmetic ComfyUI runs for the format), for scope ``lora``
``pytorch_lora_weights.safetensors`` + ``lora_comfyui.safetensors``, for scope ``all`` the bf16 full-weight
delta ``delta_comfyui.safetensors``; with ``--ema_rate s > 0`` the same from the power-EMA weights in ``ema/``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import diffusers  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from rcm_diffusers.distill import runs as R  # noqa: E402
from rcm_diffusers.distill import trainer as T  # noqa: E402
from rcm_diffusers.distill.checkpoints import Checkpointer, read_state  # noqa: E402
from rcm_diffusers.distill.config import QADConfig, noise_seeding_of  # noqa: E402
from rcm_diffusers.distill.ema import PowerEMA  # noqa: E402
from rcm_diffusers.distill.data import LatentDataset, batch_indices, model_inputs, step_noise  # noqa: E402
from rcm_diffusers.models import velocity_fn  # noqa: E402
from rcm_diffusers.distill import qad_trainer as Q  # noqa: E402
from rcm_diffusers.distill.qad import GuidanceSchedule, blockwise_warm_start, qad_loss, sample_r  # noqa: E402

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "qad-digits.yaml")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def write_json(path, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def main(argv=None):
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["--verify"]:  # check a finished run's exports against final.json (docs/training.md)
        raise SystemExit(R.verify_main(args[1:]))
    cfg = R.load_config_or_exit(argv, default_config=DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG) else None, config_cls=QADConfig)
    R.check_inputs(cfg)  # the teacher's weight format and the whole dataset, before the run folder or a model is touched
    accelerator = Accelerator(cpu=not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1,
                              mixed_precision=cfg.mixed_precision, project_dir=cfg.output_dir,
                              # micro-batches per optimizer step: backward divides each loss by it, accumulate() skips
                              # DDP's all-reduce on all but the last micro-batch
                              gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                              step_scheduler_with_optimizer=False,  # the LR schedule counts iterations, not iterations x processes
                              log_with=None if cfg.report_to == "none" else cfg.report_to)
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    dtype = DTYPES[cfg.weight_dtype]
    # ---- the run folder: one writer, a new run only into an empty folder, the checkpoint to resume (docs/training.md)
    lock = R.RunLock(cfg.output_dir) if accelerator.is_main_process else None  # noqa: F841 - held until exit
    ckpt = R.broadcast_start(accelerator, R.choose_start(cfg, accelerator.print) if accelerator.is_main_process else None)
    saved = read_state(ckpt) if ckpt else None
    changed = R.resume_changes(saved["config"], cfg, saved["train_state"]["step"]) if ckpt else {}
    if ckpt and saved.get("world_size") != world:
        changed["world_size"] = [saved.get("world_size"), world]  # the data shards per process change from here on

    # ---- teacher (frozen) and quantized student; LoRA init draws from the global RNG: same on every rank
    torch.manual_seed(cfg.seed)
    index = R.model_index(cfg.pretrained)
    transformer_cls = getattr(diffusers, index[cfg.transformer_subfolder][1])
    teacher = transformer_cls.from_pretrained(cfg.pretrained, subfolder=cfg.transformer_subfolder, torch_dtype=dtype).to(device)
    if cfg.teacher_lora:
        Q.fuse_lora_file(teacher, cfg.teacher_lora)
    teacher.requires_grad_(False).eval()
    student, layers = Q.build_student(teacher, cfg)
    v_T = velocity_fn(teacher, cfg.time_input)
    guidance = GuidanceSchedule(cfg.guidance_knots())
    times = Q.training_times(cfg)

    data = LatentDataset(cfg.data_dir)
    flux_g = cfg.flux_guidance if getattr(teacher.config, "guidance_embeds", False) else None
    probe = Q.fixed_batches(data, cfg, cfg.eval_batches, 2, device, dtype, flux_g)
    if any(m.static_act for m in layers.values()):
        Q.calibrate(student, Q.fixed_batches(data, cfg, cfg.calibration_batches, 1, device, dtype, flux_g), times, cfg, accelerator)

    metrics_path = os.path.join(cfg.output_dir, "metrics.jsonl")
    if ckpt is None:
        # fresh run: probe the naive post-training quantization, then the optional block-wise warm start
        metrics = T.MetricsWriter(metrics_path, -1, accelerator.is_main_process)  # fresh file
        metrics.write({"step": -1, "phase": "ptq", "eval_distill": Q.distill_probe(student, teacher, probe, times, cfg)})
        if cfg.warm_start_batches:
            warm = Q.fixed_batches(data, cfg, cfg.warm_start_batches, 3, device, dtype, flux_g)

            def runner(k, x0, cond):
                g = torch.Generator(device=x0.device).manual_seed(cfg.seed + 13 * k)
                r = sample_r(x0.shape[0], cfg.shift, times, g, x0.device)
                eps = torch.randn(x0.shape, dtype=torch.float64, generator=g, device=x0.device)
                rb = r.reshape(-1, *[1] * (x0.dim() - 1))
                x_r = ((1 - rb) * x0 + rb * eps).to(dtype)
                return lambda m: velocity_fn(m, cfg.time_input)(x_r, r.float(), **cond)

            stats = blockwise_warm_start(student, teacher, [runner(k, x0, c) for k, (x0, c, _) in enumerate(warm)],
                                         steps_per_batch=cfg.warm_start_steps_per_batch, lr=cfg.warm_start_lr,
                                         max_grad_norm=cfg.max_grad_norm or 1.0)
            if accelerator.is_main_process:
                write_json(os.path.join(cfg.output_dir, "warm_start.json"), [dataclasses.asdict(s) for s in stats])
            metrics.write({"step": -1, "phase": "warm_start", "eval_distill": Q.distill_probe(student, teacher, probe, times, cfg)})

    # ---- optimizer, accelerate, checkpointed state (trainable weights only; the quantized base is rebuilt)
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, T.lr_lambda(cfg.lr_warmup_steps))
    student, opt, sched = accelerator.prepare(student, opt, sched)
    params = [p for p in student.parameters() if p.requires_grad]
    state = T.TrainState()
    named = {n: p for n, p in student.named_parameters() if p.requires_grad}
    ema = PowerEMA(Q.trainable(accelerator.unwrap_model(student)), s=cfg.ema_rate) if cfg.ema_rate > 0 else None
    # the EMA is a float32 shadow of the trainable weights (scope lora: the adapter only)
    checkpointer = Checkpointer(accelerator, ([student], ["student"]), {"student": (opt, named)}, {"student": sched}, state, ema)
    state.init_checksum = R.param_checksum(params)
    if ckpt:
        checkpointer.load(ckpt, verify=False)  # verified by choose_start
        accelerator.print(f"resumed from {ckpt} at iteration {state.step}")
        if changed:
            accelerator.print("settings changed on resume, applied from iteration {}: {}".format(
                state.step, ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items())))
        if state.step < cfg.max_steps and accelerator.is_main_process and os.path.exists(os.path.join(cfg.output_dir, "final.json")):
            os.remove(os.path.join(cfg.output_dir, "final.json"))  # the run is unfinished again until its exports are rewritten
        metrics = T.MetricsWriter(metrics_path, state.step, accelerator.is_main_process)  # keeps step -1 probes
    if accelerator.is_main_process:
        env_path = os.path.join(cfg.output_dir, "env.json")
        session = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv, "resumed_from": ckpt,
                   "start_step": state.step, "changed_on_resume": changed, "world_size": world}
        T.env_snapshot(env_path, cfg,
                       {"world_size": world, "resumed_from": ckpt, "seed": cfg.seed, "device": str(device),
                        "quantized_layers": {n: m.fmt for n, m in sorted(layers.items())}, "training_times": times,
                        "changed_on_resume": changed, "sessions": R.env_sessions(env_path, session, ckpt is None)})
    if cfg.report_to != "none":
        accelerator.init_trackers("qad", config={k: str(v) for k, v in vars(cfg).items()})

    v_S = velocity_fn(student, cfg.time_input)
    n_micro, B, seeding = cfg.gradient_accumulation_steps, cfg.batch_size, noise_seeding_of(cfg)
    bar = tqdm(range(state.step, cfg.max_steps), initial=state.step, total=cfg.max_steps,
               disable=not (cfg.progress and accelerator.is_local_main_process), desc="QAD")
    for i in bar:
        t0 = time.perf_counter()
        # the process's batch_size x n_micro samples of this optimizer step, as n_micro micro-batches; each micro-batch's
        # mean loss is divided by n_micro in accelerator.backward: the mean over the whole batch
        ids = batch_indices(len(data), B * n_micro, i, rank, world, cfg.seed)
        x0_all, cond_all, uncond_all = model_inputs(data.family, data.get(ids), device, dtype, flux_g)
        gen_all = step_noise(seeding, cfg.seed, i, rank, B * n_micro, device=device.type if device.type != "mps" else "cpu")
        opt.zero_grad(set_to_none=True)
        parts = []
        for m in range(n_micro):
            rows = (m * B, (m + 1) * B, B * n_micro)
            x0, cond, uncond = (T.batch_rows(v, *rows) for v in (x0_all, cond_all, uncond_all))
            with accelerator.accumulate(student):
                loss, part = qad_loss(v_S, v_T, x0, cond, uncond, alpha=cfg.alpha, guidance=guidance,
                                      generator=gen_all[m * B:(m + 1) * B] if n_micro > 1 else gen_all,
                                      shift=cfg.shift, times=times, model_dtype=dtype)
                accelerator.backward(loss.mean())
            parts.append(part)
        logs = T.merge_logs(parts)
        norm = float(accelerator.clip_grad_norm_(params, cfg.max_grad_norm)) if cfg.max_grad_norm > 0 else T.grad_norm(params)
        if math.isfinite(norm) or not cfg.skip_nonfinite:
            opt.step()
            sched.step()
            if ema is not None:
                ema.update(Q.trainable(accelerator.unwrap_model(student)), i + 1)
        else:
            R.note_skip(state, cfg, i, "student", norm, ids, accelerator.print)
        state.step = i + 1
        record = {"step": i, "lr": sched.get_last_lr()[0], "grad_norm": norm, "skipped": state.skipped,
                  "step_time": time.perf_counter() - t0, "peak_mem_mb": peak_memory_mb(device), **logs}
        bar.set_postfix({k: f"{v:.3g}" for k, v in logs.items() if k.startswith("loss")})
        T.end_of_step(accelerator, cfg, i, record, metrics, checkpointer)
        T.exit_if_asked(accelerator, cfg, i)

    # ---- replicas must agree; final probe, checkpoint and exports
    with torch.no_grad():
        checksum = torch.stack([p.double().sum() for p in params]).sum()
    sums = accelerator.gather(checksum.reshape(1).to(device)).tolist()
    if len(set(sums)) != 1:
        raise RuntimeError(f"student weights differ across ranks: {sums}")
    R.check_learned({n: p for n, p in student.named_parameters() if p.requires_grad}, state.init_checksum, state, cfg)
    checkpointer.save(cfg.output_dir, state.step, dataclasses.asdict(cfg), cfg.checkpoints_total_limit)
    if accelerator.is_main_process:
        base = accelerator.unwrap_model(student)
        final = {"step": state.step, "skipped": state.skipped, "skipped_steps": state.skipped_steps,
                 "skipped_fraction": state.skipped / max(1, state.step), "student_checksum_per_rank": sums,
                 "eval_distill": Q.distill_probe(base, teacher, probe, times, cfg)}
        final["exports"] = Q.export_student(base, cfg.output_dir, cfg, teacher=teacher)
        if ema is not None:
            final["exports_ema"] = Q.export_student(Q.ema_student(base, ema.shadow), os.path.join(cfg.output_dir, "ema"),
                                                    cfg, teacher=teacher)
        final["files"] = R.export_files(cfg.output_dir)
        write_json(os.path.join(cfg.output_dir, "final.json"), final)
    accelerator.wait_for_everyone()
    accelerator.end_training()


def peak_memory_mb(device) -> float:
    import resource

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    R.run_main(main)
