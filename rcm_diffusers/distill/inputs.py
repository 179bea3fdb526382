"""Checks of a run's inputs before the run folder is touched or a model loads: the teacher folder
(``model_index.json``, safetensors weights), the datasets (``data.check_dataset``), the ODE pairs against the
training data, the context-parallel settings (``check_context_parallel``), and the values of the datasets
(``scan_data_values``, once the processes can talk: they share the read).
"""

from __future__ import annotations

import json
import math
import os

from .errors import UserError, user_error

__all__ = [
    "model_index",
    "check_inputs",
    "check_pairs",
    "check_context_parallel",
    "scan_data_values",
    "data_dirs",
    "PICKLE_WEIGHTS",
]


PICKLE_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def model_index(pretrained: str) -> dict:
    """``model_index.json`` of ``--pretrained`` (a local pipeline folder or a hub id), with a clear error."""
    import diffusers

    p = os.path.expanduser(pretrained)
    looks_local = os.path.isabs(p) or p.startswith(".") or p.count("/") != 1 or p.endswith("/")
    if not os.path.isdir(p) and looks_local:
        user_error(
            f"--pretrained {pretrained}: no such folder. Give a diffusers pipeline folder (with "
            "model_index.json) or a hub id such as Wan-AI/Wan2.1-T2V-1.3B-Diffusers."
        )
    if os.path.isdir(p) and not os.path.isfile(os.path.join(p, "model_index.json")):
        user_error(
            f"--pretrained {pretrained}: the folder has no model_index.json (not a diffusers pipeline folder; "
            "point at the folder that holds model_index.json and transformer/)"
        )
    try:
        return diffusers.DiffusionPipeline.load_config(p)
    except Exception as e:  # noqa: BLE001 - hub/network/format errors all mean the same to the user
        user_error(f"--pretrained {pretrained}: could not read its model_index.json ({type(e).__name__}: {e})")


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
            user_error(
                f"--pretrained {pretrained}: {sub}/ holds only pickle weights ({', '.join(pickles[:3])}); they are "
                "not loaded (a pickle can run code). Save the transformer as safetensors (diffusers' "
                "save_pretrained does by default) and point --pretrained at that folder."
            )
        user_error(f"--pretrained {pretrained}: {sub}/ holds no weights (no .safetensors file)")
    try:
        with open(os.path.join(d, "config.json")) as f:
            c = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        user_error(f"--pretrained {pretrained}: cannot read {sub}/config.json ({type(e).__name__}: {e})")
    return c if isinstance(c, dict) else None


def _hub_config(pretrained: str, sub: str, name: str = "config.json") -> dict | None:
    """``<sub>/<name>`` of a hub-id teacher through huggingface_hub (its cache; ``HF_HUB_OFFLINE`` is honoured),
    so the settings it fixes are checked before the run folder; ``None`` when it cannot be had (the loader reports)."""
    p = os.path.expanduser(pretrained)
    if os.path.exists(p) or p.count("/") != 1 or p.startswith((".", "/")):
        return None
    try:
        from huggingface_hub import hf_hub_download

        with open(hf_hub_download(p, f"{sub}/{name}")) as f:
            c = json.load(f)
    except Exception:  # noqa: BLE001 - no network, no such repo: the loader says so later
        return None
    return c if isinstance(c, dict) else None


def _check_teacher_guider(cfg, index: dict) -> None:
    """A teacher whose pipeline holds a ``guider`` (HunyuanVideo-1.5) must use one the trainer's plain CFG reproduces
    (``prepare.check_guider``), read from ``guider/guider_config.json`` (local folder or hub cache); one line
    otherwise."""
    if not index.get("guider"):
        return
    from diffusers.guiders.guider_utils import BaseGuidance

    name = BaseGuidance.config_name  # guider_config.json
    config = None
    path = os.path.join(os.path.expanduser(cfg.pretrained), "guider", name)
    if os.path.isfile(path):
        try:
            with open(path) as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            user_error(f"--pretrained {cfg.pretrained}: cannot read guider/{name} ({type(e).__name__}: {e})")
    else:
        config = _hub_config(cfg.pretrained, "guider", name)
    from .prepare import check_guider

    try:
        check_guider(config if isinstance(config, dict) else None, f"--pretrained {cfg.pretrained}")
    except ValueError as e:
        user_error(str(e))


def check_pairs(pairs: dict, data: dict, pairs_dir: str, data_dir: str) -> None:
    """The ODE pairs (``check_dataset`` summary ``pairs``) must be samples of the model the training data
    (``data``) feeds: the same family, per-sample latent shape, text width, conditions; raises ``DataError``."""
    from .data import DataError

    def bad(what, a, b):
        raise DataError(
            f"--regression_data_dir {pairs_dir}: {what} {a}, the training data's (--data_dir {data_dir}) "
            f"{b}; make the pairs with the same teacher, resolution and text encoder "
            "(training/prepare_data.py --synthetic)"
        )

    if pairs["family"] != data["family"]:
        bad("family", repr(pairs["family"]), repr(data["family"]))
    ps, ds = pairs["shapes"], data["shapes"]
    if ps["latents"][1] != ds["latents"][1]:
        bad("latents per sample are", list(ps["latents"][1]), f"are {list(ds['latents'][1])}")
    for k in ("prompt_embeds", "negative_prompt_embeds"):
        if k in ps and k in ds and ps[k][1][-1:] != ds[k][1][-1:]:
            bad(f"{k} are", f"{ps[k][1][-1]} wide", f"are {ds[k][1][-1]} wide")
    for k in ("condition", "pooled_prompt_embeds", "negative_pooled_prompt_embeds"):
        if k in ps and k in ds and ps[k][1] != ds[k][1]:
            bad(f"{k} per sample is", list(ps[k][1]), f"is {list(ds[k][1])}")
    if ("image_embeds" in ps) != ("image_embeds" in ds):
        bad(
            "image_embeds",
            "present" if "image_embeds" in ps else "absent",
            "present" if "image_embeds" in ds else "absent",
        )
    if "image_embeds" in ps and ps["image_embeds"][1][-1:] != ds["image_embeds"][1][-1:]:
        bad("image_embeds are", f"{ps['image_embeds'][1][-1]} wide", f"are {ds['image_embeds'][1][-1]} wide")


def check_context_parallel(cfg, configs: list, info: dict) -> None:
    """``context_parallel_size`` P > 1 against what is known before any process group or model: the process count
    (``WORLD_SIZE`` of the launcher; a multiple of P, and more than one process), the teachers' class and head count
    (their ``config.json``; every expert), and the video tokens of a sample (latent shape over the patch size). One
    ``error:`` line, exit status 2 (the trainer re-checks on the loaded model, for a teacher whose config.json could
    not be read here)."""
    cp = getattr(cfg, "context_parallel_size", 1)
    if cp <= 1:
        return
    known = [c for c in configs if c]
    for c in known:
        if c.get("_class_name") != "WanTransformer3DModel":
            user_error(f"context parallelism is implemented for Wan transformers, not {c.get('_class_name')}")
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world == 1 or world % cp:
        user_error(f"context_parallel_size {cp} needs {cp} x k processes, this run has {world}")
    for c in known:
        heads = c.get("num_attention_heads")
        if isinstance(heads, int) and heads % cp:
            user_error(f"context_parallel_size {cp} does not divide the {heads} attention heads of {c['_class_name']}")
    if known:
        patch = tuple(known[0].get("patch_size") or (1, 2, 2))
        lat = info["shapes"]["latents"][1][-3:]
        n_tok = math.prod(n // q for n, q in zip(lat, patch))
        if n_tok % cp:
            user_error(
                f"context_parallel_size {cp}: a sample has {n_tok} video tokens ({' x '.join(map(str, lat))} "
                f"latents, patch {' x '.join(map(str, patch))}), not divisible by {cp}"
            )


def check_inputs(cfg) -> dict:
    """Everything cheap about a run's inputs, before the run folder is touched or a model loads: the teacher's
    weights are safetensors, the whole dataset (``data.check_dataset``: headers and index fields) fits the teacher's
    config, as do the ODE pairs of the regression term (with their ``noise``, and samples of the same model as the
    training data: ``check_pairs``) when it is on, and the context-parallel settings. A problem ends the process
    with one line and exit status 2; returns ``check_dataset``'s summary. First of all, a process started by
    torchrun's agent is tied to its launcher (``watchdog.guard_launcher``)."""
    from . import families, watchdog
    from .data import DataError, check_dataset

    watchdog.guard_launcher()
    index = model_index(cfg.pretrained)  # the teacher folder (or hub id) exists and is a diffusers pipeline
    family = families.check_family(cfg, index)  # a supported teacher, matched by exact class, before any model loads
    if family.name == "qwen" and hasattr(cfg, "calibration_batches"):  # QADConfig
        user_error(
            f"--pretrained {cfg.pretrained}: QAD (training/qad.py) supports Wan and FLUX.1 teachers, not Qwen-Image"
        )
    if family.name == "flux2" and hasattr(cfg, "calibration_batches"):  # QADConfig
        user_error(f"--pretrained {cfg.pretrained}: QAD (training/qad.py) supports Wan and FLUX.1 teachers, not FLUX.2")
    if family.name == "hunyuan15" and hasattr(cfg, "calibration_batches"):  # QADConfig
        user_error(
            f"--pretrained {cfg.pretrained}: QAD (training/qad.py) supports Wan and FLUX.1 teachers, "
            "not HunyuanVideo-1.5"
        )
    _check_teacher_guider(cfg, index)
    if hasattr(cfg, "experts"):
        from .base_model import check_experts

        check_experts(cfg, index)
    lora = getattr(cfg, "teacher_lora", "")
    if lora and not os.path.exists(os.path.expanduser(lora)):
        user_error(f"--teacher_lora {lora}: no such file or folder (an rCM run folder or a LoRA .safetensors)")
    subs = [cfg.transformer_subfolder]
    if getattr(cfg, "experts", "one") != "one" and os.path.isdir(
        os.path.join(os.path.expanduser(cfg.pretrained), "transformer_2")
    ):
        subs = list(dict.fromkeys(["transformer", "transformer_2", *subs]))
    configs = [_teacher_config(cfg.pretrained, s) or _hub_config(cfg.pretrained, s) for s in subs]
    try:
        info = check_dataset(cfg.data_dir, configs[0])
        if getattr(cfg, "regression_weight", 0) > 0:
            pairs = check_dataset(cfg.regression_data_dir, configs[0], "--regression_data_dir")
            if "noise" not in pairs["fields"]:
                raise DataError(
                    f"--regression_data_dir {cfg.regression_data_dir}: no 'noise' field, so these are not ODE "
                    "pairs; make them with training/prepare_data.py --synthetic"
                )
            check_pairs(pairs, info, cfg.regression_data_dir, cfg.data_dir)
    except DataError as e:
        user_error(str(e))
    check_context_parallel(cfg, configs, info)
    return info


def data_dirs(cfg) -> list[tuple[str, str]]:
    """``[(option, folder)]`` of the datasets a run reads."""
    out = [("--data_dir", cfg.data_dir)]
    if getattr(cfg, "regression_weight", 0) > 0:
        out.append(("--regression_data_dir", cfg.regression_data_dir))
    return out


def scan_data_values(cfg, accelerator) -> None:
    """Every float value of the run's datasets must be finite (``data.scan_values``, a streaming read of the whole
    data; docs/training.md gives its cost). Each process reads its share of every field's rows; the verdicts are
    gathered and rank 0 prints the first problem (one line, exit status 2 on every process). Called before the run
    folder is touched; skipped with ``check_data_values false``."""
    from .data import DataError, scan_values

    if not getattr(cfg, "check_data_values", True):
        return
    rank, world = accelerator.process_index, accelerator.num_processes
    problem = None
    for option, root in data_dirs(cfg):
        try:
            scan_values(root, option, part=rank, parts=world)
        except DataError as e:
            problem = str(e)
            break
    if world > 1:
        from accelerate.utils import gather_object

        found = [p for p in gather_object([problem]) if p]
        problem = found[0] if found else None
    if problem:
        if accelerator.is_main_process:
            user_error(problem)
        raise UserError(problem)  # printed by rank 0; every process ends with the same status
