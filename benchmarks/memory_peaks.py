"""Measured peak memory of the training phases at a real Wan width, against the memory model.

Builds the real Wan architecture (``rcm_diffusers/arch_configs``, random weights; in bf16 the modules
``from_pretrained`` keeps in float32 stay float32) at full width cut to a few blocks,
sets up the trainer's networks (shared frozen base, LoRA student and fake score, JVP attention, the checkpointing
policy, Ulysses context parallelism when launched on several processes) and traces torch's allocator
(``rcm_diffusers.distill.memory.allocation_trace``) through each phase of a training step:

* ``jvp``: the sCM tangent, ``torch.func.jvp`` of the student (fd_type 0, no grad), against the model's ``jvp``
  (+ ``cp_exchange`` under context parallelism);
* ``nograd``: a no-grad student forward, against ``nograd``;
* ``grad``: one grad-enabled student forward and its backward, against ``activations + backward + grads``; split
  into ``saved`` (what the forward leaves for the backward: the held part of the activations) and ``backward`` (what
  the backward adds on top: the recompute, ``backward`` and the grads);
* ``step``: the trainer's own ``student_step`` (DMD, then sCM with the exact JVP) and ``fake_step`` with their AdamW
  steps, against ``grads + step_peak``.

Each value is the peak a phase adds on top of what was allocated when it began (weights, adapters, optimizer
state), so allocator slack and the runtime do not enter. Prints a markdown table; ``--out`` writes JSON.

    python benchmarks/memory_peaks.py --policies off,full,selective
    python -m torch.distributed.run --nproc_per_node 2 benchmarks/memory_peaks.py --policies off,full   # CP 2, gloo
    python benchmarks/memory_peaks.py --rescore rows.json   # an earlier --out against the current model
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from rcm_diffusers.arch import build_transformer  # noqa: E402
from rcm_diffusers.distill import losses as L  # noqa: E402
from rcm_diffusers.distill import terms as T  # noqa: E402
from rcm_diffusers.distill.memory import GiB, TrainSetup, allocation_trace, held_bytes, predict_training  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--arch", default="wan2.1-t2v-1.3b", help="architecture of rcm_diffusers/arch_configs (Wan)")
    p.add_argument("--num_layers", type=int, default=2, help="blocks kept (full width)")
    p.add_argument("--frames", type=int, default=4, help="latent frames")
    p.add_argument("--hw", type=int, default=40, help="latent height = width (tokens = frames * hw^2 / 4)")
    p.add_argument("--text_tokens", type=int, default=512, help="text tokens (WanPipeline pads prompts to 512)")
    p.add_argument("--lora_rank", type=int, default=32, help="LoRA rank of student and fake score")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="weights; bfloat16 runs under bf16 autocast with float32 adapters, as the shipped configs",
    )
    p.add_argument("--policies", default="off,full,selective", help="checkpointing policies to measure (off = none)")
    p.add_argument(
        "--phases",
        default="jvp,nograd,grad,step",
        help="phases to measure, comma-separated (grad also gives saved and backward)",
    )
    p.add_argument(
        "--jvp_chunk",
        type=int,
        default=0,
        help="query rows per chunk of the CPU attention JVP (0: its default, 1024); the score matrices it holds "
        "scale with it, which separates them from the rest of the JVP working set",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default=None, help="write the rows as JSON here (rank 0)")
    p.add_argument(
        "--rescore",
        default=None,
        metavar="JSON",
        help="measure nothing: recompute the predictions of an earlier --out file with the current model",
    )
    return p.parse_args(argv)


def setup_networks(a, policy: str, group):
    from rcm_diffusers.attention import enable_jvp_attention
    from rcm_diffusers.attention.ulysses import enable_context_parallel
    from rcm_diffusers.distill.activation_checkpointing import enable_checkpointing
    from rcm_diffusers.distill.adapters import Networks

    dtype = getattr(torch, a.dtype)
    m = build_transformer(a.arch, dtype=dtype, keep_fp32=True, num_layers=a.num_layers)
    nets, trainable = Networks.build(m, "shared", with_fake=True, lora_rank=a.lora_rank, time_input="float")
    enable_jvp_attention(m)
    if group is not None:
        enable_context_parallel(m, group)
    if policy != "off":
        enable_checkpointing(m, policy, a.lora_rank)
    return m, nets


def row_setup(row: dict) -> TrainSetup:
    """The memory model's setup of one measured row (``--out`` JSON)."""
    from rcm_diffusers.arch import arch_config, arch_meta

    cfg = dict(arch_config(row["arch"]), num_layers=row["num_layers"])
    policy = row["policy"]
    s = TrainSetup.from_config(
        cfg,
        arch_meta(row["arch"])["class_name"],
        tokens=row["tokens"],
        text_tokens=row["text_tokens"],
        lora_rank=row["lora_rank"],
        weight_dtype=row["dtype"],
        gradient_checkpointing=policy != "off",
        checkpointing_policy="full" if policy == "off" else policy,
        context_parallel=row["cp"],
    )
    s.cpu_attention_chunk = row.get("jvp_chunk") or s.cpu_attention_chunk  # 0: the kernel's default
    return s


def predicted_phases(s: TrainSetup) -> dict:
    """The model's bytes for each measured phase of setup ``s`` (the module docstring says which terms)."""
    pred = predict_training(s, device="cpu")
    held = held_bytes(s)
    exchange = pred["cp_exchange"]  # one all-to-all's send and receive buffers, freed before the next
    work = max(pred["backward"], pred["forward"])  # the backward's working set or the (re)computed forward's transient
    return {
        "jvp": pred["jvp"] + exchange,
        "nograd": pred["nograd"] + exchange,
        "saved": held,
        "backward": pred["activations"]
        - held
        + (work if s.gradient_checkpointing else pred["backward"])
        + pred["grads"],
        "grad": pred["activations"] + work + pred["grads"] + exchange,
        "step": pred["grads"] + pred["step_peak"],
    }


def print_rows(rows: list) -> None:
    r0 = rows[0]
    P = r0["cp"]
    print(
        f"\n{r0['arch']} width, {r0['num_layers']} blocks, {r0['dtype']}, {r0['tokens']} video tokens (CP {P}: "
        f"{-(-r0['tokens'] // P)} per rank), {r0['text_tokens']} text tokens, LoRA r{r0['lora_rank']}\n"
    )
    print(
        "| rank | policy | phase | measured (GiB) | predicted (GiB) | measured / predicted |\n|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['rank']} | {r['policy']} | {r['phase']} | {r['measured'] / GiB:.3f} "
            f"| {r['predicted'] / GiB:.3f} | {r['ratio']:.3f} |"
        )


def rescore(path: str, out: str | None) -> None:
    """Recompute ``predicted`` and ``ratio`` of the rows in ``path`` with the current model (the measured bytes
    stay)."""
    with open(path) as f:
        rows = json.load(f)
    for r in rows:
        r["predicted"] = predicted_phases(row_setup(r))[r["phase"]]
        r["ratio"] = r["measured"] / r["predicted"]
    print_rows(rows)
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


def main(argv=None):
    a = parse_args(argv)
    if a.rescore:
        return rescore(a.rescore, a.out)
    phases = set(a.phases.split(","))
    if phases - {"jvp", "nograd", "grad", "step"}:
        raise SystemExit(
            f"--phases: unknown {sorted(phases - {'jvp', 'nograd', 'grad', 'step'})}; "
            "choose from jvp, nograd, grad, step"
        )
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.jvp_chunk:
        import functools

        from rcm_diffusers.attention import function as attention_function

        attention_function.jvp_attention_torch = functools.partial(
            attention_function.jvp_attention_torch, chunk=a.jvp_chunk
        )
    P, rank, group = 1, 0, None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist

        from rcm_diffusers.attention.ulysses import context_parallel_groups

        dist.init_process_group("gloo")
        P, rank = dist.get_world_size(), dist.get_rank()
        _, _, group = context_parallel_groups(P)
    dtype = getattr(torch, a.dtype)
    tokens = a.frames * a.hw * a.hw // 4
    rows = []
    for policy in a.policies.split(","):
        m, nets = setup_networks(a, policy, group)
        cfg = m.config
        # what each row records of its setup; the model's setup is read back from it, as --rescore does
        meta = dict(
            policy=policy,
            tokens=tokens,
            cp=P,
            dtype=a.dtype,
            arch=a.arch,
            text_tokens=a.text_tokens,
            lora_rank=a.lora_rank,
            num_layers=a.num_layers,
            jvp_chunk=a.jvp_chunk,
        )
        s = row_setup(meta)
        g = torch.Generator().manual_seed(0)  # one sample for every rank of the CP group
        x0 = torch.randn(1, cfg.in_channels, a.frames, a.hw, a.hw, generator=g, dtype=torch.float64)
        cond = {"encoder_hidden_states": torch.randn(1, a.text_tokens, cfg.text_dim, generator=g).to(dtype)}
        t = torch.tensor([0.9], dtype=torch.float64)
        x_t = torch.cos(t) * x0 + torch.sin(t) * torch.randn(x0.shape, generator=g, dtype=torch.float64)
        opt = {r: torch.optim.AdamW(list(nets.trainable_parameters(r).values()), lr=1e-5) for r in ("student", "fake")}
        ema = {k: p.detach().float().clone() for k, p in nets.trainable_parameters("student").items()}
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)

        def backward(loss, last):
            loss.backward()

        scfg = SimpleNamespace(
            dmd_weight=1.0,
            scm_weight=1.0,
            p_D_shift=5.0,
            guidance_scale=1.0,
            loss_reduction="mean",
            tangent_warmup=0,
            fd_type=0,
            fd_h=1e-4,
            P_mean=-0.8,
            P_std=1.6,
            cm_type="scm",
            max_simulation_steps=2,
        )
        from rcm_diffusers.distill.alternation import StepPlan

        def train_step(i):
            for role, step in (("student", True), ("fake", False)):
                opt[role].zero_grad(set_to_none=True)
                plan = StepPlan(i=i, student=step, student_eff=10, fake_eff=10, dmd=True, n_sim=2)
                with autocast:
                    if step:
                        T.student_step(nets, x0, cond, None, plan, scfg, torch.Generator().manual_seed(i), backward)
                    else:
                        T.fake_step(nets, x0.shape, cond, plan, scfg, torch.Generator().manual_seed(i), backward, "cpu")
                opt[role].step()
                opt[role].zero_grad(set_to_none=True)
            for k, p in nets.trainable_parameters("student").items():
                ema[k].lerp_(p.detach().float(), 0.1)

        t0 = time.time()
        train_step(0)  # AdamW state exists from here on, as in every step but the first
        measured = {}
        with allocation_trace() as tr:
            if "jvp" in phases:
                F_T = T.teacher_F(nets, x_t, t, cond, None, 1.0).detach()
                tr.mark("jvp0")
                with autocast:
                    L.scm_dF(nets.F_fn("student", cond), x_t, t, F_T, fd_type=0)
                tr.mark("jvp1")
                del F_T
            if "nograd" in phases:
                tr.mark("nograd0")
                with torch.no_grad(), autocast:
                    F = nets.F("student", x_t, t, cond)
                tr.mark("nograd1")
                del F
            if "grad" in phases:
                opt["student"].zero_grad(set_to_none=True)
                tr.mark("grad0")
                with autocast:
                    F = nets.F("student", x_t, t, cond)
                loss = (F.float() ** 2).mean()
                tr.mark("backward0")
                loss.backward()
                tr.mark("grad1")
                del F, loss
                opt["student"].zero_grad(set_to_none=True)
            if "step" in phases:
                tr.mark("step0")
                train_step(1)
                tr.mark("step1")
        for ph in ("jvp", "nograd", "grad", "step"):
            if ph in phases:
                measured[ph] = tr.peak(ph + "0", ph + "1")
        if "grad" in phases:  # what the forward leaves for the backward, and what the backward adds on top
            measured["saved"] = tr.live("grad0", "backward0")
            measured["backward"] = tr.peak("backward0", "grad1")
        predicted = predicted_phases(s)
        for ph, v in measured.items():
            pr = predicted.get(ph, float("nan"))
            rows.append(
                dict(
                    meta,
                    phase=ph,
                    measured=v,
                    predicted=pr,
                    ratio=v / pr,
                    rank_tokens=-(-tokens // P),
                    rank=rank,
                    seconds=time.time() - t0,
                )
            )
        m = nets = opt = ema = None  # free this policy's model before the next one is built
    if group is not None:  # every rank's rows, printed and written by rank 0
        import torch.distributed as dist

        gathered = [None] * P
        dist.all_gather_object(gathered, rows)
        rows = sum(gathered, [])
        dist.destroy_process_group()
    if rank == 0:
        print_rows(rows)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
