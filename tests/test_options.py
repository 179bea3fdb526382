"""The option table: docs/training.md's tables are the declarations', --help is the user's (no test aid), the resume
policy covers every option, and the Python snippet of docs/training.md trains the tiny Wan."""

import os
import re
import subprocess
import sys

import pytest
from train_helpers import REPO, tiny_wan_run

from rcm_diffusers.distill.config import (
    OPTIONS_BEGIN,
    OPTIONS_END,
    CommonOptions,
    QADConfig,
    RCMConfig,
    format_help,
    options_markdown,
    resume_policy,
)

DOC = os.path.join(REPO, "docs", "training.md")


def test_docs_options_tables_are_the_declared_options():
    text = open(DOC).read()
    between = text.split(OPTIONS_BEGIN, 1)[1].split(OPTIONS_END, 1)[0]
    assert between.strip() == options_markdown().strip(), (
        "docs/training.md differs from the option declarations: "
        "python -m rcm_diffusers.distill.config --write docs/training.md"
    )
    rows = set(re.findall(r"^\| `(\w+)` \|", between, flags=re.M))
    assert rows == set(RCMConfig.model_fields) | set(QADConfig.model_fields)
    # the two-expert and time-input options are refused on resume, and the table says so
    for name in ("experts", "boundary_ratio", "time_input", "target", "act_scale"):
        assert re.search(rf"^\| `{name}` \|.*\| refused \(", between, flags=re.M), name


def test_help_lists_every_option_and_no_test_aid():
    for cls in (RCMConfig, QADConfig):
        h = format_help(cls)
        assert all(f"--{n} (" in h for n in cls.model_fields)
        for gone in ("exit_after_step", "synthetic", "pipeline_class"):
            assert f"  --{gone} (" not in h and gone not in cls.model_fields
    p = subprocess.run(
        [sys.executable, os.path.join(REPO, "training", "rcm.py"), "--help"], capture_output=True, text=True
    )
    assert p.returncode == 0 and "--regression_weight (0.0)" in p.stdout and "exit_after_step" not in p.stdout


def test_the_installed_package_trains_without_a_clone():
    """``accelerate launch -m rcm_diffusers.distill.rcm_trainer`` / ``rcm-distill`` (pip users have no training/):
    the module answers --help and, without a teacher, refuses in one line with exit status 2 (bad input)."""
    for module, usage in (
        ("rcm_diffusers.distill.rcm_trainer", "training/rcm.py"),
        ("rcm_diffusers.distill.qad_trainer", "training/qad.py"),
    ):
        p = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd="/")
        assert p.returncode == 0 and usage in p.stdout and "--lora_rank (" in p.stdout, p.stderr[-2000:]
        p = subprocess.run([sys.executable, "-m", module, "--max_steps", "3"], capture_output=True, text=True, cwd="/")
        assert p.returncode == 2 and p.stderr.strip() == (
            "error: config option pretrained = '': set the teacher pipeline directory or hub id"
        ), p.stderr[-2000:]


def test_qad_shares_the_common_options_with_its_own_defaults():
    common = set(CommonOptions.model_fields)
    assert common <= set(RCMConfig.model_fields) and common <= set(QADConfig.model_fields)
    assert (RCMConfig().lr, QADConfig().lr) == (1e-4, 1e-5)
    assert QADConfig.model_fields["lr"].description == RCMConfig.model_fields["lr"].description
    for cls in (RCMConfig, QADConfig):
        policy = resume_policy(cls)
        assert set(policy) == set(cls.model_fields)
        assert all(kind in ("fixed", "applied", "free") and (kind != "fixed" or why) for kind, why in policy.values())


def test_from_yaml_and_keyword_overrides(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("pretrained: p\ndata_dir: d\nlr: 2.0e-4\n")
    assert RCMConfig.from_yaml(str(y), lr=3e-4, fd_type=2).lr == 3e-4
    with pytest.raises(ValueError, match=r"^config option fd_type = 3: use 0, 1 or 2$"):
        RCMConfig.from_yaml(str(y), fd_type=3)
    with pytest.raises(ValueError, match=r"^unknown config option\(s\) \['learning_rate'\]"):
        RCMConfig.from_yaml(str(y), learning_rate=1)


def _python_snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", open(DOC).read(), flags=re.S)
    found = [b for b in blocks if "RCMTrainer(" in b]
    assert len(found) == 1, "docs/training.md has one Python snippet that runs the trainer"
    return found[0]


@pytest.mark.slow
def test_the_python_snippet_of_the_docs_trains_the_tiny_wan(tmp_path_factory):
    """The snippet as written, with ``my.yaml`` = the tiny Wan test config pointed at a tiny teacher and dataset."""
    pipe, data, root = tiny_wan_run(tmp_path_factory, "snippet")
    work = root / "work"
    work.mkdir()
    cfg = open(os.path.join(REPO, "training", "configs", "tiny-wan-test.yaml")).read()
    cfg = re.sub(r"^(pretrained|data_dir|max_steps|checkpoint_every):.*$", "", cfg, flags=re.M)
    (work / "my.yaml").write_text(cfg + f"pretrained: {pipe}\ndata_dir: {data}\nmax_steps: 12\ncheckpoint_every: 0\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    p = subprocess.run(
        [sys.executable, "-c", _python_snippet()], cwd=work, env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = work / "out"
    assert (out / "final.json").is_file() and (out / "pytorch_lora_weights.safetensors").is_file()
    assert (out / "scheduler" / "scheduler_config.json").is_file()
