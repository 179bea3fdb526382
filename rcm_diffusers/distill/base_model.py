"""The frozen base a run trains on: the teacher transformer, or Wan 2.2's two experts as one module."""

from __future__ import annotations

__all__ = ["load_transformer", "check_experts"]


def check_experts(cfg, index: dict) -> None:
    """Refuse (one line, exit status 2) an ``experts`` / ``transformer_subfolder`` choice the pipeline's
    ``model_index.json`` (``index``) cannot serve; ``inputs.check_inputs`` calls it before the run folder is touched."""
    from .errors import user_error
    from .experts import HIGH, LOW, index_boundary_ratio

    b = index_boundary_ratio(index)
    if cfg.experts == "both" and b is None and not cfg.boundary_ratio:
        user_error(
            f"--experts both: {cfg.pretrained} has no transformer_2 with a boundary_ratio in model_index.json; "
            "use --experts one, or set --boundary_ratio for a pipeline that has transformer_2"
        )
    if cfg.experts == "one" or (cfg.experts == "auto" and b is None):
        return
    if cfg.experts == "auto" and cfg.transformer_subfolder != HIGH:
        user_error(
            f"--transformer_subfolder {cfg.transformer_subfolder}: {cfg.pretrained} has two experts, which "
            "are trained together by default; add --experts one to train this one alone"
        )
    if not index.get(LOW) or index[LOW][0] is None:
        user_error(f"--experts {cfg.experts}: {cfg.pretrained} has no transformer_2")


def load_transformer(transformer_cls, cfg, index: dict, dtype, device, log=print):
    """The teacher network of a run: ``cfg.transformer_subfolder``, or -- for a two-expert pipeline with
    ``cfg.experts`` ``both``/``auto`` -- ``transformer`` and ``transformer_2`` as one ``WanExpertSwitch`` at
    ``cfg.boundary_ratio`` (0 = the pipeline's ``boundary_ratio``) (docs/math.md §6.1)."""
    from .experts import HIGH, LOW, WanExpertSwitch, index_boundary_ratio

    def load(sub):
        return transformer_cls.from_pretrained(cfg.pretrained, subfolder=sub, torch_dtype=dtype).to(device)

    check_experts(cfg, index)
    b = index_boundary_ratio(index)
    if cfg.experts == "one" or (cfg.experts == "auto" and b is None):
        return load(cfg.transformer_subfolder)
    b = cfg.boundary_ratio or b
    log(f"two experts: {HIGH} (high noise, 1000 r >= {1000 * b:g}) and {LOW} (low noise) trained in one run")
    return WanExpertSwitch(load(HIGH), load(LOW), b)
