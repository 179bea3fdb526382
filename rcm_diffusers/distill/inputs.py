"""Checks of a run's inputs before the run folder is touched or a model loads: the teacher folder
(``model_index.json``, safetensors weights) and the datasets (``data.check_dataset``).
"""

from __future__ import annotations

import json
import os

from .errors import fail, user_error

__all__ = ['model_index', 'check_inputs', 'PICKLE_WEIGHTS']


PICKLE_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def model_index(pretrained: str) -> dict:
    """``model_index.json`` of ``--pretrained`` (a local pipeline folder or a hub id), with a clear error."""
    import diffusers

    p = os.path.expanduser(pretrained)
    looks_local = os.path.isabs(p) or p.startswith(".") or p.count("/") != 1 or p.endswith("/")
    if not os.path.isdir(p) and looks_local:
        fail(f"--pretrained {pretrained}: no such folder. Give a diffusers pipeline folder (with model_index.json) "
             "or a hub id such as Wan-AI/Wan2.1-T2V-1.3B-Diffusers.")
    if os.path.isdir(p) and not os.path.isfile(os.path.join(p, "model_index.json")):
        fail(f"--pretrained {pretrained}: the folder has no model_index.json (not a diffusers pipeline folder; "
             "point at the folder that holds model_index.json and transformer/)")
    try:
        return diffusers.DiffusionPipeline.load_config(p)
    except Exception as e:  # noqa: BLE001 - hub/network/format errors all mean the same to the user
        fail(f"--pretrained {pretrained}: could not read its model_index.json ({type(e).__name__}: {e})")


def _teacher_config(pretrained: str, sub: str) -> dict | None:
    """``<pretrained>/<sub>/config.json`` of a local teacher folder after checking that its weights are safetensors
    (``None`` for a hub id or a folder without that subfolder: the loader reports those)."""
    d = os.path.join(os.path.expanduser(pretrained), sub)
    if not os.path.isdir(d):
        return None
    names = os.listdir(d)
    if not any(n.endswith((".safetensors", ".safetensors.index.json")) for n in names):
        pickles = sorted(n for n in names if n.endswith(PICKLE_WEIGHTS))
        if pickles:
            user_error(f"--pretrained {pretrained}: {sub}/ holds only pickle weights ({', '.join(pickles[:3])}); they are "
                       "not loaded (a pickle can run code). Save the transformer as safetensors (diffusers' "
                       "save_pretrained does by default) and point --pretrained at that folder.")
        user_error(f"--pretrained {pretrained}: {sub}/ holds no weights (no .safetensors file)")
    try:
        with open(os.path.join(d, "config.json")) as f:
            c = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        user_error(f"--pretrained {pretrained}: cannot read {sub}/config.json ({type(e).__name__}: {e})")
    return c if isinstance(c, dict) else None


def check_inputs(cfg) -> dict:
    """Everything cheap about a run's inputs, before the run folder is touched or a model loads: the teacher's
    weights are safetensors, and the whole dataset (``data.check_dataset``) fits the teacher's config, as do the ODE
    pairs of the regression term (with their ``noise``) when it is on. A problem
    ends the process with one line and exit status 2; returns ``check_dataset``'s summary."""
    from .data import DataError, check_dataset

    subs = [cfg.transformer_subfolder]
    if getattr(cfg, "experts", "one") != "one" and os.path.isdir(os.path.join(os.path.expanduser(cfg.pretrained), "transformer_2")):
        subs = list(dict.fromkeys(["transformer", "transformer_2", *subs]))
    configs = [_teacher_config(cfg.pretrained, s) for s in subs]
    try:
        info = check_dataset(cfg.data_dir, configs[0])
        if getattr(cfg, "regression_weight", 0) > 0:
            pairs = check_dataset(cfg.regression_data_dir, configs[0], "--regression_data_dir")
            if "noise" not in pairs["fields"]:
                raise DataError(f"--regression_data_dir {cfg.regression_data_dir}: no 'noise' field, so these are not ODE "
                                "pairs; make them with training/prepare_data.py --synthetic")
        return info
    except DataError as e:
        user_error(str(e))
