"""rCM distillation: ``accelerate launch training/rcm.py --config training/configs/<name>.yaml [--key value ...]``.

Distills a rectified-flow teacher (Wan T2V/I2V, Flux) into a 1-4 step student with
L = L_sCM + lambda L_DMD (docs/math.md §4; ``--cm_type dcm``: the JVP-free discrete-time L_dCM, §4.6). Default mode trains two LoRA adapters on one frozen base
(docs/math.md §6). ``--help`` lists every option. Outputs in ``output_dir``: ``env.json``,
``metrics.jsonl``, ``checkpoints/step-*`` (``--resume latest`` continues exactly), and the
student LoRA (``pytorch_lora_weights.safetensors``, loadable by ``pipe.load_lora_weights``)
plus its power-EMA variant in ``ema/``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import diffusers  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DistributedDataParallelKwargs  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from rcm_diffusers.distill import fsdp as FS  # noqa: E402
from rcm_diffusers.distill import runs as R  # noqa: E402
from rcm_diffusers.distill import trainer as T  # noqa: E402
from rcm_diffusers.distill.adapters import Networks  # noqa: E402
from rcm_diffusers.distill.alternation import optimizer_steps, plan_step  # noqa: E402
from rcm_diffusers.distill.checkpoints import Checkpointer, read_state  # noqa: E402
from rcm_diffusers.distill.config import noise_seeding_of  # noqa: E402
from rcm_diffusers.distill.data import (LatentDataset, batch_indices, model_inputs, pair_indices, pair_inputs, step_noise, step_seed,  # noqa: E402
                                        video_noise_multiplier)
from rcm_diffusers.distill.ema import PowerEMA  # noqa: E402
from rcm_diffusers.distill.experts import switch_of  # noqa: E402

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "digits.yaml")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def peak_memory_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB -> MiB


def main(argv=None):
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["--verify"]:  # check a finished run's exports against final.json (docs/training.md)
        raise SystemExit(R.verify_main(args[1:]))
    cfg = R.load_config_or_exit(argv, default_config=DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG) else None)
    if cfg.synthetic:
        raise SystemExit("--synthetic: the teacher samples are generated once, before training: run\n  python training/prepare_data.py "
                         f"--pretrained {cfg.pretrained} --synthetic --prompts prompts.txt --num_samples N --steps {cfg.synthetic_steps} "
                         f"--shift {cfg.synthetic_shift} --height H --width W [--num_frames F] --output_dir DIR\n"
                         "then train with --data_dir DIR (and without --synthetic)")
    R.check_inputs(cfg)  # the teacher's weight format and the whole dataset, before the run folder or a model is touched
    fsdp = FS.take_fsdp_request()  # an FSDP2 accelerate config: the trainer shards the frozen base itself (rcm_diffusers.distill.fsdp)
    accelerator = Accelerator(
        # torchrun-style multi-process launch on a machine without GPUs: gloo over CPU processes
        cpu=not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1,
        mixed_precision=cfg.mixed_precision,
        # N micro-batches per optimizer step: accelerator.backward divides each loss by N, accumulate() skips DDP's
        # gradient all-reduce on all but the last micro-batch
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        log_with=None if cfg.report_to == "none" else cfg.report_to,
        project_dir=cfg.output_dir,
        # the LR schedule counts iterations: by default accelerate steps a prepared scheduler once per process
        # per call, so P processes would run the warm-up P times faster
        step_scheduler_with_optimizer=False,
        # student and fake score train disjoint parameters on alternate iterations
        # broadcast_buffers off: DDP would copy the buffers (Wan's RoPE tables, constants) from rank 0 in every forward,
        # an in-place write that torch.func.jvp refuses (see also T.ddp_jvp_bypass)
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True, broadcast_buffers=False)],
    )
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    # ---- the run folder: one writer, a new run only into an empty folder, the checkpoint to resume (docs/training.md)
    lock = R.RunLock(cfg.output_dir) if accelerator.is_main_process else None  # noqa: F841 - held until exit
    ckpt = R.broadcast_start(accelerator, R.choose_start(cfg, accelerator.print) if accelerator.is_main_process else None)
    saved = read_state(ckpt) if ckpt else None
    changed = R.resume_changes(saved["config"], cfg, saved["train_state"]["step"]) if ckpt else {}
    if ckpt and saved.get("world_size") != world:
        changed["world_size"] = [saved.get("world_size"), world]  # the data shards per process change from here on

    # ---- teacher, student, fake score (docs/math.md §6); adapter init (lora_A) draws from the global RNG: same on every rank
    torch.manual_seed(cfg.seed)
    index = R.model_index(cfg.pretrained)
    pipeline_cls = getattr(diffusers, index["_class_name"] if cfg.pipeline_class == "auto" else cfg.pipeline_class)
    transformer_cls = getattr(diffusers, index[cfg.transformer_subfolder][1])
    transformer = T.load_transformer(transformer_cls, cfg, index, DTYPES[cfg.weight_dtype], device, accelerator.print)
    nets, trainable = Networks.build(transformer, cfg.mode, with_fake=cfg.use_dmd, lora_rank=cfg.lora_rank,
                                     lora_alpha=cfg.lora_alpha or None, lora_target_modules=cfg.lora_target_modules or None,
                                     fake_lora_rank=cfg.fake_lora_rank or None, time_input=cfg.time_input)
    if cfg.gradient_checkpointing:  # the selective policy recomputes the rank-r LoRA up-projections (checkpointing.py)
        from rcm_diffusers.distill.checkpointing import enable_checkpointing

        for m in trainable.values():
            enable_checkpointing(m, cfg.checkpointing_policy, max(cfg.lora_rank, cfg.fake_lora_rank) if cfg.mode == "shared" else 0)
    if T.needs_jvp(cfg):  # sCM with fd_type 0/1 only; dCM, fd_type 2 and DMD alone keep the stock processors
        try:
            from rcm_diffusers.attention import enable_jvp_attention
        except ImportError as e:
            raise SystemExit(f"fd_type {cfg.fd_type} needs rcm_diffusers.attention.enable_jvp_attention ({e}); use --fd_type 2") from e
        for m in {id(m): m for m in nets.modules.values()}.values():
            enable_jvp_attention(m)
    # ---- Ulysses context parallelism (rcm_diffusers.attention.ulysses): CP groups of consecutive ranks run one
    # sample together; data parallelism across the groups
    cp, dp_rank, dp_world = cfg.context_parallel_size, rank, world
    if cp > 1:
        from rcm_diffusers.attention import enable_jvp_attention
        from rcm_diffusers.attention.ulysses import check_context_parallel, context_parallel_groups, enable_context_parallel

        try:
            check_context_parallel(transformer, cp)  # Wan (one network or both experts, T2V or I2V) with heads P divides
            dp_rank, dp_world, cp_group = context_parallel_groups(cp) if world > 1 else R.fail(
                f"context_parallel_size {cp} needs {cp} x k processes, this run has 1")
            for m in {id(m): m for m in nets.modules.values()}.values():
                enable_jvp_attention(m)  # stock attention outside a JVP pass; the processors carry the exchange
                enable_context_parallel(m, cp_group)
        except ValueError as e:
            R.fail(str(e))
    if fsdp:
        if switch_of(transformer) is not None:
            switch_of(transformer).run_both = True  # every rank joins both experts' FSDP2 collectives in every call
        if cfg.mode != "shared":
            raise SystemExit("FSDP2 is supported in shared-base LoRA mode (--mode shared); full mode: use DDP (training/accelerate/ddp_8gpu.yaml)")
        FS.shard_frozen_base(transformer, **fsdp)

    # ---- optimizers: separate for student and fake score (docs/math.md §4.4)
    def adamw(params, lr):
        return torch.optim.AdamW(params, lr=lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps, weight_decay=cfg.weight_decay)

    roles = ["student"] + (["fake"] if nets.has_fake else [])
    opts = {r: adamw(list(nets.trainable_parameters(r).values()), cfg.lr if r == "student" else cfg.fake_lr) for r in roles}
    total = optimizer_steps(cfg.max_steps, cfg.tangent_warmup, cfg.student_update_freq, nets.has_fake)
    scheds = {r: torch.optim.lr_scheduler.LambdaLR(o, T.lr_lambda(cfg.lr_warmup_steps, total[r], cfg.lr_decay, cfg.lr_final_ratio,
                                                                cfg.lr_decay_fraction))
              for r, o in opts.items()}
    names = list(trainable)
    wrap = [] if fsdp else names  # FSDP2: sharded above; accelerate must not add a DDP wrapper
    prepared = accelerator.prepare(*[trainable[n] for n in wrap], *[opts[r] for r in roles], *[scheds[r] for r in roles])
    prepared_modules = {**trainable, **dict(zip(wrap, prepared[: len(wrap)]))}
    for m in prepared_modules.values():
        T.ddp_jvp_bypass(m)  # the JVP passes (no_grad) call the module inside a DDP wrapper
    nets.replace_modules(prepared_modules)
    opts = dict(zip(roles, prepared[len(wrap): len(wrap) + len(roles)]))
    scheds = dict(zip(roles, prepared[len(wrap) + len(roles):]))
    sync_module = {r: nets.modules[r] for r in roles}
    params = {r: list(nets.trainable_parameters(r).values()) for r in roles}

    # ---- checkpointed state (safetensors + JSON, no pickle): counters, EMA, optimizers, schedulers, RNG,
    # trainable weights only (no frozen base)
    state = T.TrainState()
    ema = PowerEMA(nets.trainable_parameters("student"), s=cfg.ema_rate) if cfg.ema_rate > 0 else None
    checkpointer = Checkpointer(accelerator, ([prepared_modules[n] for n in names], names),
                                {r: (opts[r], nets.trainable_parameters(r)) for r in roles}, scheds, state, ema)
    state.init_checksum = R.param_checksum(nets.trainable_parameters("student"))
    if ckpt:
        checkpointer.load(ckpt, verify=False)  # verified by choose_start
        accelerator.print(f"resumed from {ckpt} at iteration {state.step}")
        if changed:
            accelerator.print("settings changed on resume, applied from iteration {}: {}".format(
                state.step, ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items())))
        if state.step < cfg.max_steps and accelerator.is_main_process and os.path.exists(os.path.join(cfg.output_dir, "final.json")):
            os.remove(os.path.join(cfg.output_dir, "final.json"))  # the run is unfinished again until its exports are rewritten

    # ---- data, logging, guards
    data = LatentDataset(cfg.data_dir)
    pairs = LatentDataset(cfg.regression_data_dir) if cfg.regression_weight > 0 else None
    if cp > 1:
        n_tok = math.prod(n // p for n, p in zip(data.get([0])["latents"].shape[-3:], transformer.config.patch_size))
        if n_tok % cp:
            R.fail(f"context_parallel_size {cp}: a sample has {n_tok} video tokens, not divisible by {cp}")
    decoder = None
    if cfg.sample_every and accelerator.is_main_process:
        from rcm_diffusers.distill.previews import SampleDecoder

        decoder = SampleDecoder.from_pretrained(cfg.pretrained, data.family, device, DTYPES[cfg.weight_dtype])
        accelerator.print("sample grids: PNG decoded with the pipeline's VAE" if decoder is not None else
                          f"sample grids: {cfg.pretrained} has no VAE, writing latents only (samples/*.safetensors)")
    if accelerator.is_main_process:
        env_path = os.path.join(cfg.output_dir, "env.json")
        session = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv, "resumed_from": ckpt,
                   "start_step": state.step, "changed_on_resume": changed, "world_size": world}
        T.env_snapshot(env_path, cfg, {"world_size": world, "resumed_from": ckpt, "seed": cfg.seed, "device": str(device),
                                       "changed_on_resume": changed, "fsdp": fsdp,
                                       "sessions": R.env_sessions(env_path, session, ckpt is None)})
    if cfg.report_to != "none":
        accelerator.init_trackers("rcm", config={k: str(v) for k, v in vars(cfg).items()})
    metrics = T.MetricsWriter(os.path.join(cfg.output_dir, "metrics.jsonl"), state.step, accelerator.is_main_process)
    T.MetricsWriter(os.path.join(cfg.output_dir, "spikes.jsonl"), state.step, accelerator.is_main_process)  # same trim
    guard = T.SpikeGuard(state.guard, cfg.spike_factor, cfg.spike_patience)

    n_micro, B = cfg.gradient_accumulation_steps, cfg.batch_size
    seeding = noise_seeding_of(cfg)
    # the per-sample losses are reduced over a micro-batch; accelerator.backward divides by n_micro, which makes a
    # mean over the whole batch; a sum over it must undo that division
    loss_scale = float(n_micro) if cfg.loss_reduction == "sum" else 1.0
    # context parallel: every rank of a group holds the same loss and its share of the gradient (the group's sum is
    # the sample's gradient); DDP averages over all world = dp_world x cp processes, hence the factor cp
    loss_scale *= cp
    guide = cfg.flux_guidance if getattr(transformer.config, "guidance_embeds", False) else None
    bar = tqdm(range(state.step, cfg.max_steps), initial=state.step, total=cfg.max_steps,
               disable=not (cfg.progress and accelerator.is_local_main_process), desc="rCM")
    for i in bar:
        t0 = time.perf_counter()
        plan = plan_step(i, cfg.tangent_warmup, cfg.student_update_freq, cfg.max_simulation_steps, nets.has_fake)
        role = "student" if plan.student else "fake"
        # the process's batch_size x n_micro samples of this optimizer step, run as n_micro micro-batches
        ids = batch_indices(len(data), B * n_micro, i, dp_rank, dp_world, cfg.seed)
        x0_all, cond_all, uncond_all = model_inputs(data.family, data.get(ids), device, nets.model_dtype, guide)
        if pairs is not None and plan.student:  # the ODE pairs of the regression term, a stream of their own
            z_all, y_all, p_cond_all = pair_inputs(pairs.family, pairs.get(pair_indices(len(pairs), B * n_micro, i, dp_rank,
                                                   dp_world, cfg.seed)), device, nets.model_dtype, guide)
        gen_all = step_noise(seeding, cfg.seed, i, dp_rank, B * n_micro, device=device.type if device.type != "mps" else "cpu")
        for o in opts.values():
            o.zero_grad(set_to_none=True)
        parts = []
        for m in range(n_micro):
            rows = (m * B, (m + 1) * B, B * n_micro)
            x0, cond, uncond = (T.batch_rows(v, *rows) for v in (x0_all, cond_all, uncond_all))
            gen = gen_all[m * B:(m + 1) * B] if n_micro > 1 else gen_all

            def backward(loss, last, final=m == n_micro - 1):
                with T.no_sync_unless(accelerator, sync_module[role], last and final):
                    accelerator.backward(loss * loss_scale)

            with accelerator.accumulate(sync_module[role]):
                if plan.student:
                    nvm = cfg.video_noise_multiplier or video_noise_multiplier(x0, data.family)
                    pr = None if pairs is None else tuple(T.batch_rows(v, *rows) for v in (z_all, y_all, p_cond_all))
                    parts.append(T.student_step(nets, x0, cond, uncond, plan, cfg, gen, backward, noise_multiplier=nvm, pairs=pr))
                else:
                    parts.append(T.fake_step(nets, x0.shape, cond, plan, cfg, gen, backward, device))
        logs = T.merge_logs(parts)

        if fsdp:  # adapters are replicated, not sharded: average their gradients as DDP would
            FS.all_reduce_grads(params[role])
        # clip, guard, step
        if cfg.max_grad_norm > 0:
            norm = float(accelerator.clip_grad_norm_(params[role], cfg.max_grad_norm))
        else:
            norm = T.grad_norm(params[role])
        finite = math.isfinite(norm)
        if finite or not cfg.skip_nonfinite:
            opts[role].step()
            scheds[role].step()
            if plan.student and ema is not None:
                ema.update(nets.trainable_parameters("student"), plan.student_eff)
        else:
            R.note_skip(state, cfg, i, role, norm, ids, accelerator.print)
        if guard.check(role, norm) and accelerator.is_main_process:
            with open(os.path.join(cfg.output_dir, "spikes.jsonl"), "a") as f:
                f.write(json.dumps({"step": i, "net": role, "grad_norm": norm, "batch_ids": ids,
                                      "seed": step_seed(cfg.seed, i, dp_rank, 0), "noise_seeding": seeding, **logs}) + "\n")
        state.step = i + 1

        record = {"step": i, "net": role, "student_eff": plan.student_eff, "fake_eff": plan.fake_eff,
                  "lr": scheds[role].get_last_lr()[0], "grad_norm": norm, "skipped": state.skipped,
                  "step_time": time.perf_counter() - t0, "peak_mem_mb": peak_memory_mb(device), **logs}
        bar.set_postfix({k: f"{v:.3g}" for k, v in record.items() if k.startswith("loss")})
        T.end_of_step(accelerator, cfg, i, record, metrics, checkpointer)
        if cfg.sample_every and state.step % cfg.sample_every == 0 and accelerator.is_main_process:
            T.write_samples(nets, data, cfg, state.step, device, transformer, decoder=decoder)
        T.exit_if_asked(accelerator, cfg, i)

    # ---- replicas must agree (DDP keeps them in sync; a drift here is a bug worth stopping for)
    with torch.no_grad():
        checksum = torch.stack([p.double().sum() for p in nets.trainable_parameters("student").values()]).sum()
    sums = accelerator.gather(checksum.reshape(1).to(device)).tolist()
    if len(set(sums)) != 1:
        raise RuntimeError(f"student weights differ across ranks: {sums}")
    R.check_learned(nets.trainable_parameters("student"), state.init_checksum, state, cfg)

    # ---- final checkpoint and exports
    checkpointer.save(cfg.output_dir, state.step, dataclasses.asdict(cfg), cfg.checkpoints_total_limit)
    if accelerator.is_main_process:
        T.export_student(pipeline_cls, cfg, accelerator.unwrap_model(nets.modules["student"]), ema)
        if cfg.sample_every:
            T.write_samples(nets, data, cfg, state.step, device, transformer, decoder=decoder)
        # written last and atomically: its presence means the run and its exports are complete
        tmp = os.path.join(cfg.output_dir, "final.json.tmp")
        with open(tmp, "w") as f:
            json.dump({"step": state.step, "skipped": state.skipped, "skipped_steps": state.skipped_steps,
                       "skipped_fraction": state.skipped / max(1, state.step), "student_checksum_per_rank": sums,
                       "files": R.export_files(cfg.output_dir)}, f)
        os.replace(tmp, os.path.join(cfg.output_dir, "final.json"))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    R.run_main(main)
