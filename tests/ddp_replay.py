"""The rCM trainer with each optimizer step's gradients written to ``$GRAD_OUT/rank{r}-step{n}.safetensors``;
with ``REPLAY_WORLD=P`` (one process, ``batch_size`` = P x the per-rank batch) every student / fake-score step runs
as P per-rank parts, each with that rank's rows of the global batch and that rank's noise generator, and each
term scaled by 1/P: the gradient DDP's all-reduce average should give. Used by tests/test_train_ddp.py."""

import os
import sys

import torch
from safetensors.torch import save_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from rcm_diffusers.distill import rcm_trainer as M  # noqa: E402
from rcm_diffusers.distill.data import step_generator  # noqa: E402
from rcm_diffusers.distill.terms import StudentBatch  # noqa: E402

OUT, WORLD = os.environ["GRAD_OUT"], int(os.environ.get("REPLAY_WORLD", "0"))
calls = [0]
adamw_step = torch.optim.AdamW.step


def dumping_step(self, *args, **kwargs):
    """``AdamW.step`` after writing this rank's gradients (post clipping: what the step uses)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    grads = {
        f"{gi}.{j}": p.grad.detach().clone().contiguous()
        for gi, g in enumerate(self.param_groups)
        for j, p in enumerate(g["params"])
        if p.grad is not None
    }
    os.makedirs(OUT, exist_ok=True)
    save_file(grads, os.path.join(OUT, f"rank{rank}-step{calls[0]}.safetensors"))
    calls[0] += 1
    return adamw_step(self, *args, **kwargs)


def rank_rows(obj, r: int, B: int):
    """Rank ``r``'s rows of every batch-leading tensor in ``obj`` (a tensor or a dict of them)."""
    if isinstance(obj, dict):
        return {k: rank_rows(v, r, B) for k, v in obj.items()}
    if torch.is_tensor(obj) and obj.dim() and obj.shape[0] == WORLD * B:
        return obj[r * B : (r + 1) * B]
    return obj


def student_replay(terms, nets, batch, generator, backward):
    """``terms.run_student_terms`` once per replayed rank: its rows (and ODE pairs), its generator, its terms
    scaled by 1/P."""
    B, logs = batch.B // WORLD, {}
    for r in range(WORLD):
        part = StudentBatch(
            rank_rows(batch.x0, r, B),
            rank_rows(batch.cond, r, B),
            rank_rows(batch.uncond, r, B),
            batch.plan,
            batch.noise_multiplier,
            None if batch.pairs is None else tuple(rank_rows(v, r, B) for v in batch.pairs),
        )
        logs = student(
            terms,
            nets,
            part,
            step_generator(terms[0].cfg.seed, batch.plan.i, r),
            lambda loss, last: backward(loss / WORLD, last),
        )
    return logs


def fake_replay(nets, x0_shape, cond, plan, cfg, generator, backward, device):
    """``terms.fake_step`` once per replayed rank, as ``student_replay``."""
    B, logs = x0_shape[0] // WORLD, {}
    for r in range(WORLD):
        logs = fake(
            nets,
            (B, *x0_shape[1:]),
            rank_rows(cond, r, B),
            plan,
            cfg,
            step_generator(cfg.seed, plan.i, r),
            lambda loss, last: backward(loss / WORLD, last),
            device,
        )
    return logs


torch.optim.AdamW.step = dumping_step
student, fake = M.run_student_terms, M.fake_step
if WORLD:
    M.run_student_terms, M.fake_step = student_replay, fake_replay
M.main(sys.argv[1:], default_config=os.path.join(REPO, "training", "configs", "digits.yaml"))
