"""What an iteration costs (docs/benchmarks.md, "What a distillation costs"): passes counted, time measured.

Two tables:

* ``--recipes`` (default): each recipe trains a few iterations through the real trainer (``RCMTrainer`` /
  ``QADTrainer``) in a process of its own (one torch thread, the recipes one after the other) on Wan2.1-T2V-1.3B at
  its real width cut to ``--num_layers`` blocks, random weights, float32 on CPU; ``passes.PassCounter`` counts the
  passes of every iteration. Every clock of that process reads its CPU time (``time.perf_counter`` is
  ``time.process_time`` there), so other jobs on a shared host change the numbers little. Each iteration's time (the
  trainer's own ``step_time`` in ``metrics.jsonl``: everything the iteration does) is divided by one teacher forward
  timed inside the same iteration (and taken out of it), and set beside the *counted* cost: the iteration's passes
  weighted by their FLOPs (``rcm_diffusers.distill.cost.pass_flops`` at this size) in the same unit. The pass kinds
  are also timed alone (``units``; the JVP with PyTorch's own linear rule too), so an excess shows whether it sits in
  a kind of pass or outside the passes. Iterations 0 and 1 warm up; the next ``--repeats`` of each role give the
  median. ``max_simulation_steps`` is 1, so every student iteration is the same (each further simulation step adds
  one no-grad forward).
* ``--gpu-hours``: the FLOP and time model for the shipped configs (``training/configs``; 1.3B, 14B, A14B T2V / I2V
  with both experts) at 480p and 720p x 81 frames, per iteration and per run (their ``max_steps``, 8 processes as
  their accelerate configs), on the cards of ``cost.GPUS`` at ``--utilisation``. No model is built.

    python benchmarks/cost_table.py --num_layers 2 --frames 4 --hw 24 --repeats 3 --out benchmarks/out/cost_table.json
    python benchmarks/cost_table.py --gpu-hours
    python benchmarks/cost_table.py --smoke      # 1 block, 2 heads, 2 recipes: the code path in seconds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

ARCH = "wan2.1-t2v-1.3b"
#: recipe -> overrides of the base rCM setup (``base_config``); "qad" runs the QAD trainer
RECIPES = {
    "sCM fd0 + DMD": {},
    "sCM fd0 + DMD, GC full": {"gradient_checkpointing": True},
    "sCM fd2 + DMD": {"fd_type": 2},
    "dCM + DMD": {"cm_type": "dcm"},
    "DMD alone": {"scm_weight": 0.0},
    "sCM fd0 alone": {"use_dmd": False},
    "sCM fd0 + DMD + regression": {"regression_weight": 1.0},
    "two experts, sCM fd0 + DMD": {"experts": "both"},
    "QAD (NVFP4, LoRA)": {"qad": True},
    "sCM fd0 + DMD, GC selective": {"gradient_checkpointing": True, "checkpointing_policy": "selective"},
    "DMD alone, GC full": {"scm_weight": 0.0, "gradient_checkpointing": True},
    "sCM fd2 + DMD, GC full": {"fd_type": 2, "gradient_checkpointing": True},
    "dCM + DMD, GC full": {"cm_type": "dcm", "gradient_checkpointing": True},
    "sCM fd0 + DMD + regression, GC full": {"regression_weight": 1.0, "gradient_checkpointing": True},
    "two experts, sCM fd0 + DMD, GC full": {"experts": "both", "gradient_checkpointing": True},
}
SMOKE_RECIPES = ["sCM fd0 + DMD", "QAD (NVFP4, LoRA)"]


# ----------------------------------------------------------------------------- set-up (parent)


def make_data(root: str, shape, text_tokens: int, text_dim: int, n: int = 4) -> str:
    """Latents with a ``noise`` field (so the set also serves as the regression term's ODE pairs), prompts and a
    negative prompt of ``text_tokens`` tokens."""
    from rcm_diffusers.distill.data import write_latent_dataset

    if os.path.exists(os.path.join(root, "meta.json")):
        return root
    g = torch.Generator().manual_seed(0)
    tables = {
        "prompt_embeds": torch.randn(n, text_tokens, text_dim, generator=g),
        "negative_prompt_embeds": torch.randn(1, text_tokens, text_dim, generator=g),
    }
    samples = {
        "latents": torch.randn(n, *shape, generator=g),
        "noise": torch.randn(n, *shape, generator=g),
        "prompt_index": torch.arange(n),
    }
    return write_latent_dataset(
        root,
        samples,
        family="wan",
        tables=tables,
        table_index={"prompt_embeds": "prompt_index", "negative_prompt_embeds": None},
    )


def make_two_experts(root: str, one: str, overrides: dict, boundary_ratio: float = 0.875) -> str:
    """A two-expert pipeline folder (``transformer`` = the random model of ``one``, ``transformer_2`` another seed)."""
    from rcm_diffusers.arch import build_transformer

    index = os.path.join(root, "model_index.json")
    if os.path.exists(index):
        return root
    os.makedirs(root, exist_ok=True)
    shutil.copytree(os.path.join(one, "transformer"), os.path.join(root, "transformer"), dirs_exist_ok=True)
    second = build_transformer(ARCH, dtype=torch.float32, seed=1, **overrides)
    second.save_pretrained(os.path.join(root, "transformer_2"))
    with open(os.path.join(one, "model_index.json")) as f:
        meta = json.load(f)
    meta.update({"transformer_2": ["diffusers", "WanTransformer3DModel"], "boundary_ratio": boundary_ratio})
    meta.pop("_rcm_random_arch", None)
    with open(index, "w") as f:
        json.dump(meta, f, indent=1)
    return root


def base_config(args, pipe: str, data: str, out: str) -> dict:
    """The rCM setup every recipe starts from: shared-base LoRA rank 64, CFG 5 with a negative prompt, DMD from
    iteration 0 with one simulation step, student and fake score alternating, power EMA, AdamW, float32."""
    return {
        "pretrained": pipe,
        "data_dir": data,
        "output_dir": out,
        "overwrite": True,
        "mode": "shared",
        "lora_rank": args.rank,
        "weight_dtype": "float32",
        "mixed_precision": "no",
        "fd_type": 0,
        "batch_size": 1,
        "max_steps": 2 * (args.repeats + 1),
        "tangent_warmup": 0,
        "student_update_freq": 2,
        "max_simulation_steps": 1,
        "dmd_weight": 0.01,
        "guidance_scale": 5.0,
        "lr": 1e-5,
        "fake_lr": 2e-6,
        "ema_rate": 0.1,
        "checkpoint_every": 0,
        "log_every": 1,
        "progress": False,
        "report_to": "none",
        "sample_every": 0,
    }


def qad_config(args, pipe: str, data: str, out: str) -> dict:
    """QAD as training/configs/qad-wan2.1-t2v-1.3b.yaml (NVFP4 weights + activations under ComfyUI's arithmetic, LoRA
    rank 64, CFG schedule), float32, no warm start, one calibration and one probe batch."""
    return {
        "pretrained": pipe,
        "data_dir": data,
        "output_dir": out,
        "overwrite": True,
        "weight_dtype": "float32",
        "mixed_precision": "no",
        "format": "nvfp4",
        "target": "comfyui",
        "act_scale": "static",
        "scope": "lora",
        "lora_rank": args.rank,
        "alpha": 0.1,
        "guidance": [[0.0, 2.0], [0.5, 6.0], [1.0, 5.0]],
        "shift": 5.0,
        "batch_size": 1,
        "max_steps": args.repeats + 1,
        "lr": 1e-4,
        "max_grad_norm": 1.0,
        "checkpoint_every": 0,
        "calibration_batches": 1,
        "eval_batches": 1,
        "log_every": 1,
        "progress": False,
        "report_to": "none",
        "export_layout": "diffusers",
        "ema_rate": 0.0,
    }


# ----------------------------------------------------------------------------- one recipe (child process)


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def child(cfg_path: str, repeats: int) -> dict:
    """Train ``cfg_path``'s recipe with every iteration's passes counted, then time the pass kinds alone."""
    import yaml

    from rcm_diffusers.distill import adapters, rcm_trainer
    from rcm_diffusers.distill.passes import PassCounter

    # every clock of this process is its CPU time (one torch thread): other jobs on a shared host change it little;
    # the trainer's step_time in metrics.jsonl is then the iteration's CPU seconds
    time.perf_counter = time.process_time
    with open(cfg_path) as f:
        raw = yaml.safe_load(f)
    qad = raw.pop("_qad", False)
    counters, refs, captured = [], [], {}

    def reference_forward() -> float:
        """CPU seconds of one teacher forward on a fixed input, taken inside each iteration (and subtracted from it),
        so that each iteration has a unit measured next to it."""
        if "ref" not in captured:
            if qad:
                from rcm_diffusers.models import velocity_fn

                x0, cond, *_ = _inputs(cfg, torch.float32)
                v = velocity_fn(captured["teacher"], cfg.time_input)
                captured["ref"] = lambda: v(x0.float(), torch.full((1,), 0.5), **cond)
            else:
                nets = captured["nets"]
                _, cond, _, x_t, t, _ = _inputs(cfg, nets.model_dtype)
                captured["ref"] = lambda: nets.F("teacher", x_t, t, cond)
        with torch.no_grad():
            t0 = time.process_time()
            captured["ref"]()
            return time.process_time() - t0

    def counted(fn):
        # one counter per call; it stays attached to the outputs it saw, so a backward after the call (QAD's
        # accelerator.backward) still lands on it
        def run(*a, **k):
            refs.append(reference_forward())
            modules = captured["modules"] if qad else captured["nets"].modules
            with PassCounter(modules) as c:
                out = fn(*a, **k)
            counters.append(c)
            return out

        return run

    if qad:
        from rcm_diffusers.distill import qad_student as Q
        from rcm_diffusers.distill import qad_trainer
        from rcm_diffusers.distill.config import QADConfig

        build = Q.build_student

        def build_student(teacher, cfg):
            student, layers = build(teacher, cfg)
            captured.update(modules={"teacher": teacher, "student": student}, teacher=teacher, student=student)
            return student, layers

        Q.build_student = build_student
        qad_trainer.qad_loss = counted(qad_trainer.qad_loss)
        cfg = QADConfig.from_yaml(None, **raw)
        qad_trainer.QADTrainer(cfg).train()
    else:
        from rcm_diffusers.distill.config import RCMConfig

        build = adapters.Networks.build.__func__

        def networks(cls, *a, **k):
            nets, trainable = build(cls, *a, **k)
            captured["nets"] = nets  # the trainer points its roles at the prepared modules later: read at each call
            return nets, trainable

        adapters.Networks.build = classmethod(networks)
        rcm_trainer.run_student_terms = counted(rcm_trainer.run_student_terms)
        rcm_trainer.fake_step = counted(rcm_trainer.fake_step)
        cfg = RCMConfig.from_yaml(None, **raw)
        rcm_trainer.RCMTrainer(cfg).train()
    per_iter = [c.passes(1) for c in counters]
    recs = [json.loads(ln) for ln in open(os.path.join(cfg.output_dir, "metrics.jsonl")) if ln.strip()]
    recs = [r for r in recs if r.get("step", -1) >= 0 and "step_time" in r]
    units = qad_units(captured, cfg, repeats) if qad else rcm_units(captured["nets"], cfg, repeats)
    return {
        "iterations": [
            {
                "step": r["step"],
                "net": r.get("net", "student"),
                "step_time": r["step_time"] - ref,
                "forward": ref,
                "passes": p,
            }
            for r, p, ref in zip(recs, per_iter, refs)
        ],
        "units": units,
        "threads": torch.get_num_threads(),
        "clock": "process CPU time",
    }


def _inputs(cfg, dtype):
    from rcm_diffusers.distill.data import LatentDataset, model_inputs
    from rcm_diffusers.trigflow import trigflow_noise

    data = LatentDataset(cfg.data_dir)
    x0, cond, uncond = model_inputs(data.family, data.get([0]), torch.device("cpu"), dtype)
    g = torch.Generator().manual_seed(0)
    eps = torch.randn(x0.shape, dtype=torch.float64, generator=g)
    t = torch.tensor([1.0], dtype=torch.float64)
    return x0, cond, uncond, trigflow_noise(x0, eps, t), t, torch.randn(x0.shape, dtype=torch.float64, generator=g)


def rcm_units(nets, cfg, repeats: int) -> dict:
    """Seconds of one pass of each kind alone: teacher forward, student forward with grad, its backward (with the
    recompute under checkpointing), and the student's JVP when the recipe takes one."""
    from rcm_diffusers.distill import losses as L
    from rcm_diffusers.distill.terms import needs_jvp

    _, cond, _, x_t, t, F_T = _inputs(cfg, nets.model_dtype)
    fwd, fg, bw, jvp = [], [], [], []
    with torch.no_grad():
        nets.F("teacher", x_t, t, cond)
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        with torch.no_grad():
            nets.F("teacher", x_t, t, cond)
        t1 = time.perf_counter()
        out = nets.F("student", x_t, t, cond)
        t2 = time.perf_counter()
        out.double().square().sum().backward()
        t3 = time.perf_counter()
        fwd.append(t1 - t0), fg.append(t2 - t1), bw.append(t3 - t2)
        if needs_jvp(cfg):
            t4 = time.perf_counter()
            with torch.no_grad():
                L.scm_dF(nets.F_fn("student", cond), x_t, t, F_T, fd_type=0)
            jvp.append(time.perf_counter() - t4)
    drop = slice(1, None)  # the first round warms up
    out = {"forward": _median(fwd[drop]), "forward_grad": _median(fg[drop]), "backward": _median(bw[drop])}
    if jvp:
        out["jvp"] = _median(jvp[drop])
        # the same JVP with PyTorch's own forward-mode rule of the linear layers (a second, zero product each)
        from rcm_diffusers.attention.linear_jvp import disable_linear_jvp, enable_linear_jvp
        from rcm_diffusers.models import _base_model

        base = _base_model(nets.modules["student"])
        disable_linear_jvp(base)
        stock = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            with torch.no_grad():
                L.scm_dF(nets.F_fn("student", cond), x_t, t, F_T, fd_type=0)
            stock.append(time.perf_counter() - t0)
        enable_linear_jvp(base)
        out["jvp_stock_linear_rule"] = _median(stock[drop])
    return out


def qad_units(captured, cfg, repeats: int) -> dict:
    """Seconds of the teacher's forward and of the quantized student's forward (with grad) and backward."""
    from rcm_diffusers.models import velocity_fn

    x0, cond, _, _, _, _ = _inputs(cfg, torch.float32)
    r = torch.full((1,), 0.5)
    x = x0.float()
    vt, vs = velocity_fn(captured["teacher"], cfg.time_input), velocity_fn(captured["student"], cfg.time_input)
    fwd, fg, bw = [], [], []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        with torch.no_grad():
            vt(x, r, **cond)
        t1 = time.perf_counter()
        out = vs(x, r, **cond)
        t2 = time.perf_counter()
        out.double().square().sum().backward()
        t3 = time.perf_counter()
        fwd.append(t1 - t0), fg.append(t2 - t1), bw.append(t3 - t2)
    return {"forward": _median(fwd[1:]), "student_forward_grad": _median(fg[1:]), "backward": _median(bw[1:])}


# ----------------------------------------------------------------------------- the tables (parent)


def counted_units(passes: dict, pf: dict) -> float:
    """Passes weighted by their FLOPs, in teacher forwards (checkpointing: the recompute is part of the backward)."""
    flops = sum(n * pf[role][kind] for role, kinds in passes.items() for kind, n in kinds.items())
    return flops / pf["teacher"]["forward"]


def measured_unit_cost(passes: dict, units: dict) -> float:
    """Passes weighted by the kinds' times measured alone, in teacher forwards (fake score = student; a recompute is
    inside the measured backward; a QAD student forward is its measured grad-enabled one)."""
    f = units["forward"]
    cost = 0.0
    for role, kinds in passes.items():
        for kind, n in kinds.items():
            if kind == "recompute":
                continue
            if kind == "forward":
                u = f
            elif kind == "forward_grad":
                u = units.get("forward_grad", units.get("student_forward_grad"))
            else:
                u = units[kind]
            cost += n * u
    return cost / f


def recipe_rows(results: dict, pf_by_gc: dict) -> list[dict]:
    rows = []
    for name, res in results.items():
        if "error" in res:
            rows.append({"recipe": name, "error": res["error"][-300:]})
            continue
        units = res["units"]
        by_role = {}
        for it in res["iterations"][2:] if not name.startswith("QAD") else res["iterations"][1:]:
            by_role.setdefault(it["net"], []).append(it)
        for role, its in by_role.items():
            passes = its[-1]["passes"]
            if any(i["passes"] != passes for i in its):
                differ = [i["passes"] for i in its]
                rows.append({"recipe": name, "error": f"{role} iterations differ in passes: {differ}"})
                continue
            pf = pf_by_gc[res["pf_key"]]
            counted = counted_units(passes, pf)
            measured = _median([i["step_time"] / i["forward"] for i in its])
            rows.append(
                {
                    "recipe": name,
                    "iteration": role,
                    "passes": passes,
                    "counted": counted,
                    "measured": measured,
                    "ratio": measured / counted,
                    "at_unit_cost": measured_unit_cost(passes, units),
                    "n": len(its),
                    "load": res.get("load"),
                }
            )
    return rows


def format_passes(p: dict) -> str:
    short = {"forward": "f", "forward_grad": "fg", "jvp": "jvp", "backward": "b", "recompute": "rc"}
    return "; ".join(
        f"{role[0].upper()} " + " ".join(f"{n:g}{short[k]}" for k, n in kinds.items()) for role, kinds in p.items()
    )


def recipes_table(out: dict) -> str:
    lines = [
        f"{ARCH} width, {out['num_layers']} blocks, {out['tokens']} video tokens, {out['text_tokens']} text "
        "tokens, "
        f"LoRA rank {out['rank']}, float32, {out['threads']} torch threads; load average {out['load_before']} -> "
        f"{out['load_after']}",
        "",
        "| recipe | iteration | passes (T teacher, S student, F fake; f forward, fg with grad, jvp, b backward, "
        "rc recompute) | counted (forwards) | measured (forwards) | measured / counted | at measured unit cost |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        if "error" in r:
            lines.append(f"| {r['recipe']} | failed: {r['error']} | | | | | |")
            continue
        lines.append(
            f"| {r['recipe']} | {r['iteration']} | {format_passes(r['passes'])} | {r['counted']:.2f} | "
            f"{r['measured']:.2f} | {r['ratio']:.2f} | {r['at_unit_cost']:.2f} |"
        )
    lines += [
        "",
        "| pass kind alone (one process per recipe; median) | seconds | forwards | FLOP model (forwards) |",
        "|---|---|---|---|",
    ]
    for name, res in out["results"].items():
        if "units" not in res:
            continue
        u, pf = res["units"], out["pass_flops"][res["pf_key"]]
        model = {
            "forward": 1.0,
            "forward_grad": pf["student"]["forward_grad"] / pf["teacher"]["forward"],
            "student_forward_grad": pf["student"]["forward_grad"] / pf["teacher"]["forward"],
            "backward": (pf["student"]["backward"] + pf["student"].get("recompute", 0) * ("GC" in name))
            / pf["teacher"]["forward"],
            "jvp": pf["student"]["jvp"] / pf["teacher"]["forward"],
        }
        model["jvp_stock_linear_rule"] = model["jvp"]
        for kind, s in u.items():
            lines.append(f"| {name}: {kind} | {s:.3f} | {s / u['forward']:.2f} | {model[kind]:.2f} |")
    return "\n".join(lines)


def run_recipes(args) -> dict:
    from rcm_diffusers.arch import arch_config, save_random_pipeline
    from rcm_diffusers.distill.cost import Arch, pass_flops

    overrides = {"num_layers": args.num_layers}
    if args.smoke:
        overrides.update(num_layers=1, num_attention_heads=2)
    cfg = arch_config(ARCH, **overrides)
    work = os.path.join(args.work, f"{ARCH}-L{overrides['num_layers']}-H{cfg['num_attention_heads']}")
    os.makedirs(work, exist_ok=True)
    pipe = save_random_pipeline(ARCH, os.path.join(work, "pipe"), dtype=torch.float32, **overrides)
    pipe2 = make_two_experts(os.path.join(work, "pipe2"), pipe, overrides)
    shape = (16, args.frames, args.hw, args.hw)
    data = make_data(
        os.path.join(work, f"data-{args.frames}x{args.hw}-{args.text_tokens}"), shape, args.text_tokens, cfg["text_dim"]
    )
    tokens = args.frames * (args.hw // 2) ** 2
    arch = Arch.from_config(cfg)
    pf = {
        policy: pass_flops(arch, tokens, args.text_tokens, lora_rank=args.rank, checkpointing_policy=policy)
        for policy in ("full", "selective")
    }
    names = SMOKE_RECIPES if args.smoke else [n for n in RECIPES if not args.only or n in args.only.split(";")]
    results = {}
    load_before = os.getloadavg()[0]
    for name in names:
        over = dict(RECIPES[name])
        out_dir = os.path.join(work, "runs", name.replace(" ", "_").replace(",", "").replace("+", "p"))
        shutil.rmtree(out_dir, ignore_errors=True)
        os.makedirs(os.path.dirname(out_dir), exist_ok=True)
        if over.pop("qad", False):
            c = {**qad_config(args, pipe, data, out_dir), "_qad": True}
        else:
            c = {**base_config(args, pipe2 if over.get("experts") == "both" else pipe, data, out_dir), **over}
            if c.get("regression_weight"):
                c["regression_data_dir"] = data
        ycfg = out_dir + ".yaml"
        import yaml

        with open(ycfg, "w") as f:
            yaml.safe_dump(c, f)
        load = os.getloadavg()[0]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": REPO, "OMP_NUM_THREADS": str(args.threads)}
        p = subprocess.run(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--_child",
                ycfg,
                "--repeats",
                str(args.repeats),
                "--threads",
                str(args.threads),
            ],
            env=env,
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=args.timeout,
        )
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        res = json.loads(line[-1][7:]) if p.returncode == 0 and line else {"error": (p.stdout + p.stderr)[-3000:]}
        res["load"] = [load, os.getloadavg()[0]]
        res["pf_key"] = c.get("checkpointing_policy", "full")
        results[name] = res
        shutil.rmtree(out_dir, ignore_errors=True)
        print(f"{name}: {'ok' if 'error' not in res else 'FAILED'} (load {load:.1f})", flush=True)
        if args.out:  # what has run so far, in case the rest is stopped
            with open(args.out + ".partial", "w") as f:
                json.dump({"results": results, "pass_flops": pf}, f, default=str)
    out = {
        "arch": ARCH,
        "num_layers": overrides["num_layers"],
        "tokens": tokens,
        "text_tokens": args.text_tokens,
        "rank": args.rank,
        "repeats": args.repeats,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "threads": args.threads,
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
        "pass_flops": pf,
        "results": results,
    }
    out["rows"] = recipe_rows(results, pf)
    return out


# ----------------------------------------------------------------------------- GPU-hours of the shipped configs

#: shipped config -> (architecture of each expert, experts)
SHIPPED = {
    "wan2.1-t2v-1.3b": ("wan2.1-t2v-1.3b", 1),
    "wan2.1-t2v-14b": ("wan2.1-t2v-14b", 1),
    "wan2.2-t2v-a14b": ("wan2.1-t2v-14b", 2),
    "wan2.2-i2v-a14b": ("wan2.2-i2v-a14b", 2),
}
PROCESSES = 8  # training/accelerate/ddp_8gpu.yaml, fsdp2_8gpu.yaml


def gpu_hours(utilisation: float) -> dict:
    from rcm_diffusers.distill import cost
    from rcm_diffusers.distill.config import RCMConfig
    from rcm_diffusers.distill.memory import TrainSetup, fits, per_rank, predict_training

    rows = []
    for name, (arch_name, experts) in SHIPPED.items():
        cfg = RCMConfig.from_yaml(os.path.join(REPO, "training", "configs", f"{name}.yaml"))
        arch = cost.Arch.from_arch(arch_name)
        for res, (f, h, w) in cost.RESOLUTIONS.items():
            tokens = cost.wan_tokens(f, h, w)
            run = cost.run_cost(cfg, arch, tokens, experts=experts)
            setup = TrainSetup.from_arch(
                arch_name,
                tokens=tokens,
                text_tokens=cost.TEXT_TOKENS,
                lora_rank=cfg.lora_rank,
                experts=experts,
                fd_type=cfg.fd_type,
                checkpointing_policy=cfg.checkpointing_policy,
                gradient_checkpointing=cfg.gradient_checkpointing,
            )
            mem = {"one process": predict_training(setup)["total"], "FSDP2 x 8": per_rank(setup, PROCESSES)["total"]}
            pf = run["pass_flops"]
            row = {
                "config": name,
                "resolution": res,
                "tokens": tokens,
                "iterations": run["iterations"],
                "forward_tflop": pf["teacher"]["forward"] / 1e12,
                "attention_share": pf["teacher"]["forward/attention"] / pf["teacher"]["forward"],
                "student_tflop": run["student_flops"] / 1e12,
                "fake_tflop": run["fake_flops"] / 1e12,
                "run_pflop_per_process": run["flops"] / 1e15,
                "memory_gib": {k: v / 2**30 for k, v in mem.items()},
                "fits": {k: fits(v) for k, v in mem.items()},
                "seconds": {},
                "gpu_hours": {},
            }
            for gpu, peak in cost.GPUS.items():
                row["seconds"][gpu] = {r: run[f"{r}_flops"] / (peak * utilisation) for r in ("student", "fake")}
                row["gpu_hours"][gpu] = PROCESSES * cost.hours(run["flops"], peak, utilisation)
            rows.append(row)
    return {"utilisation": utilisation, "processes": PROCESSES, "gpus": cost.GPUS, "rows": rows}


def gpu_hours_table(out: dict) -> str:
    gpus = list(out["gpus"])
    lines = [
        f"utilisation {out['utilisation']:.0%} of the dense bf16 peak; {out['processes']} processes, batch 1 each",
        "",
        "| config | res. | tokens | iterations (student + fake) | TFLOP / forward (attention) | "
        "TFLOP / student it. | "
        "TFLOP / fake it. | s / student, fake it. (H100) | " + " | ".join(f"GPU-h {g}" for g in gpus) + " |",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(gpus),
    ]
    for r in out["rows"]:
        it, s = r["iterations"], r["seconds"][gpus[0]]
        lines.append(
            f"| {r['config']} | {r['resolution']} | {r['tokens']} | {it['student']} + {it['fake']} | "
            f"{r['forward_tflop']:.0f} ({r['attention_share']:.0%}) | {r['student_tflop']:.0f} | "
            f"{r['fake_tflop']:.0f} | {s['student']:.1f}, {s['fake']:.1f} | "
            + " | ".join(f"{r['gpu_hours'][g]:.0f}" for g in gpus)
            + " |"
        )
    lines += [
        "",
        "| config | res. | memory per process, one card (GiB) | per rank, FSDP2 x 8 (GiB) | "
        "fits 48 GB / 24 GB (FSDP2 x 8) |",
        "|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        fit = r["fits"]["FSDP2 x 8"]
        f48 = fit["48 GB (L40S / RTX 6000 Ada)"]
        f24 = fit["24 GB (RTX 4090)"]
        lines.append(
            f"| {r['config']} | {r['resolution']} | {r['memory_gib']['one process']:.1f} | "
            f"{r['memory_gib']['FSDP2 x 8']:.1f} | {'yes' if f48 else 'no'} / {'yes' if f24 else 'no'} |"
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu-hours", action="store_true", help="print the FLOP / GPU-hour table of the shipped configs")
    ap.add_argument(
        "--utilisation", type=float, default=None, help="for --gpu-hours (default cost.DEFAULT_UTILISATION)"
    )
    ap.add_argument("--num_layers", type=int, default=2, help="blocks of the real-width model")
    ap.add_argument("--frames", type=int, default=4, help="latent frames")
    ap.add_argument("--hw", type=int, default=24, help="latent height = width")
    ap.add_argument("--text_tokens", type=int, default=512, help="prompt tokens")
    ap.add_argument("--rank", type=int, default=64, help="LoRA rank")
    ap.add_argument("--repeats", type=int, default=3, help="timed iterations of each role after the warm-up")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each recipe's process")
    ap.add_argument("--only", default="", help="';'-separated recipe names (default: all)")
    ap.add_argument("--work", default="/tmp/rcm_cost_table", help="scratch directory")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per recipe")
    ap.add_argument("--out", default="", help="write the results JSON here")
    ap.add_argument("--smoke", action="store_true", help="CI: 1 block, 2 heads, tiny latent and text, 2 recipes")
    ap.add_argument("--_child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child:
        torch.set_num_threads(args.threads)
        print("RESULT " + json.dumps(child(args._child, args.repeats)))
        return None
    if args.gpu_hours:
        from rcm_diffusers.distill.cost import DEFAULT_UTILISATION

        out = gpu_hours(args.utilisation or DEFAULT_UTILISATION)
        text = gpu_hours_table(out)
    else:
        if args.smoke:
            args.frames, args.hw, args.text_tokens, args.rank, args.repeats = 2, 4, 8, 4, 1
        out = run_recipes(args)
        text = recipes_table(out)
        bad = [r["recipe"] for r in out["rows"] if "error" in r]
        if bad:
            print(text)
            raise SystemExit(f"failed recipes: {bad}")
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=lambda o: o.__dict__ if hasattr(o, "__dict__") else str(o))
    return out


if __name__ == "__main__":
    main()
