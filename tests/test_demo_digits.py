"""training/demo_digits.py (``make demo``): ablation switches, run reuse, and a tiny end-to-end run with ablations."""

import json
import os
import sys

import pytest
from train_helpers import REPO

from rcm_diffusers import digits as D
from rcm_diffusers.distill.config import load_config

sys.path.insert(0, os.path.join(REPO, "training"))
import demo_digits  # noqa: E402

TINY = [
    "--max_steps",
    "4",
    "--batch_size",
    "4",
    "--tangent_warmup",
    "1",
    "--student_update_freq",
    "2",
    "--checkpoint_every",
    "0",
    "--log_every",
    "1",
    "--progress",
    "false",
    "--samples",
    "20",
    "--ref_steps",
    "2",
    "--teacher_steps",
    "1",
    "--student_steps",
    "1",
]


def test_ablation_overrides_give_scm_only_dmd_only_and_no_regression_configs():
    assert D.run_overrides("rcm") == []
    assert D.run_overrides("scm-only") == ["--use_dmd", "false", "--regression_weight", "0.0"]
    assert D.run_overrides("dmd-only") == ["--scm_weight", "0.0", "--tangent_warmup", "0", "--regression_weight", "0.0"]
    assert D.run_overrides("no-regression") == ["--regression_weight", "0.0"]
    rcm, scm, dmd, noreg = (
        load_config(D.run_overrides(v), default_config=demo_digits.DEFAULT_CONFIG)
        for v in ("rcm", "scm-only", "dmd-only", "no-regression")
    )
    assert (rcm.use_dmd, rcm.scm_weight, rcm.regression_weight, rcm.tangent_warmup, rcm.max_steps) == (
        True,
        1.0,
        1.0,
        400,
        1450,
    )
    assert (scm.use_dmd, scm.scm_weight, scm.regression_weight, scm.tangent_warmup, scm.max_steps) == (
        False,
        1.0,
        0.0,
        400,
        1450,
    )
    assert (dmd.use_dmd, dmd.scm_weight, dmd.dmd_weight, dmd.regression_weight, dmd.tangent_warmup) == (
        True,
        0.0,
        1.0,
        0.0,
        0,
    )
    assert (noreg.use_dmd, noreg.scm_weight, noreg.regression_weight, noreg.tangent_warmup) == (True, 1.0, 0.0, 400)
    with pytest.raises(ValueError, match="unknown variant"):
        D.run_overrides("dmd")


def test_run_state_and_config_mismatch(tmp_path):
    cfg = {"max_steps": 10, "lr": 1e-3, "output_dir": "a", "progress": True}
    run = tmp_path / "run"
    assert D.run_state(str(run), cfg) == "missing"
    run.mkdir()
    (run / "env.json").write_text(json.dumps({"config": {**cfg, "output_dir": "b", "progress": False}}))
    assert D.run_state(str(run), cfg) == "partial"
    (run / "final.json").write_text("{}")
    assert D.run_state(str(run), cfg) == "partial"  # final.json precedes the export: not done yet
    (run / "pytorch_lora_weights.safetensors").write_bytes(b"")
    assert D.run_state(str(run), cfg) == "finished"  # output_dir / progress do not change the training
    assert D.run_state(str(run), {**cfg, "sigma_max": 5000.0, "mid_t": [1.0]}) == "finished"  # nor does the sampler
    with pytest.raises(ValueError, match=r"max_steps: 10 -> 11.*--force"):
        D.run_state(str(run), {**cfg, "max_steps": 11})
    # an option the run's env.json lacks counts as its default
    assert D.run_state(str(run), {**cfg, "base_dtype": "weight_dtype"}) == "finished"
    with pytest.raises(ValueError, match=r"base_dtype: 'weight_dtype' -> 'fp8'"):
        D.run_state(str(run), {**cfg, "base_dtype": "fp8"})
    # the two-expert options change a two-expert run only
    for experts, same in (("one", True), ("both", False)):
        run2 = tmp_path / experts
        run2.mkdir()
        (run2 / "env.json").write_text(json.dumps({"config": {**cfg, "experts": experts, "high_noise_share": 0.5}}))
        new = {**cfg, "experts": experts, "high_noise_share": 0.25}
        if same:
            assert D.run_state(str(run2), new) == "partial"
        else:
            with pytest.raises(ValueError, match=r"high_noise_share: 0.5 -> 0.25"):
                D.run_state(str(run2), new)


def test_bad_options_fail_before_training(tmp_path, capsys):
    for argv, msg in [
        (["--max_steps", "0"], "max_steps = 0: must be >= 1"),
        (["--bogus", "1"], "unknown config option"),
        (["--output_dir", "x"], "--out"),
        (["--ablations", "--use_dmd", "false"], "run 'dmd-only'"),
        (["--processes", "3"], "batch_size 64 does not split over --processes 3"),
    ]:
        with pytest.raises(SystemExit, match=msg):
            demo_digits.main(["--out", str(tmp_path / "r"), "--dry_run", *argv])
    assert not (tmp_path / "r").exists()
    with pytest.raises(SystemExit) as e:
        demo_digits.main(["--help"])
    assert e.value.code == 0 and "--ablations" in capsys.readouterr().out


def test_processes_split_the_global_batch(tmp_path):
    """--processes P: P DDP processes of batch_size / P each (the config's global batch), on a free port per run."""
    a, rest = demo_digits.parse_args(["--out", str(tmp_path / "r"), "--processes", "2", "--ablations"])
    runs = demo_digits.plan_runs(a, rest)
    assert [r["config"]["batch_size"] for r in runs] == [32, 32, 32, 32]
    cmd = demo_digits.launch_command(runs[0]["args"], a.processes)
    assert cmd[cmd.index("--num_processes") + 1] == "2" and int(cmd[cmd.index("--main_process_port") + 1]) > 0
    # several CPU processes need accelerate's torchrun launcher: with --cpu it would start one process only
    assert "--multi_gpu" in cmd and "--cpu" not in cmd
    one = demo_digits.launch_command(runs[0]["args"], 1)
    assert one[one.index("--num_processes") + 1] == "1" and "--main_process_port" not in one and "--cpu" in one
    a1, rest1 = demo_digits.parse_args(["--out", str(tmp_path / "r"), "--processes", "1"])
    assert demo_digits.plan_runs(a1, rest1)[0]["config"]["batch_size"] == 64
    assert 1 <= demo_digits.default_processes() <= 2
    aq, restq = demo_digits.parse_args(["--quality", "--processes", "1"])
    (q,) = demo_digits.plan_runs(aq, restq)
    assert q["config"]["max_steps"] == demo_digits.QUALITY_STEPS == 2900 and q["dir"].endswith(
        os.path.join("outputs", "digits-quality")
    )
    aq, restq = demo_digits.parse_args(["--quality", "--max_steps", "7", "--out", str(tmp_path / "q")])
    assert demo_digits.plan_runs(aq, restq)[0]["config"]["max_steps"] == 7  # an explicit --max_steps wins


def test_evaluation_uses_the_training_cores(tmp_path, capsys):
    """The evaluation runs after training, alone: threads x processes torch threads unless --eval_threads says."""
    for argv, want in [
        (["--processes", "2"], "--threads 2"),
        (["--processes", "1"], "--threads 1"),
        (["--processes", "2", "--eval_threads", "1"], "--threads 1"),
    ]:
        demo_digits.main(["--out", str(tmp_path / "r"), "--dry_run", *argv])
        assert want + " " in capsys.readouterr().out.split("[demo] evaluating:")[1]


@pytest.mark.slow
def test_demo_with_ablations_end_to_end(tmp_path):
    """Four 4-iteration students (rCM, sCM-only, DMD-only, no-regression) through accelerate launch, each by two real
    DDP processes (one checksum per rank in final.json), one report; a rerun reuses them, and refuses them for
    another process count."""
    out = tmp_path / "digits"
    rows = demo_digits.main(["--ablations", "--jobs", "2", "--processes", "2", "--out", str(out), *TINY])
    names = [
        "rcm",
        "rcm-ema",
        "scm-only",
        "scm-only-ema",
        "dmd-only",
        "dmd-only-ema",
        "no-regression",
        "no-regression-ema",
    ]
    user = [
        "student rcm",
        *(f"student rcm-ema{how}" for how in ("", ": user call", ": from_config defaults")),
    ]  # rCM's EMA only
    assert [(r.method, r.steps) for r in rows] == (
        [("teacher euler", 2), ("teacher euler", 1), ("teacher unipc", 2), ("teacher unipc", 1)]
        + [(m, 1) for m in user]
        + [(f"student {n}", 1) for n in names[2:]]
    )
    assert all(0 <= r.accuracy <= 1 and r.fd == r.fd and r.nfe == r.steps for r in rows)
    report = (out / "report.md").read_text()
    assert (
        all(f"| {m} | 1 | 1 |" in report for m in user + [f"student {n}" for n in names])
        and (out / "samples.png").exists()
    )
    assert (
        "student RCMScheduler sigma_max 5000, mid_t {2: [0.6], 4: [1.5, 1.4, 1.0]}" in report
    )  # the sampler digits.yaml names
    from rcm_diffusers import RCMScheduler  # the same sampler exported for diffusers users, next to each LoRA

    for d in (out, out / "ema"):
        s = RCMScheduler.from_pretrained(str(d), subfolder="scheduler").config
        assert (s.rcm_sigma_max, dict(s.mid_t), s.time_input) == (
            5000.0,
            {"2": [0.6], "4": [1.5, 1.4, 1.0]},
            "float",
        ), d

    def metrics(run):
        return [json.loads(line) for line in open(run / "metrics.jsonl")]

    # the trainer's alternation (docs/math.md §4.3) per variant, with the loss terms each step computed
    rcm = [
        ("student", {"loss_scm"}),
        ("student", {"loss_scm", "loss_dmd"}),
        ("fake", {"loss_fake"}),
        ("student", {"loss_scm", "loss_dmd"}),
    ]
    want = {
        out: [(n, k | {"loss_reg"} if n == "student" else k) for n, k in rcm],
        tmp_path / "digits-scm-only": [("student", {"loss_scm"})] * 4,
        tmp_path / "digits-dmd-only": [("student", {"loss_dmd"}), ("fake", {"loss_fake"})] * 2,
        tmp_path / "digits-no-regression": rcm,
    }
    for run, seq in want.items():
        recs = metrics(run)
        assert [
            (r["net"], {k for k in r if k in ("loss_scm", "loss_dmd", "loss_fake", "loss_reg")}) for r in recs
        ] == seq, run
        final = json.loads((run / "final.json").read_text())
        assert final["step"] == 4 and len(final["student_checksum_per_rank"]) == 2, final
        assert json.loads((run / "env.json").read_text())["world_size"] == 2
        assert os.path.exists(run / "ema" / "pytorch_lora_weights.safetensors")
    timing = json.loads((out / "demo_timing.json").read_text())
    assert sorted(timing["train_s"]) == ["dmd-only", "no-regression", "rcm", "scm-only"] and timing["eval_s"] > 0

    # finished runs are not retrained; a different budget in the same directory is refused
    mtime = os.path.getmtime(out / "final.json")
    demo_digits.main(["--ablations", "--processes", "2", "--out", str(out), "--skip_eval", *TINY])
    assert (
        json.loads((out / "demo_timing.json").read_text())["train_s"] == {}
        and os.path.getmtime(out / "final.json") == mtime
    )
    with pytest.raises(SystemExit, match="max_steps: 4 -> 5"):
        demo_digits.main(["--out", str(out), "--skip_eval", "--processes", "2", *TINY, "--max_steps", "5"])
    with pytest.raises(SystemExit, match=r"trained by 2 process\(es\), this demo asks for 1.*--force"):
        demo_digits.main(["--out", str(out), "--skip_eval", "--processes", "1", *TINY, "--batch_size", "2"])


def test_experts_demo_samples_with_its_config_and_reports_pixel_fd(tmp_path):
    """training/demo_experts_digits.py: the students are sampled with the config's sampler (sigma_max, mid_t per step
    count): 1-4 steps take one high-noise expert step and then the low-noise expert; the report carries the raw-pixel
    FD beside the classifier-feature FD."""
    import math

    import demo_experts_digits as E

    from rcm_diffusers.distill.experts import boundary_sigma
    from rcm_diffusers.sampling import mid_t_for_steps

    a, rest = E.parse_args(["--out", str(tmp_path), "--seeds", "0,1"])
    runs = E.plan(a, rest)
    assert [(r["method"], r["seed"]) for r in runs] == [
        ("two-experts", 0),
        ("one-lora-both", 0),
        ("two-experts", 1),
        ("one-lora-both", 1),
    ]
    c = runs[0]["config"]
    t_b = math.atan(boundary_sigma(0.875))
    assert math.atan(c["sigma_max"]) > t_b
    high = {n: sum(t >= t_b for t in mid_t_for_steps(c["mid_t"], n)) for n in (1, 2, 3, 4)}
    assert high == {1: 0, 2: 0, 3: 0, 4: 0}  # high-noise steps after the first
    assert mid_t_for_steps(c["mid_t"], 2) == [0.8]
    teacher = {"fd": 5.0, "fd_pixel": 0.5, "accuracy": 0.97, "diversity": 1.0}
    rows = [
        {
            "method": r["method"],
            "weights": "ema",
            "seed": r["seed"],
            "steps": 1,
            "fd": 6.0 + r["seed"],
            "fd_ratio": (6.0 + r["seed"]) / 5,
            "fd_pixel": 0.6,
            "fd_pixel_ratio": 1.2,
            "accuracy": 0.9,
            "diversity": 0.8,
        }
        for r in runs
    ]
    text = E.report(a, teacher, rows, {})
    assert (
        "pixel FD 0.500" in text
        and "| two-experts | ema | 1 | 6.50 ± 0.71 | 1.30 ± 0.14 | 0.600 ± 0.000 | 1.20 ± 0.00 |" in text
    )
    assert json.loads((tmp_path / "results.json").read_text())["rows"][0]["fd_pixel"] == 0.6


def test_experts_demo_caches_the_teacher_reference(tmp_path, monkeypatch):
    import demo_experts_digits as E
    import torch

    labels = torch.arange(10) % 10
    x = E.teacher_reference(D.TEACHER2_DIR, labels, 1, str(tmp_path))
    assert len(list(tmp_path.glob("teacher_ref_*.pt"))) == 1
    monkeypatch.setattr(D, "sample_teacher", lambda *a, **k: (_ for _ in ()).throw(AssertionError("recomputed")))
    assert torch.equal(E.teacher_reference(D.TEACHER2_DIR, labels, 1, str(tmp_path)), x)
    with pytest.raises(AssertionError, match="recomputed"):  # another protocol is another file
        E.teacher_reference(D.TEACHER2_DIR, labels, 2, str(tmp_path))


def test_demo_report_has_each_row_once(tmp_path, monkeypatch):
    """The rows of the demo's evaluation (its own eval_digits argv: the teacher rows, the rCM student and its EMA at
    1, 2 and 4 steps, and the EMA's stock-pipeline rows "user call" and "from_config defaults"), each (method, steps)
    once in the returned rows and once in report.md; stand-in models and metrics, no training and no sampling."""
    import types

    import eval_digits
    import torch

    class Evaluator:
        y_ref = [0] * 10

        def evaluate(self, x, labels):
            return {"fd": 1.0, "accuracy": 1.0, "diversity": 1.0, "fd_pixel": 1.0}

        def features(self, x):
            return x

        def fd_to(self, x):
            return 0.0

    scheduler = types.SimpleNamespace(
        config=types.SimpleNamespace(rcm_sigma_max=80.0, mid_t=[1.5, 1.4, 1.0], time_input="bf16")
    )
    for name, value in {
        "Evaluator": Evaluator,
        "load_teacher": lambda path: (None, None),
        "load_student": lambda teacher, path: (None, None),
        "load_student_pipeline": lambda teacher, path: (types.SimpleNamespace(scheduler=scheduler), {}),
        "timed": lambda fn, *args: (torch.zeros(20, 1, 1, 8, 8), 0.01, 1.0),
        "frechet_distance": lambda a, b: 0.0,
        "load_digits_split": lambda: {"x_train": None},
        "save_grid": lambda path, rows: path,
    }.items():
        monkeypatch.setattr(D, name, value)
    monkeypatch.setattr(eval_digits, "RCMScheduler", types.SimpleNamespace(from_config=lambda config: scheduler))
    a, overrides = demo_digits.parse_args(["--out", str(tmp_path / "digits"), "--samples", "20"])
    rows = demo_digits.evaluate(demo_digits.plan_runs(a, overrides), a)
    teacher = [(f"teacher {s}", n) for s in ("euler", "unipc") for n in (50, 1, 2, 4, 8)]
    students = [
        (m, n)
        for m in (
            "student rcm",
            "student rcm-ema",
            "student rcm-ema: user call",
            "student rcm-ema: from_config defaults",
        )
        for n in (1, 2, 4)
    ]
    assert [(r.method, r.steps) for r in rows] == teacher + students
    table = [line for line in (tmp_path / "digits" / "report.md").read_text().splitlines() if line.startswith("| ")][1:]
    assert [tuple(c.strip() for c in line.split("|")[1:3]) for line in table] == [
        (m, str(n)) for m, n in teacher + students
    ]
