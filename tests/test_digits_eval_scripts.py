"""Smoke tests of the digits evaluation scripts (no sampling): benchmarks/digits_independent_eval.py's ``--help`` and
missing ``--runs`` error, benchmarks/digits_noise_seeds.py's refusal of a folder that is not a finished run."""

import os
import subprocess
import sys

SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "digits_independent_eval.py"
)


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120)


def test_help():
    r = run("--help")
    assert r.returncode == 0, r.stderr
    for opt in ("--runs", "--teacher", "--seeds", "--methods", "--n", "--seed", "--out", "--no-teacher100"):
        assert opt in r.stdout
    assert "owes nothing to the project's evaluator" in r.stdout


def test_missing_runs_is_one_line_error(tmp_path):
    missing = tmp_path / "no_such_runs"
    r = run("--runs", str(missing), "--out", str(tmp_path / "out"))
    assert r.returncode != 0
    assert r.stderr.strip() == f"error: --runs folder not found: {missing}"
    assert r.stdout == ""
    assert not (tmp_path / "out").exists()


def test_noise_seeds_refuses_a_folder_that_is_not_a_run(tmp_path):
    script = os.path.join(os.path.dirname(SCRIPT), "digits_noise_seeds.py")
    r = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines()[-1] == (
        f"digits_noise_seeds.py: error: {tmp_path}: not a finished trainer output folder (no env.json or ema/)"
    )
