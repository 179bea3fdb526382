"""The rCM trainer: ``RCMTrainer(config).train()`` distills a rectified-flow teacher (Wan T2V/I2V, Flux) into a
1-4 step student with ``L = L_sCM + lambda L_DMD`` (docs/math.md §4; ``cm_type dcm``: the JVP-free ``L_dCM``, §4.6).
The default mode trains two LoRA adapters on one frozen base (docs/math.md §6).

From Python (docs/training.md, "From Python")::

    from rcm_diffusers.distill import RCMConfig, RCMTrainer
    RCMTrainer(RCMConfig.from_yaml("my.yaml", output_dir="out")).train()

From a shell: ``accelerate launch training/rcm.py --config FILE.yaml [--key value ...]`` in a clone, or
``accelerate launch -m rcm_diffusers.distill.rcm_trainer ...`` / ``rcm-distill ...`` after ``pip install``.
Outputs in ``output_dir``: ``env.json``, ``metrics.jsonl``, ``checkpoints/step-*`` (``--resume latest`` continues
exactly), the student LoRA (``pytorch_lora_weights.safetensors``), its power-EMA variant in ``ema/``, ``scheduler/``
and ``final.json``.
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch

from . import fsdp as FS
from .adapters import Networks
from .alternation import optimizer_steps, plan_of
from .checkpoints import Checkpointer
from .config import RCMConfig, noise_seeding_of
from .data import (
    LatentDataset,
    batch_indices,
    batch_rows,
    model_inputs,
    pair_indices,
    pair_inputs,
    step_noise,
    step_seed,
    video_noise_multiplier,
)
from .ddp import ddp_jvp_bypass, no_buffer_sync_in_forward, no_sync_unless
from .ema import PowerEMA
from .errors import user_error
from .experts import switch_of
from .guards import SpikeGuard, grad_norm, note_skip
from .optim import adamw, lr_lambda
from .session import DTYPES, RunSession, make_accelerator, merge_logs, peak_memory_mb
from .terms import StudentBatch, fake_step, needs_jvp, run_student_terms, student_terms

__all__ = ["RCMTrainer", "main"]


class RCMTrainer:
    """One rCM run. ``__init__`` checks the inputs (teacher folder, datasets) before anything is written;
    ``train()`` takes the run folder, builds teacher / student / fake score, runs the iterations and exports."""

    def __init__(self, config: RCMConfig):
        from .inputs import check_inputs

        self.cfg = config.validate()
        check_inputs(self.cfg)  # the teacher's weight format and the whole dataset, before the run folder or a model
        from .lowmem import startup_check

        startup_check(self.cfg, print if int(os.environ.get("RANK", "0")) == 0 else (lambda *a: None))
        # beside the memory line: the compute and time the cost model predicts (distill.cost)
        if int(os.environ.get("RANK", "0")) == 0:
            from .cost import startup_report

            print(startup_report(self.cfg))
        self.lowmem = None

    # ------------------------------------------------------------------ building
    def _accelerator(self):
        from accelerate.utils import DistributedDataParallelKwargs

        # student and fake score train disjoint parameters on alternate iterations; the per-forward buffer broadcast
        # is switched off on the wrappers after prepare (ddp.no_buffer_sync_in_forward)
        handler = DistributedDataParallelKwargs(find_unused_parameters=True)
        return make_accelerator(self.cfg, kwargs_handlers=[handler])

    def _networks(self, device, log):
        """The frozen base (one network or both experts), its adapters, checkpointing and JVP attention."""
        import diffusers

        from .base_model import load_transformer
        from .inputs import model_index

        cfg = self.cfg
        torch.manual_seed(cfg.seed)  # adapter init (lora_A) draws from the global RNG: the same on every rank
        index = model_index(cfg.pretrained)
        self.pipeline_cls = getattr(diffusers, index["_class_name"])
        transformer_cls = getattr(diffusers, index[cfg.transformer_subfolder][1])
        # one card (distill.lowmem): the base is loaded on the host and only what stays resident goes to the device
        one_card = (
            cfg.base_dtype != "weight_dtype" or cfg.blocks_to_swap > 0 or cfg.activation_offload or cfg.base_weights
        )
        stores, base_dtype = None, cfg.base_dtype
        if cfg.base_weights:  # block Linears already quantized in a file: never loaded in weight_dtype
            from .base_weights import load_base

            self.transformer, stores, base_dtype = load_base(transformer_cls, cfg, DTYPES[cfg.weight_dtype], log)
        else:
            self.transformer = load_transformer(
                transformer_cls, cfg, index, DTYPES[cfg.weight_dtype], torch.device("cpu") if one_card else device, log
            )
        if transformer_cls.__name__ == "HunyuanVideo15Transformer3DModel":
            # key-padding attention masks: the same outputs without the stock [B, 1, L, L] masks (docs/training.md)
            from ..attention.hunyuan15 import enable_key_padding_mask

            enable_key_padding_mask(self.transformer)
        nets, trainable = Networks.build(
            self.transformer,
            cfg.mode,
            with_fake=cfg.use_dmd,
            lora_rank=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha or None,
            lora_target_modules=cfg.lora_target_modules or None,
            fake_lora_rank=cfg.fake_lora_rank or None,
            time_input=cfg.time_input,
        )
        if one_card:
            from .lowmem import apply_low_memory

            self.lowmem = apply_low_memory(
                self.transformer,
                base_dtype=base_dtype,
                blocks_to_swap=cfg.blocks_to_swap,
                activation_offload=cfg.activation_offload,
                device=device,
                stores=stores,
            )
            log(f"one card: {self.lowmem.describe()}")
        if cfg.gradient_checkpointing:  # selective recomputes the rank-r LoRA up-projections
            from .activation_checkpointing import enable_checkpointing

            for m in trainable.values():
                enable_checkpointing(
                    m, cfg.checkpointing_policy, max(cfg.lora_rank, cfg.fake_lora_rank) if cfg.mode == "shared" else 0
                )
        if needs_jvp(cfg):  # sCM with fd_type 0/1 only; dCM, fd_type 2 and DMD alone keep the stock processors
            from ..attention import enable_jvp_attention
            from ..attention.linear_jvp import enable_linear_jvp

            for m in {id(m): m for m in nets.modules.values()}.values():
                enable_jvp_attention(m)
                enable_linear_jvp(m)  # one product per linear layer in the JVP pass, not two (the same tangent)
        return nets, trainable

    def _context_parallel(self, nets, world):
        """Ulysses context parallelism: groups of ``context_parallel_size`` consecutive ranks run one sample; data
        parallelism runs across the groups. Returns ``(dp_rank, dp_world)``."""
        cp, rank = self.cfg.context_parallel_size, self.acc.process_index
        if cp == 1:
            return rank, world
        from ..attention import enable_jvp_attention
        from ..attention.ulysses import check_context_parallel, context_parallel_groups, enable_context_parallel

        try:
            check_context_parallel(self.transformer, cp)
            if world == 1:
                user_error(f"context_parallel_size {cp} needs {cp} x k processes, this run has 1")
            dp_rank, dp_world, group = context_parallel_groups(cp)
            for m in {id(m): m for m in nets.modules.values()}.values():
                enable_jvp_attention(m)  # stock attention outside a JVP pass; the processors carry the exchange
                enable_context_parallel(m, group)
        except ValueError as e:
            user_error(str(e))
        return dp_rank, dp_world

    # ------------------------------------------------------------------ the run
    def train(self) -> str:
        """Run (or resume) the distillation; returns ``output_dir`` once ``final.json`` is written."""
        cfg = self.cfg
        fsdp = FS.take_fsdp_request()  # an FSDP2 accelerate config: the trainer shards the frozen base itself
        if fsdp and cfg.mode != "shared":  # refused before the run folder is touched
            user_error(
                "FSDP2 is supported in shared-base LoRA mode (--mode shared); full mode: use DDP "
                "(training/accelerate/ddp_8gpu.yaml)"
            )
        acc = self.acc = self._accelerator()
        device, world = acc.device, acc.num_processes
        session = RunSession(cfg, acc, "rcm")
        nets, trainable = self._networks(device, acc.print)
        dp_rank, dp_world = self._context_parallel(nets, world)
        cp = cfg.context_parallel_size
        if fsdp:
            if switch_of(self.transformer) is not None:
                switch_of(self.transformer).run_both = True  # every rank joins both experts' collectives in every call
            FS.shard_frozen_base(self.transformer, **fsdp)

        # optimizers: separate for student and fake score (docs/math.md §4.4)
        roles = ["student"] + (["fake"] if nets.has_fake else [])
        opts = {
            r: adamw(list(nets.trainable_parameters(r).values()), cfg.lr if r == "student" else cfg.fake_lr, cfg)
            for r in roles
        }
        total = optimizer_steps(
            cfg.max_steps, cfg.tangent_warmup, cfg.student_update_freq, nets.has_fake, cfg.regression_warmup
        )
        scheds = {
            r: torch.optim.lr_scheduler.LambdaLR(
                o, lr_lambda(cfg.lr_warmup_steps, total[r], cfg.lr_decay, cfg.lr_final_ratio, cfg.lr_decay_fraction)
            )
            for r, o in opts.items()
        }
        names = list(trainable)
        wrap = [] if fsdp else names  # FSDP2: sharded above; accelerate must not add a DDP wrapper
        prepared = acc.prepare(*[trainable[n] for n in wrap], *[opts[r] for r in roles], *[scheds[r] for r in roles])
        modules = {**trainable, **dict(zip(wrap, prepared[: len(wrap)]))}
        for m in modules.values():
            no_buffer_sync_in_forward(m)
            ddp_jvp_bypass(m)  # the JVP passes (no_grad) call the module inside a DDP wrapper
        nets.replace_modules(modules)
        opts = dict(zip(roles, prepared[len(wrap) : len(wrap) + len(roles)]))
        scheds = dict(zip(roles, prepared[len(wrap) + len(roles) :]))
        params = {r: list(nets.trainable_parameters(r).values()) for r in roles}

        # checkpointed state: counters, EMA, optimizers, schedulers, RNG, trainable weights (no frozen base)
        ema = PowerEMA(nets.trainable_parameters("student"), s=cfg.ema_rate) if cfg.ema_rate > 0 else None
        checkpointer = Checkpointer(
            acc,
            ([modules[n] for n in names], names),
            {r: (opts[r], nets.trainable_parameters(r)) for r in roles},
            scheds,
            session.state,
            ema,
        )

        data = LatentDataset(cfg.data_dir)
        pairs = LatentDataset(cfg.regression_data_dir) if cfg.regression_weight > 0 else None
        if cp > 1:
            n_tok = math.prod(
                n // p for n, p in zip(data.get([0])["latents"].shape[-3:], self.transformer.config.patch_size)
            )
            if n_tok % cp:
                user_error(f"context_parallel_size {cp}: a sample has {n_tok} video tokens, not divisible by {cp}")
        decoder = None
        if cfg.sample_every and acc.is_main_process:
            from .previews import SampleDecoder

            decoder = SampleDecoder.from_pretrained(cfg.pretrained, data.family, device, DTYPES[cfg.weight_dtype])
            acc.print(
                "sample grids: PNG decoded with the pipeline's VAE"
                if decoder is not None
                else f"sample grids: {cfg.pretrained} has no VAE, writing latents only (samples/*.safetensors)"
            )
        session.start(checkpointer, nets.trainable_parameters("student"), {"fsdp": fsdp})
        state = session.state
        guard = SpikeGuard(state.guard, cfg.spike_factor, cfg.spike_patience)
        terms = student_terms(cfg)

        n_micro, B = cfg.gradient_accumulation_steps, cfg.batch_size
        seeding = noise_seeding_of(cfg)
        # accelerator.backward divides each micro-batch's loss by n_micro (a mean over the whole batch); a sum must
        # undo that. Context parallel: every rank of a group holds the same loss and its share of the gradient, and
        # DDP averages over all world = dp_world x cp processes, hence the factor cp
        loss_scale = (float(n_micro) if cfg.loss_reduction == "sum" else 1.0) * cp
        guide = cfg.flux_guidance if getattr(self.transformer.config, "guidance_embeds", False) else None
        gen_device = device.type if device.type != "mps" else "cpu"
        bar = session.progress("rCM")
        for i in bar:
            t0 = time.perf_counter()
            plan = plan_of(cfg, i, nets.has_fake)
            role = "student" if plan.student else "fake"
            # the process's batch_size x n_micro samples of this optimizer step, run as n_micro micro-batches
            ids = batch_indices(len(data), B * n_micro, i, dp_rank, dp_world, cfg.seed)
            x0_all, cond_all, uncond_all = model_inputs(data.family, data.get(ids), device, nets.model_dtype, guide)
            if pairs is not None and plan.student:  # the ODE pairs of the regression term, a stream of their own
                p_ids = pair_indices(len(pairs), B * n_micro, i, dp_rank, dp_world, cfg.seed)
                pair_all = pair_inputs(pairs.family, pairs.get(p_ids), device, nets.model_dtype, guide)
            gen_all = step_noise(seeding, cfg.seed, i, dp_rank, B * n_micro, device=gen_device)
            for o in opts.values():
                o.zero_grad(set_to_none=True)
            parts = []
            for m in range(n_micro):
                rows = (m * B, (m + 1) * B, B * n_micro)
                x0, cond, uncond = (batch_rows(v, *rows) for v in (x0_all, cond_all, uncond_all))
                gen = gen_all[m * B : (m + 1) * B] if n_micro > 1 else gen_all

                def backward(loss, last, final=m == n_micro - 1):
                    with no_sync_unless(acc, nets.modules[role], last and final):
                        acc.backward(loss * loss_scale)

                with acc.accumulate(nets.modules[role]):
                    if plan.student:
                        nvm = cfg.video_noise_multiplier or video_noise_multiplier(x0, data.family)
                        pr = None if pairs is None else tuple(batch_rows(v, *rows) for v in pair_all)
                        batch = StudentBatch(x0, cond, uncond, plan, nvm, pr)
                        parts.append(run_student_terms(terms, nets, batch, gen, backward))
                    else:
                        parts.append(fake_step(nets, x0.shape, cond, plan, cfg, gen, backward, device))
            logs = merge_logs(parts)

            if fsdp:  # adapters are replicated, not sharded: average their gradients as DDP would
                FS.all_reduce_grads(params[role])
            if cfg.max_grad_norm > 0:
                norm = float(acc.clip_grad_norm_(params[role], cfg.max_grad_norm))
            else:
                norm = grad_norm(params[role])
            if math.isfinite(norm) or not cfg.skip_nonfinite:
                opts[role].step()
                scheds[role].step()
                if plan.student and ema is not None:
                    ema.update(nets.trainable_parameters("student"), plan.student_eff)
            else:
                note_skip(state, cfg, i, role, norm, ids, acc.print)
            if guard.check(role, norm):
                session.spike(
                    {
                        "step": i,
                        "net": role,
                        "grad_norm": norm,
                        "batch_ids": ids,
                        "seed": step_seed(cfg.seed, i, dp_rank, 0),
                        "noise_seeding": seeding,
                        **logs,
                    }
                )
            record = {
                "step": i,
                "net": role,
                "student_eff": plan.student_eff,
                "fake_eff": plan.fake_eff,
                "lr": scheds[role].get_last_lr()[0],
                "grad_norm": norm,
                "skipped": state.skipped,
                "step_time": time.perf_counter() - t0,
                "peak_mem_mb": peak_memory_mb(device),
                **logs,
            }
            bar.set_postfix({k: f"{v:.3g}" for k, v in record.items() if k.startswith("loss")})
            session.end_of_step(i, record)
            if cfg.sample_every and state.step % cfg.sample_every == 0 and acc.is_main_process:
                self._samples(nets, data, state.step, device, decoder)
            session.exit_if_asked(i)

        sums = session.finish(nets.trainable_parameters("student"))
        if acc.is_main_process:
            from .export import export_student

            export_student(self.pipeline_cls, cfg, acc.unwrap_model(nets.modules["student"]), ema)
            if cfg.sample_every:
                self._samples(nets, data, state.step, device, decoder)
        session.write_final(sums)
        return cfg.output_dir

    def _samples(self, nets, data, step, device, decoder):
        from .previews import write_samples

        write_samples(nets, data, self.cfg, step, device, self.transformer, decoder=decoder)


def main(argv=None, default_config: str | None = None) -> None:
    """Command line: ``--verify RUN_DIR`` checks a finished run; else ``RCMTrainer(load_config(argv)).train()`` with
    bad input reported in one line (``errors.run_main``)."""
    from .errors import load_config_or_exit, run_main
    from .run_folder import verify_main

    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["--verify"]:  # check a finished run's exports against final.json (docs/training.md)
        raise SystemExit(verify_main(args[1:]))

    def run():
        cfg = load_config_or_exit(args, default_config=default_config, config_cls=RCMConfig)
        RCMTrainer(cfg).train()

    run_main(run)


if __name__ == "__main__":
    main()
