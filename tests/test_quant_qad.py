"""QAD loss with CFG folded and the block-wise warm start (docs/math.md §7)."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import tiny_wan_transformer, wan_embeds

from rcm_diffusers.distill.qad import (
    GuidanceSchedule,
    _capture,
    blockwise_warm_start,
    qad_loss,
    relative_error,
    sample_r,
    transformer_blocks,
)
from rcm_diffusers.models import velocity_fn
from rcm_diffusers.quant.modules import quantize_transformer
from rcm_diffusers.trigflow import shift_r


def test_guidance_schedule_piecewise_linear():
    s = GuidanceSchedule([(0.0, 1.0), (0.5, 5.0), (1.0, 3.0)])
    r = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0])
    assert s(r).tolist() == [1.0, 3.0, 5.0, 4.0, 3.0]
    assert GuidanceSchedule([(0.2, 2.0), (0.4, 4.0)])(torch.tensor([0.0, 0.9])).tolist() == [2.0, 4.0]
    assert GuidanceSchedule(1.0).is_one and GuidanceSchedule(3.5)(torch.tensor([0.3])).item() == 3.5
    for bad in ([], [(0.5, 1.0), (0.5, 2.0)], [(1.5, 1.0)], [(0.1, float("nan"))], [(0.1, -1.0)]):
        with pytest.raises(ValueError):
            GuidanceSchedule(bad)


def test_sample_r_shift_and_student_times():
    g = torch.Generator().manual_seed(0)
    r = sample_r(4, shift=3.0, generator=g)
    u = torch.rand(4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(r, shift_r(u, 3.0))
    times = [0.9, 0.6, 0.2]
    assert set(sample_r(200, times=times, generator=g).tolist()) == set(times)


def test_qad_loss_matches_formula_with_folded_cfg():
    sched = GuidanceSchedule([(0.0, 1.0), (1.0, 5.0)])  # s(r) = 1 + 4 r
    teacher = lambda x, r, c: c * x  # noqa: E731  v_c = 2x, v_u = 0.5x
    student = lambda x, r, c: x  # noqa: E731
    x0 = torch.randn(3, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for alpha in (0.0, 0.3, 1.0):
        loss, logs = qad_loss(
            student,
            teacher,
            x0,
            {"c": 2.0},
            {"c": 0.5},
            alpha=alpha,
            guidance=sched,
            generator=torch.Generator().manual_seed(5),
            model_dtype=torch.float64,
        )
        g = torch.Generator().manual_seed(5)
        r = torch.rand(3, dtype=torch.float64, generator=g)
        eps = torch.randn(x0.shape, dtype=torch.float64, generator=g)
        x_r = (1 - r)[:, None, None] * x0 + r[:, None, None] * eps
        s = (1 + 4 * r)[:, None, None]
        v_T = 0.5 * x_r + s * (2 * x_r - 0.5 * x_r)
        want = alpha * ((x_r - (eps - x0)) ** 2).mean((1, 2)) + (1 - alpha) * ((x_r - v_T) ** 2).mean((1, 2))
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)
        assert logs["loss"] == pytest.approx(float(want.mean()))
    with pytest.raises(ValueError, match="alpha"):
        qad_loss(student, teacher, x0, {"c": 2.0}, None, alpha=1.5, guidance=sched)


def wan_batch(seed):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(2, 4, 2, 8, 8, generator=g, dtype=torch.float64)
    return x0, {"encoder_hidden_states": wan_embeds(2, seed)}, {"encoder_hidden_states": torch.zeros(2, 6, 32)}


def test_qad_steps_reduce_distillation_loss_on_tiny_wan():
    teacher = tiny_wan_transformer().requires_grad_(False)
    student = copy.deepcopy(teacher)
    quantize_transformer(student, "nvfp4")
    student.requires_grad_(True)
    v_S, v_T = velocity_fn(student), velocity_fn(teacher)
    sched = GuidanceSchedule([(0.0, 1.0), (0.5, 4.0), (1.0, 3.0)])
    x0, cond, uncond = wan_batch(0)

    def evaluate():
        with torch.no_grad():
            return qad_loss(
                v_S, v_T, x0, cond, uncond, alpha=0.0, guidance=sched, generator=torch.Generator().manual_seed(9)
            )[1]["loss_distill"]

    before = evaluate()
    opt = torch.optim.Adam([p for p in student.parameters() if p.requires_grad], lr=3e-4)
    for i in range(25):
        loss, _ = qad_loss(
            v_S, v_T, x0, cond, uncond, alpha=0.0, guidance=sched, generator=torch.Generator().manual_seed(100 + i)
        )
        opt.zero_grad()
        loss.mean().backward()
        opt.step()
    after = evaluate()
    assert after < 0.7 * before, (before, after)


def test_blockwise_warm_start_one_block_graph_and_error_drop():
    teacher = tiny_wan_transformer().requires_grad_(False)
    student = copy.deepcopy(teacher)
    quantize_transformer(student, "nvfp4")
    student.requires_grad_(False)
    for _, b in transformer_blocks(student):
        b.requires_grad_(True)
    t_before = {k: v.clone() for k, v in teacher.state_dict().items()}
    seen = []

    class CheckingAdam(torch.optim.AdamW):
        def step(self, closure=None):
            own = {id(p) for grp in self.param_groups for p in grp["params"]}
            with_grad = {id(p) for p in student.parameters() if p.grad is not None}
            seen.append(with_grad <= own and len(with_grad) > 0)
            return super().step(closure)

    def runner(seed):
        x0, cond, _ = wan_batch(seed)
        x_r = (0.5 * x0 + 0.5 * torch.randn_like(x0)).float()
        return lambda m: velocity_fn(m)(x_r, torch.full((2,), 0.5), **cond)

    def block_errors(seed):
        io_t = _capture(teacher, runner(seed), transformer_blocks(teacher))
        with torch.no_grad():
            return [
                float(relative_error(b(*io_t[n][0], **io_t[n][1]), io_t[n][2])) for n, b in transformer_blocks(student)
            ]

    before = block_errors(50)
    stats = blockwise_warm_start(
        student,
        teacher,
        [runner(s) for s in range(3)],
        steps_per_batch=10,
        lr=3e-4,
        max_grad_norm=1.0,
        optimizer_cls=CheckingAdam,
    )
    after = block_errors(50)
    assert len(seen) == 60 and all(seen)  # 2 blocks x 3 batches x 10 steps, only the stepping block had gradients
    assert [s.steps for s in stats] == [30, 30]
    assert all(a < b for a, b in zip(after, before)) and sum(after) < 0.7 * sum(before), (before, after)
    assert all(torch.equal(v, t_before[k]) for k, v in teacher.state_dict().items())
