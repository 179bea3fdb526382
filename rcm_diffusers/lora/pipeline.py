"""LoRAs in a live diffusers pipeline: an rCM student (one expert or the Wan 2.2 pair), and any LoRA file with
every delta it holds (LightX2V / Kijai distill LoRAs: norm, bias and modulation deltas besides the LoRA pairs).

``training/rcm.py`` writes a two-expert run as ``pytorch_lora_weights.safetensors`` (the high-noise expert,
``transformer``) plus ``transformer_2/pytorch_lora_weights.safetensors`` (the low-noise expert), and the same under
``ema/``. diffusers loads one LoRA per call (``load_lora_weights(..., load_into_transformer_2=True)`` for the
second expert); :func:`load_rcm_lora` makes the two calls with one adapter name and strength, and sets the
pipeline's scheduler to the ``RCMScheduler`` the run wrote next to the LoRA (``scheduler/``).

diffusers' ``load_lora_weights`` applies LoRA pairs (and bias deltas of LoRA'd modules as peft's ``lora_B.bias``)
but drops full deltas: ``.diff`` of norms and of the patch embedding, ``.diff_b`` of modules without a LoRA, and
the modulation deltas (LightX2V ``.diff_m``, Kijai ``.modulation.diff``). :func:`load_full_lora` loads the pairs
through ``load_lora_weights`` (one peft adapter, strength by peft's ``set_scale``) and adds the rest to the
parameters itself (peft has no adapter type for a full delta of a norm weight or a raw parameter such as
``scale_shift_table``), keeping the original values so that unloading restores them bit for bit.
"""

from __future__ import annotations

import os

import torch

from .io import _zero_lora_biases

__all__ = ["WEIGHT_NAME", "expert_lora_files", "load_rcm_lora", "FullLora", "load_full_lora"]

WEIGHT_NAME = "pytorch_lora_weights.safetensors"


def expert_lora_files(path: str) -> dict[str, str]:
    """``{"transformer": file[, "transformer_2": file]}`` of a trainer output folder (or its ``ema/``), or
    ``{"transformer": path}`` for a single ``.safetensors`` file. Raises ``FileNotFoundError`` when nothing is there."""
    if os.path.isfile(path):
        return {"transformer": path}
    high, low = os.path.join(path, WEIGHT_NAME), os.path.join(path, "transformer_2", WEIGHT_NAME)
    if not os.path.isfile(high):
        raise FileNotFoundError(f"{path}: no {WEIGHT_NAME} (a training/rcm.py output folder, its ema/, or a LoRA file)")
    return {"transformer": high, **({"transformer_2": low} if os.path.isfile(low) else {})}


def load_rcm_lora(
    pipe,
    path: str,
    adapter_name: str = "rcm",
    weight: float = 1.0,
    reuse_for_both: bool = False,
    scheduler: bool = True,
) -> dict[str, str]:
    """Load the student LoRA of ``path`` (see :func:`expert_lora_files`) into ``pipe`` under ``adapter_name`` at
    strength ``weight``: a two-expert pair goes to ``transformer`` and ``transformer_2``; a one-network LoRA goes
    to ``transformer``, and on a two-expert pipeline only with ``reuse_for_both=True`` (then into both experts,
    the "one LoRA for both" approach). With ``scheduler=True`` (default) also set ``pipe.scheduler`` to the
    sampler the student was trained for, ``RCMScheduler.from_lora(path, pipe.scheduler.config)`` (the run's
    ``scheduler/``; without one, ``from_config`` defaults and a warning); ``scheduler=False`` leaves it alone.
    Low-memory pipelines (docs/sampling.md, "Low-memory pipelines"): GGUF, torchao, group offload and model CPU
    offload (put back on the device it had) work; layerwise casting must come after this call. A pipeline without
    ``load_lora_weights`` (diffusers' HunyuanVideo-1.5) gets the file through its transformer's ``load_lora_adapter``.
    Returns ``{component: file}`` of the LoRA files loaded."""
    files = expert_lora_files(path)
    two_expert_pipe = getattr(pipe, "transformer_2", None) is not None
    if "transformer_2" in files and not two_expert_pipe:
        raise ValueError(
            f"{path} holds a LoRA per Wan 2.2 expert, but {type(pipe).__name__} has no transformer_2: "
            "load it into a two-expert pipeline (or load one expert's file with load_lora_weights)"
        )
    if "transformer_2" not in files and two_expert_pipe:
        if not reuse_for_both:
            raise ValueError(
                f"{path} holds one network's LoRA and {type(pipe).__name__} has two experts: pass "
                "reuse_for_both=True to apply it to both, or train both experts (training/rcm.py --experts both)"
            )
        files = {"transformer": files["transformer"], "transformer_2": files["transformer"]}
    for component in files:
        storage = _layerwise_storage_dtype(getattr(pipe, component))
        if storage is not None:
            raise ValueError(
                f"pipe.{component} has layerwise casting (storage {storage}), so peft would store the LoRA in "
                f"{storage}: load the transformer again, call load_rcm_lora, then enable_layerwise_casting(...)"
            )
    restore_offload = _pause_model_cpu_offload(pipe)
    try:
        for component, f in files.items():
            d, name = os.path.split(f)
            if not hasattr(pipe, "load_lora_weights"):  # a pipeline without diffusers' LoRA mixin (HunyuanVideo-1.5)
                getattr(pipe, component).load_lora_adapter(
                    d or ".", weight_name=name, adapter_name=adapter_name, prefix="transformer"
                )
                continue
            pipe.load_lora_weights(
                d or ".",
                weight_name=name,
                adapter_name=adapter_name,
                **({"load_into_transformer_2": True} if component == "transformer_2" else {}),
            )
    finally:
        restore_offload()
    if weight != 1.0:
        if hasattr(pipe, "set_adapters"):
            pipe.set_adapters([adapter_name], [weight])
        else:
            for component in files:
                getattr(pipe, component).set_adapters([adapter_name], [weight])
    if scheduler:
        from ..schedulers import RCMScheduler

        current = getattr(pipe, "scheduler", None)
        pipe.scheduler = RCMScheduler.from_lora(path, None if current is None else current.config)
    return files


def _layerwise_storage_dtype(model) -> torch.dtype | None:
    """The storage dtype of diffusers' layerwise casting (``enable_layerwise_casting``) on ``model``, or None."""
    for m in model.modules():
        registry = getattr(m, "_diffusers_hook", None)
        hook = None if registry is None else registry.get_hook("layerwise_casting")
        if hook is not None:
            return hook.storage_dtype
    return None


def _pause_model_cpu_offload(pipe):
    """Remove the model CPU offload hooks of ``pipe`` (``enable_model_cpu_offload``) and return the function that
    puts them back on the device they had. diffusers' ``load_lora_weights`` puts them back itself, but on the default
    accelerator (``enable_model_cpu_offload()``), which raises after loading when that device was the CPU."""
    from accelerate.hooks import CpuOffload

    device = getattr(pipe, "_offload_device", None)
    modules = [c for c in getattr(pipe, "components", {}).values() if isinstance(c, torch.nn.Module)]
    if device is None or not any(isinstance(getattr(c, "_hf_hook", None), CpuOffload) for c in modules):
        return lambda: None
    pipe.remove_all_hooks()
    return lambda: pipe.enable_model_cpu_offload(device=device)


def _lora_pairs_for_peft(groups: dict) -> tuple[dict, list[tuple[str, str, torch.Tensor]]]:
    """``(peft tensors, full deltas)`` of a diffusers-named LoRA grouped by module (no prefix).

    peft tensors: ``transformer.<module>.lora_A/lora_B.weight`` with ``alpha/rank`` folded into ``lora_A`` (in
    float32; exact for the power-of-two scales of LightX2V/Kijai files), so no adapter metadata is needed on any
    diffusers version, plus ``lora_B.bias`` for the bias delta of a LoRA'd module (peft's ``lora_bias``; scaled by
    the strength like the pair). Full deltas: ``(module, kind, tensor)`` with kind ``diff`` (the weight or raw
    parameter) or ``diff_b`` (the bias of a module without a LoRA)."""
    tensors, full = {}, []
    for target, g in groups.items():
        has_lora = "lora_A.weight" in g
        if has_lora:
            A, B = g["lora_A.weight"], g["lora_B.weight"]
            s = float(g["alpha"]) / A.shape[0] if "alpha" in g else 1.0
            tensors[f"transformer.{target}.lora_A.weight"] = A if s == 1.0 else A.float() * s
            tensors[f"transformer.{target}.lora_B.weight"] = B
        for kind, v in g.items():
            if kind == "diff_b" and has_lora:
                tensors[f"transformer.{target}.lora_B.bias"] = v
            elif kind in ("diff", "diff_b"):
                full.append((target, kind, v))
            elif kind not in ("lora_A.weight", "lora_B.weight", "alpha"):
                raise ValueError(
                    f"{target}.{kind}: not a LoRA or delta tensor (a model checkpoint?); "
                    "load_full_lora takes LoRA files"
                )
    if any(k.endswith(".lora_B.bias") for k in tensors):
        _zero_lora_biases(tensors)
    return tensors, full


def _parameter(params: dict, target: str, kind: str) -> tuple[str, torch.nn.Parameter]:
    """The live parameter (of ``params``, a model's ``named_parameters``) a full delta applies to, also when peft
    has wrapped the module (``base_layer``)."""
    if kind == "diff_b":
        names = (f"{target}.bias", f"{target}.base_layer.bias")
    else:
        names = (target, f"{target}.weight", f"{target}.base_layer.weight")
    for n in names:
        if n in params:
            return n, params[n]
    raise ValueError(f"{target}.{kind}: the model has no parameter {' / '.join(names)}")


class FullLora:
    """A LoRA file applied to a live pipeline component: the pairs as a peft adapter, the full deltas added to the
    parameters. ``set_weight`` changes the strength of both; ``unload`` removes both (parameters bit-identical to
    before). Made by :func:`load_full_lora`."""

    def __init__(self, pipe, component: str, adapter_name: str | None, deltas: list, weight: float):
        self.pipe, self.component, self.adapter_name = pipe, component, adapter_name
        self._deltas = deltas  # [(parameter name, parameter, original value, delta)]
        self.weight = None
        self.loaded = True
        self.set_weight(weight)

    @property
    def full_deltas(self) -> list[str]:
        """Names of the parameters that hold a full delta (applied by us, not by peft)."""
        return [name for name, _, _, _ in self._deltas]

    def set_weight(self, weight: float) -> None:
        """Strength ``weight`` for the pairs (peft ``set_scale`` on this adapter only, other adapters untouched) and
        the full deltas (``p = p0 + weight * delta`` from the kept original ``p0``, in float32 as
        :class:`~rcm_diffusers.lora.merge.LoraDelta` computes it, so no drift from repeated changes)."""
        from .merge import _check_weight, _fit

        if not self.loaded:
            raise RuntimeError("this LoRA was unloaded; load it again with load_full_lora")
        weight = _check_weight(weight)
        model = getattr(self.pipe, self.component)
        if self.adapter_name is not None:
            from peft.tuners.tuners_utils import BaseTunerLayer

            for module in model.modules():
                if isinstance(module, BaseTunerLayer) and self.adapter_name in getattr(module, "scaling", {}):
                    module.set_scale(self.adapter_name, weight)
        with torch.no_grad():
            for name, p, p0, d in self._deltas:
                out = p0.float()
                out = out.clone() if out is p0 else out
                p.copy_(out.add_(_fit(d.float(), tuple(p0.shape), name), alpha=weight).to(p0.dtype))
        self.weight = weight

    def unload(self) -> None:
        """Delete the adapter (and peft's wrappers when no other adapter is left) and restore every parameter a full
        delta touched to its original value."""
        if not self.loaded:
            return
        with torch.no_grad():
            for _, p, p0, _ in self._deltas:
                p.copy_(p0)
        if self.adapter_name is not None:
            self.pipe.delete_adapters(self.adapter_name)
            if not any(self.pipe.get_list_adapters().values()):
                self.pipe.unload_lora_weights()  # no adapter left: peft's wrappers go, the plain modules come back
        self.loaded = False


def load_full_lora(
    pipe, lora, adapter_name: str = "full_lora", weight: float = 1.0, component: str = "transformer"
) -> FullLora:
    """Apply every delta of a LoRA file (or dict, any layout: diffusers, ComfyUI, LightX2V ``.diff_m``, Kijai,
    kohya) to ``pipe.<component>`` at strength ``weight``; returns a :class:`FullLora` (``set_weight``, ``unload``).

    The LoRA pairs go through ``pipe.load_lora_weights`` as adapter ``adapter_name`` (``load_into_transformer_2``
    for ``component="transformer_2"``); the full deltas diffusers drops (norm/patch-embedding ``diff``, modulation,
    bias deltas of modules without a LoRA) are added to the parameters. The result equals ``merge_lora`` at the
    same weight up to float32 round-off. Raises ValueError for keys that match no module of the model.
    """
    from .io import load_lora
    from .keys import detect_arch, from_any, lora_modules
    from .merge import _fit

    if isinstance(lora, (str, os.PathLike)):
        sd, _ = load_lora(lora, format="diffusers")
    else:
        sd = from_any(dict(lora), detect_arch(lora))
    model = getattr(pipe, component, None)
    if model is None:
        raise ValueError(f"{type(pipe).__name__} has no {component}")
    tensors, full = _lora_pairs_for_peft(lora_modules(sd))
    params = dict(model.named_parameters())
    originals = []
    for target, kind, d in full:  # every full delta checked before anything is loaded
        name, p = _parameter(params, target, kind)
        if _fit(d, tuple(p.shape), name) is None:
            raise ValueError(f"{target}.{kind}: delta {tuple(d.shape)} vs parameter {name} {tuple(p.shape)}")
        originals.append(p.detach().clone())
    if tensors:
        pipe.load_lora_weights(
            tensors,
            adapter_name=adapter_name,
            **({"load_into_transformer_2": True} if component == "transformer_2" else {}),
        )
    else:
        adapter_name = None
    params = dict(model.named_parameters())  # peft wrapped the LoRA'd modules: their weights are now base_layer.*
    deltas = [(*_parameter(params, target, kind), p0, d) for (target, kind, d), p0 in zip(full, originals)]
    return FullLora(pipe, component, adapter_name, deltas, weight)
