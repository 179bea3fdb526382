"""The network passes one iteration of each recipe makes, counted by ``passes.PassCounter`` on the tiny Wan through
the trainer's own network build (``RCMTrainer._networks``: adapters, checkpointing, JVP processors) and loss terms
(``run_student_terms``, ``fake_step``; QAD: ``qad_loss``), against a literal table and against the cost model
(``cost.student_passes`` / ``fake_passes`` / ``qad_passes``) that the FLOP and time predictions use. A term that adds
or drops a pass fails here. Every iteration below has 2 backward-simulation steps and CFG with a negative prompt."""

from types import SimpleNamespace

import pytest
import torch
from train_helpers import make_dataset, make_tiny_wan, make_tiny_wan2

from rcm_diffusers.distill import cost
from rcm_diffusers.distill.alternation import plan_of
from rcm_diffusers.distill.config import QADConfig, RCMConfig
from rcm_diffusers.distill.data import LatentDataset, model_inputs, pair_inputs
from rcm_diffusers.distill.passes import PassCounter
from rcm_diffusers.distill.rcm_trainer import RCMTrainer
from rcm_diffusers.distill.terms import StudentBatch, fake_step, run_student_terms, student_terms

CPU = torch.device("cpu")
B = 2
# iteration 2 is a student iteration with student_eff 1 -> 2 simulation steps; iteration 3 a fake-score one with
# fake_eff 1 -> 2 steps (tangent_warmup 0, student_update_freq 2, max_simulation_steps 2)
STUDENT_I, FAKE_I = 2, 3
BASE = dict(
    lora_rank=4,
    guidance_scale=2.0,
    tangent_warmup=0,
    student_update_freq=2,
    max_simulation_steps=2,
    fd_type=0,
    dmd_weight=0.01,
    batch_size=B,
)

T4 = {"forward": 4}  # two guided teacher evaluations (DMD and the consistency term), two calls each
FAKE_ITER = {"student": {"forward": 2}, "fake": {"forward_grad": 1, "backward": 1}}
FAKE_ITER_GC = {"student": {"forward": 2}, "fake": {"forward_grad": 1, "backward": 1, "recompute": 1}}

#: recipe -> (config overrides, student iteration, fake-score iteration or None when there is no fake score)
RECIPES = {
    "sCM fd_type 0 + DMD": (
        {},
        {"teacher": T4, "student": {"forward": 1, "forward_grad": 2, "jvp": 1, "backward": 2}, "fake": {"forward": 1}},
        FAKE_ITER,
    ),
    "sCM fd_type 0 + DMD, checkpointing full": (
        {"gradient_checkpointing": True},
        {
            "teacher": T4,
            "student": {"forward": 1, "forward_grad": 2, "jvp": 1, "backward": 2, "recompute": 2},
            "fake": {"forward": 1},
        },
        FAKE_ITER_GC,
    ),
    "sCM fd_type 0 + DMD, checkpointing selective": (
        {"gradient_checkpointing": True, "checkpointing_policy": "selective"},
        {
            "teacher": T4,
            "student": {"forward": 1, "forward_grad": 2, "jvp": 1, "backward": 2, "recompute": 2},
            "fake": {"forward": 1},
        },
        FAKE_ITER_GC,
    ),
    "sCM fd_type 1 + DMD": (
        {"fd_type": 1},
        {"teacher": T4, "student": {"forward": 2, "forward_grad": 2, "jvp": 1, "backward": 2}, "fake": {"forward": 1}},
        FAKE_ITER,
    ),
    "sCM fd_type 2 + DMD": (
        {"fd_type": 2},
        {"teacher": T4, "student": {"forward": 2, "forward_grad": 2, "backward": 2}, "fake": {"forward": 1}},
        FAKE_ITER,
    ),
    "sCM fd_type 2 + DMD, checkpointing full": (
        {"fd_type": 2, "gradient_checkpointing": True},
        {
            "teacher": T4,
            "student": {"forward": 2, "forward_grad": 2, "backward": 2, "recompute": 2},
            "fake": {"forward": 1},
        },
        FAKE_ITER_GC,
    ),
    "dCM + DMD": (
        {"cm_type": "dcm"},
        {"teacher": T4, "student": {"forward": 2, "forward_grad": 2, "backward": 2}, "fake": {"forward": 1}},
        FAKE_ITER,
    ),
    "dCM (3 teacher steps) + DMD": (
        {"cm_type": "dcm", "dcm_skipping_interval_steps": 3},
        {
            "teacher": {"forward": 8},
            "student": {"forward": 2, "forward_grad": 2, "backward": 2},
            "fake": {"forward": 1},
        },
        FAKE_ITER,
    ),
    "DMD alone": (
        {"scm_weight": 0.0},
        {
            "teacher": {"forward": 2},
            "student": {"forward": 1, "forward_grad": 1, "backward": 1},
            "fake": {"forward": 1},
        },
        FAKE_ITER,
    ),
    "DMD alone, checkpointing full": (
        {"scm_weight": 0.0, "gradient_checkpointing": True},
        {
            "teacher": {"forward": 2},
            "student": {"forward": 1, "forward_grad": 1, "backward": 1, "recompute": 1},
            "fake": {"forward": 1},
        },
        FAKE_ITER_GC,
    ),
    "sCM fd_type 0 alone": (
        {"use_dmd": False},
        {"teacher": {"forward": 2}, "student": {"forward_grad": 1, "jvp": 1, "backward": 1}},
        None,
    ),
    "sCM fd_type 0 + DMD + regression": (
        {"regression_weight": 1.0},
        {"teacher": T4, "student": {"forward": 1, "forward_grad": 3, "jvp": 1, "backward": 3}, "fake": {"forward": 1}},
        FAKE_ITER,
    ),
    "sCM fd_type 0 + DMD, no CFG": (
        {"guidance_scale": 1.0},
        {
            "teacher": {"forward": 2},
            "student": {"forward": 1, "forward_grad": 2, "jvp": 1, "backward": 2},
            "fake": {"forward": 1},
        },
        FAKE_ITER,
    ),
    "two experts, sCM fd_type 0 + DMD + boundary": (
        {"experts": "both"},
        {"teacher": T4, "student": {"forward": 2, "forward_grad": 3, "jvp": 1, "backward": 3}, "fake": {"forward": 1}},
        FAKE_ITER,
    ),
    "two experts, sCM fd_type 0 + DMD + boundary, checkpointing full": (
        {"experts": "both", "gradient_checkpointing": True},
        {
            "teacher": T4,
            "student": {"forward": 2, "forward_grad": 3, "jvp": 1, "backward": 3, "recompute": 3},
            "fake": {"forward": 1},
        },
        FAKE_ITER_GC,
    ),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny networks run faster on one thread than on a shared host's two."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("passes")
    return SimpleNamespace(
        wan=make_tiny_wan(str(root / "wan")),
        wan2=make_tiny_wan2(str(root / "wan2")),
        data=make_dataset(str(root / "data"), "wan"),
        pairs=make_dataset(str(root / "pairs"), "wan", noise=True),
        out=root,
    )


def _config(dirs, overrides):
    kw = {**BASE, **overrides}
    experts = kw.get("experts") == "both"
    if kw.get("regression_weight"):
        kw["regression_data_dir"] = dirs.pairs
    return RCMConfig(
        pretrained=dirs.wan2 if experts else dirs.wan, data_dir=dirs.data, output_dir=str(dirs.out / "o"), **kw
    ).validate()


def _count_iterations(dirs, overrides):
    """Passes of the student iteration STUDENT_I and, with a fake score, the fake-score iteration FAKE_I."""
    cfg = _config(dirs, overrides)
    host = SimpleNamespace(cfg=cfg)
    nets, _ = RCMTrainer._networks(host, CPU, lambda *a: None)
    data = LatentDataset(cfg.data_dir)
    x0, c, u = model_inputs(data.family, data.get(list(range(B))), CPU, nets.model_dtype)
    pairs = None
    if cfg.regression_weight > 0:
        pd = LatentDataset(cfg.regression_data_dir)
        pairs = pair_inputs(pd.family, pd.get(list(range(B))), CPU, nets.model_dtype)
    counts = []
    for i in (STUDENT_I, FAKE_I):
        plan = plan_of(cfg, i, nets.has_fake)
        gen = torch.Generator().manual_seed(i)
        with PassCounter.of(nets) as counter:
            if plan.student:
                run_student_terms(
                    student_terms(cfg),
                    nets,
                    StudentBatch(x0, c, u, plan, 1.0, pairs),
                    gen,
                    lambda loss, last: loss.backward(),
                )
            else:
                fake_step(nets, x0.shape, c, plan, cfg, gen, lambda loss, last: loss.backward(), CPU)
        counts.append((plan, counter.passes(B)))
    return cfg, host.transformer, counts


@pytest.mark.parametrize("name", list(RECIPES))
def test_passes_per_iteration_of_each_recipe(dirs, name):
    overrides, student, fake = RECIPES[name]
    cfg, transformer, [(splan, s_got), (fplan, f_got)] = _count_iterations(dirs, overrides)
    assert splan.student and (splan.n_sim == 2 or not splan.dmd)
    assert s_got == student
    if fake is None:
        assert fplan.student  # no fake score: every iteration is a student one
    else:
        assert not fplan.student and f_got == fake
    # the cost model's count of the same recipe
    experts = 2 if overrides.get("experts") == "both" else 1
    recipe = cost.Recipe.from_config(cfg, experts=experts)
    assert cost.student_passes(recipe, splan.n_sim, splan.dmd) == s_got
    if fake is not None:
        assert cost.fake_passes(recipe, fplan.fake_eff % cfg.max_simulation_steps + 1) == f_got


def test_tangent_warmup_iteration_runs_the_consistency_term_only(dirs):
    """An iteration inside the tangent warm-up trains the student without DMD: the passes of sCM alone."""
    cfg, _, [(plan, got), _] = _count_iterations(dirs, {"tangent_warmup": 5})
    assert plan.student and not plan.dmd
    assert got == {"teacher": {"forward": 2}, "student": {"forward_grad": 1, "jvp": 1, "backward": 1}}
    assert cost.student_passes(cost.Recipe.from_config(cfg), plan.n_sim, plan.dmd) == got


def test_qad_iteration_passes(dirs):
    """QAD (scope lora, NVFP4 weights): the quantized student's forward and backward, the teacher's two CFG calls."""
    from rcm_diffusers.distill import qad_student as Q
    from rcm_diffusers.distill.qad import GuidanceSchedule, qad_loss
    from rcm_diffusers.distill.qad_trainer import QADTrainer
    from rcm_diffusers.models import velocity_fn

    cfg = QADConfig(
        pretrained=dirs.wan,
        data_dir=dirs.data,
        output_dir=str(dirs.out / "q"),
        scope="lora",
        lora_rank=4,
        target="fake",
        alpha=0.1,
        batch_size=B,
    ).validate()
    teacher = QADTrainer._teacher(SimpleNamespace(cfg=cfg), CPU, torch.float32)
    student, _ = Q.build_student(teacher, cfg)
    data = LatentDataset(cfg.data_dir)
    x0, c, u = model_inputs(data.family, data.get(list(range(B))), CPU, torch.float32)
    with PassCounter({"teacher": teacher, "student": student}) as counter:
        loss, _ = qad_loss(
            velocity_fn(student),
            velocity_fn(teacher),
            x0,
            c,
            u,
            alpha=cfg.alpha,
            guidance=GuidanceSchedule(cfg.guidance_knots()),
            generator=torch.Generator().manual_seed(0),
            shift=cfg.shift,
            times=Q.training_times(cfg),
            model_dtype=torch.float32,
        )
        loss.mean().backward()
    got = counter.passes(B)
    assert got == {"teacher": {"forward": 2}, "student": {"forward_grad": 1, "backward": 1}}
    assert cost.qad_passes(cfg.alpha, guided=True) == got
    assert cost.qad_passes(1.0, guided=True) == {"student": {"forward_grad": 1, "backward": 1}}
