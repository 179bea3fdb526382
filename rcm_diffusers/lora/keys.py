"""The one key converter: diffusers names <-> original (Wan, BFL Flux) / ComfyUI names.

Works on flat state dicts of LoRA tensors and of full weights alike. Every key is split
into a *target* (a module or parameter path) and a *suffix* (what kind of tensor it is):

==================  =========================  =====================================
canonical suffix     diffusers file             ComfyUI / original file
==================  =========================  =====================================
``lora_A.weight``    ``.lora_A.weight``         ``.lora_down.weight`` (or lora_A)
``lora_B.weight``    ``.lora_B.weight``         ``.lora_up.weight`` (or lora_B)
``alpha``            ``.alpha``                 ``.alpha``
``diff``             ``.diff``                  ``.diff``   full delta of the weight
``diff_b``           ``.diff_b``                ``.diff_b`` full delta of the bias
``weight``/``bias``  ``.weight``/``.bias``      ``.weight``/``.bias`` (full weights)
==================  =========================  =====================================

A LoRA module contributes ``alpha / rank * lora_B @ lora_A`` (alpha absent: alpha = rank).
Flux's original layout fuses q/k/v (``img_attn.qkv``, ``txt_attn.qkv``) and q/k/v/mlp
(``single_blocks.N.linear1``); a fused LoRA is written as ``A = cat(A_i)``,
``B = blockdiag(B_i)`` and split back exactly. Keys that match no rule raise ``ValueError``
listing them: nothing is dropped silently.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass

import torch

from .names import (
    COMFYUI_AS_IS,
    FLUX_FUSED,
    FLUX_MLP_RATIO,
    FLUX_PAIRS,
    FLUX_SCALE_NORMS,
    FLUX_SWAP_ROWS,
    HUNYUAN15_FUSED,
    HUNYUAN15_PAIRS,
    HUNYUAN15_SWAP_ROWS,
    WAN_PAIRS,
    WAN_PARAMS,
)

__all__ = [
    "ARCHS",
    "detect_arch",
    "detect_format",
    "to_original",
    "to_diffusers",
    "to_comfy_keys",
    "from_any",
    "check_against_model",
    "model_mismatches",
    "lora_modules",
    "rename_target",
    "comfyui_as_is_family",
    "comfyui_as_is",
    "hunyuan15_to_comfyui",
]

ARCHS = ("wan", "flux")

# Longest first: a key is split at the first suffix that matches its end.
_SUFFIXES = (
    "lora_down.weight",
    "lora_up.weight",
    "lora_A.weight",
    "lora_B.weight",
    "lora_B.bias",
    "alpha",
    "diff_b",
    "diff",
    "weight",
    "bias",
    "scale",
)
_CANON_SUFFIX = {"lora_down.weight": "lora_A.weight", "lora_up.weight": "lora_B.weight", "lora_B.bias": "diff_b"}
_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "base_model.model.", "transformer.")


def _compile(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")


@dataclass
class _Rule:
    src: re.Pattern
    dst: str
    is_param: bool


def _rules(pairs, params, reverse: bool) -> list[_Rule]:
    out = []
    for d, o in pairs:
        src, dst = (o, d) if reverse else (d, o)
        out.append(_Rule(_compile(src), dst, d in params))
    return out


_RULES = {
    ("wan", "to_original"): _rules(WAN_PAIRS, WAN_PARAMS, False),
    ("wan", "to_diffusers"): _rules(WAN_PAIRS, WAN_PARAMS, True),
    ("flux", "to_original"): _rules(FLUX_PAIRS, set(), False),
    ("flux", "to_diffusers"): _rules(FLUX_PAIRS, set(), True),
}
_FUSED_FROM = [(_compile(f), f, [_compile(m) for m in ms], ms) for f, ms in FLUX_FUSED]


def _map(target: str, arch: str, direction: str):
    """(new target, is_param) for one target, or None when no rule matches."""
    for rule in _RULES[(arch, direction)]:
        m = rule.src.match(target)
        if m:
            return rule.dst.replace("{i}", m.group("i")) if "i" in m.groupdict() else rule.dst, rule.is_param
    return None


def rename_target(target: str, arch: str, to: str) -> str | None:
    """One module or parameter path (no suffix) in the other naming: ``to`` "diffusers" or "original"; ``None``
    when no rule of ``arch`` matches it (Flux's fused modules included: they have no one-to-one name)."""
    mapped = _map(target, arch, "to_diffusers" if to == "diffusers" else "to_original")
    return None if mapped is None else mapped[0]


# ----------------------------------------------------------------------------- parsing


def _outside_names(key: str) -> str:
    """kohya ``lora_unet_*`` and LightX2V ``.diff_m`` names -> ComfyUI/original names (see those modules)."""
    from .kohya import kohya_to_original
    from .lightx2v import lightx2v_to_original

    return lightx2v_to_original(kohya_to_original(key))


def _strip_prefix(key: str) -> str:
    key = _outside_names(key)
    for p in _PREFIXES:
        if key.startswith(p):
            return key[len(p) :]
    return key


def _split(key: str) -> tuple[str, str]:
    """(target, canonical suffix) of a prefix-free key; suffix "" for a raw parameter."""
    for s in _SUFFIXES:
        if key.endswith("." + s):
            return key[: -len(s) - 1], _CANON_SUFFIX.get(s, s)
    return key, ""


_FLUX_MARKERS = (
    "double_blocks.",
    "single_blocks.",
    "transformer_blocks.",
    "single_transformer_blocks.",
    "final_layer.",
    "img_in.",
    "x_embedder.",
)
_ORIGINAL_MARKERS = (
    "self_attn.",
    "cross_attn.",
    "double_blocks.",
    "single_blocks.",
    "head.head",
    "ffn.0.",
    "ffn.2.",
    "final_layer.",
    "img_in.",
    "txt_in.",
    "time_embedding.",
    "text_embedding.",
    ".modulation",
    "time_projection.",
    "img_emb.",
    ".norm3.",
)
_DIFFUSERS_MARKERS = (
    "attn1.",
    "attn2.",
    "transformer_blocks.",
    "single_transformer_blocks.",
    "ffn.net.",
    "condition_embedder.",
    "proj_out.",
    "scale_shift_table",
    "x_embedder.",
    "time_text_embed.",
    "context_embedder.",
    "norm_out.",
)


#: names only Qwen-Image's diffusers / ComfyUI layout has (its blocks are ``transformer_blocks.N`` as Flux's are)
_QWEN_MARKERS = (".img_mlp.net.", ".txt_mlp.net.", ".img_mod.1.", ".txt_mod.1.")

#: names only FLUX.2's diffusers layout has (SwiGLU feed-forwards, fused single-block projection)
_FLUX2_MARKERS = (
    ".ff.linear_in",
    ".ff.linear_out",
    ".ff_context.linear_in",
    ".ff_context.linear_out",
    ".to_qkv_mlp_proj",
)


#: how a target of HunyuanVideo-1.5 starts in diffusers' layout or in ComfyUI's (names no other family has; its
#: double-stream blocks are named as FLUX.1's in both: transformer_blocks.N.attn.to_q, double_blocks.N.img_mlp.0, ...)
_HUNYUAN15_STARTS = (
    "context_embedder.token_refiner.",
    "context_embedder.proj_in",
    "context_embedder.time_text_embed.",
    "context_embedder_2.",
    "image_embedder.",
    "time_embed.",
    "txt_in.individual_token_refiner.",
    "txt_in.input_embedder",
    "txt_in.t_embedder.",
    "txt_in.c_embedder.",
    "byt5_in.",
    "vision_in.",
    "time_r_in.",
)


def _is_hunyuan15(stripped_key: str) -> bool:
    return stripped_key.startswith(_HUNYUAN15_STARTS)


def detect_arch(state_dict) -> str:
    """ "flux" or "wan" from the key names (any supported layout); ValueError if neither, and for a Qwen-Image, FLUX.2
    or HunyuanVideo-1.5 LoRA (their ComfyUI files: :func:`comfyui_as_is`)."""
    keys = [_strip_prefix(k) for k in state_dict]
    qwen = [k for k in keys if any(m in k for m in _QWEN_MARKERS)]
    if qwen:
        raise ValueError(
            f"a Qwen-Image state dict ({qwen[0]}, ...): the converters cover Wan and Flux; a Qwen-Image LoRA of the "
            "trainer loads as it is with QwenImagePipeline.load_lora_weights and ComfyUI's LoRA loader "
            "(rcm-lora convert --format comfyui adds its alphas as .alpha keys)"
        )
    flux2 = [k for k in keys if any(m in k for m in _FLUX2_MARKERS)]
    if flux2:
        raise ValueError(
            f"a FLUX.2 state dict ({flux2[0]}, ...): the converters cover Wan and FLUX.1; a FLUX.2 LoRA of the trainer "
            "loads as it is with Flux2Pipeline.load_lora_weights and ComfyUI's LoRA loader (rcm-lora convert --format "
            "comfyui adds its alphas as .alpha keys)"
        )
    hy15 = [k for k in keys if _is_hunyuan15(k)]
    if hy15:
        raise ValueError(
            f"a HunyuanVideo-1.5 state dict ({hy15[0]}, ...): the converters cover Wan and FLUX.1; a HunyuanVideo-1.5 "
            'LoRA of the trainer loads as it is with pipe.transformer.load_lora_adapter(..., prefix="transformer"), '
            "and rcm-lora convert --format comfyui writes it in the names of ComfyUI's HunyuanVideo-1.5 model "
            "(q/k/v fused)"
        )
    if any(k.startswith(_FLUX_MARKERS) for k in keys):
        return "flux"
    if any(
        k.startswith(("blocks.", "head.", "patch_embedding", "condition_embedder.", "scale_shift_table")) for k in keys
    ):
        return "wan"
    raise ValueError(
        "cannot tell the architecture (Wan or Flux) from these keys: "
        f"{sorted(state_dict)[:8]}{' ...' if len(state_dict) > 8 else ''}; pass arch='wan' or arch='flux'."
    )


def detect_format(state_dict) -> str:
    """ "diffusers" or "original" (= ComfyUI) naming, from prefixes and layer names."""
    keys = [_outside_names(k) for k in state_dict]
    if any(k.startswith(("diffusion_model.", "model.diffusion_model.")) for k in keys):
        return "original"
    stripped = [_strip_prefix(k) for k in keys]
    n_orig = sum(any(m in k for m in _ORIGINAL_MARKERS) for k in stripped)
    n_diff = sum(any(m in k for m in _DIFFUSERS_MARKERS) for k in stripped)
    if n_orig == 0 and n_diff == 0:
        # e.g. only patch_embedding: both namings agree
        return "diffusers"
    if n_orig and n_diff:
        both = [k for k in stripped if any(m in k for m in _ORIGINAL_MARKERS)][:5]
        raise ValueError(f"state dict mixes diffusers and original key names (original-style: {both}).")
    return "original" if n_orig else "diffusers"


def _group(state_dict) -> dict[str, dict[str, torch.Tensor]]:
    groups: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for key, value in state_dict.items():
        target, suffix = _split(_strip_prefix(key))
        if suffix in groups[target]:
            raise ValueError(f"duplicate entries for {target}.{suffix} (e.g. both lora_A and lora_down).")
        groups[target][suffix] = value
    return groups


def _unmatched_error(unmatched: list[str], arch: str, src: str) -> ValueError:
    shown = ", ".join(sorted(unmatched)[:20])
    more = f" (+{len(unmatched) - 20} more)" if len(unmatched) > 20 else ""
    return ValueError(f"{len(unmatched)} key(s) match no {arch} {src}-layout rule: {shown}{more}")


# ----------------------------------------------------------------------------- scale helpers


def _scale(group: dict) -> float:
    """alpha / rank of one LoRA group (1.0 when alpha is absent)."""
    rank = group["lora_A.weight"].shape[0] if "lora_A.weight" in group else 0
    if "alpha" not in group or rank == 0:  # rank 0 adds nothing whatever the scale (and the LoRA check refuses it)
        return 1.0
    return float(group["alpha"]) / rank


def _alpha_like(group_alpha: torch.Tensor | None, value: float) -> torch.Tensor:
    dtype = group_alpha.dtype if group_alpha is not None else torch.float32
    return torch.tensor(value, dtype=dtype)


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


# ----------------------------------------------------------------------------- diffusers -> original


def _fuse(members: list[str], groups: dict, fused_name: str, hidden: int) -> dict[str, torch.Tensor]:
    """One fused original module from its diffusers members (qkv or qkv+mlp)."""
    sizes = [hidden] * len(members)
    if len(members) == 4:
        mlp = groups.get(members[3], {})
        probe = mlp.get("lora_B.weight", mlp.get("weight", mlp.get("diff", mlp.get("diff_b", mlp.get("bias")))))
        sizes[3] = probe.shape[0] if probe is not None else int(FLUX_MLP_RATIO * hidden)
    present = [m for m in members if m in groups]
    kinds = set().union(*(groups[m].keys() for m in present))
    out: dict[str, torch.Tensor] = {}
    for kind in ("weight", "bias", "diff", "diff_b"):
        if kind not in kinds:
            continue
        missing = [m for m in members if kind not in groups.get(m, {})]
        if missing and kind in ("weight", "bias"):
            raise ValueError(f"cannot fuse {fused_name}.{kind}: missing {[m + '.' + kind for m in missing]}")
        parts = []
        for m, n in zip(members, sizes):
            if kind in groups.get(m, {}):
                parts.append(groups[m][kind])
            else:  # a delta on some members only: the others have a zero delta
                ref = next(groups[p][kind] for p in present if kind in groups[p])
                parts.append(ref.new_zeros((n,) + tuple(ref.shape[1:])))
        out[kind] = torch.cat(parts, dim=0)
    lora_members = [m for m in present if "lora_A.weight" in groups[m]]
    if lora_members:
        scales = [_scale(groups[m]) for m in lora_members]
        has_alpha = any("alpha" in groups[m] for m in lora_members)
        same = all(s == scales[0] for s in scales)
        ref_B = groups[lora_members[0]]["lora_B.weight"]
        A = torch.cat([groups[m]["lora_A.weight"] for m in lora_members], dim=0)
        rank = A.shape[0]
        B = ref_B.new_zeros((sum(sizes), rank))
        row = dict(zip(members, [sum(sizes[:j]) for j in range(len(sizes))]))
        col = 0
        for m, s in zip(lora_members, scales):
            Bm = groups[m]["lora_B.weight"]
            r = Bm.shape[1]
            n = sizes[members.index(m)]
            if Bm.shape[0] != n:
                raise ValueError(f"{m}.lora_B.weight has {Bm.shape[0]} rows; the fused {fused_name} slice has {n}")
            B[row[m] : row[m] + n, col : col + r] = Bm if same else Bm * s
            col += r
        out["lora_A.weight"] = A
        out["lora_B.weight"] = B
        if has_alpha or not same:
            out["alpha"] = _alpha_like(groups[lora_members[0]].get("alpha"), (scales[0] if same else 1.0) * rank)
    return out


def _map_group(target: str, group: dict, arch: str, direction: str):
    """Rename one non-fused module's tensors: ``(new_target, tensors)`` or ``None`` if no rule matches.
    Flux's row-swapped modulation projections and its norm ``scale``/``weight`` naming flip here."""
    mapped = _map(target, arch, direction)
    if mapped is None:
        return None
    new_t = mapped[0]
    diffusers_t = target if direction == "to_original" else new_t
    g = dict(group)
    if arch == "flux" and diffusers_t in FLUX_SWAP_ROWS:
        for k in ("weight", "bias", "diff", "diff_b", "lora_B.weight"):
            if k in g:
                g[k] = _swap_halves(g[k])
    if arch == "flux" and _is_scale_norm(diffusers_t):
        old, new = ("weight", "scale") if direction == "to_original" else ("scale", "weight")
        g = {(new if k == old else k): v for k, v in g.items()}
    return new_t, g


def to_original(
    state_dict,
    arch: str | None = None,
    prefix: str = "diffusion_model.",
    lora_names: tuple[str, str] = ("lora_down", "lora_up"),
    source: str | None = None,
) -> dict[str, torch.Tensor]:
    """Any-layout dict -> original/ComfyUI names (``prefix`` + target + suffix); exact and lossless.

    ``source`` ("diffusers"/"original") skips the naming detection (for parts of a model).
    Raises ValueError listing every key that matches no rule.
    """
    arch = arch or detect_arch(state_dict)
    if (source or detect_format(state_dict)) == "original":
        return _emit(_group(state_dict), prefix, lora_names, arch, "original")
    groups = _group(state_dict)
    out_groups: dict[str, dict[str, torch.Tensor]] = {}
    unmatched = []
    pending_fused: dict[str, list[str]] = {}
    for target, group in groups.items():
        hit = None
        if arch == "flux":
            for _, fused_t, member_res, member_ts in _FUSED_FROM:
                for mre in member_res:
                    m = mre.match(target)
                    if m:
                        i = m.group("i")
                        hit = (fused_t.replace("{i}", i), [t.replace("{i}", i) for t in member_ts])
                        break
                if hit:
                    break
        if hit:
            pending_fused[hit[0]] = hit[1]
            continue
        mapped = _map_group(target, group, arch, "to_original")
        if mapped is None:
            unmatched += [f"{target}.{s}" if s else target for s in group]
            continue
        out_groups[mapped[0]] = mapped[1]
    if unmatched:
        raise _unmatched_error(unmatched, arch, "diffusers")
    for fused_t, members in pending_fused.items():
        hidden = _hidden_of(members, groups)
        out_groups[fused_t] = _fuse(members, groups, fused_t, hidden)
    return _emit(out_groups, prefix, lora_names, arch, "original")


def _is_scale_norm(diffusers_target: str) -> bool:
    return re.sub(r"\.\d+\.", ".{i}.", diffusers_target) in FLUX_SCALE_NORMS


def _hidden_of(members: list[str], groups: dict) -> int:
    for m in members:
        g = groups.get(m, {})
        for k in ("lora_A.weight", "weight", "diff"):
            if k in g and g[k].dim() == 2:
                return g[k].shape[1]
    for m in members[:3]:  # q/k/v rows = hidden
        g = groups.get(m, {})
        for k in ("bias", "diff_b"):
            if k in g:
                return g[k].shape[0]
    raise ValueError(f"cannot infer the hidden size of fused members {members}")


# ----------------------------------------------------------------------------- original -> diffusers


def _split_fused_lora(group: dict, sizes: list[int]) -> list[dict | None]:
    """Per-member LoRA groups from a fused LoRA; exact, compact when B is block-diagonal."""
    A, B = group["lora_A.weight"], group["lora_B.weight"]
    s = _scale(group)
    has_alpha = "alpha" in group
    starts = [sum(sizes[:j]) for j in range(len(sizes))]
    blocks = [B[st : st + n] for st, n in zip(starts, sizes)]
    cols = [torch.nonzero(b.abs().sum(0)).flatten() for b in blocks]
    sets = [set(c.tolist()) for c in cols]
    disjoint = all(not (sets[a] & sets[b]) for a in range(len(sets)) for b in range(a + 1, len(sets)))
    out: list[dict | None] = []
    for b, c in zip(blocks, cols):
        if disjoint and A.shape[0] > 0:  # rank 0: every member keeps its empty pair, for the LoRA check to name
            if c.numel() == 0:
                out.append(None)  # exactly zero delta on this member
                continue
            g = {"lora_A.weight": A[c].clone(), "lora_B.weight": b[:, c].clone()}
            rank = c.numel()
        else:
            g = {"lora_A.weight": A.clone(), "lora_B.weight": b.clone()}
            rank = A.shape[0]
        if has_alpha:
            g["alpha"] = _alpha_like(group["alpha"], s * rank)
        out.append(g)
    return out


def to_diffusers(
    state_dict, arch: str | None = None, prefix: str = "transformer.", source: str | None = None
) -> dict[str, torch.Tensor]:
    """Any-layout dict -> diffusers names (``prefix`` + target + suffix, lora_A/lora_B); exact.

    ``source`` ("diffusers"/"original") skips the naming detection (for parts of a model).
    Raises ValueError listing every key that matches no rule.
    """
    arch = arch or detect_arch(state_dict)
    groups = _group(state_dict)
    if (source or detect_format(state_dict)) == "diffusers":
        _check_known(groups, arch, "to_original")
        return _emit(groups, prefix, ("lora_A", "lora_B"), arch, "diffusers")
    out_groups: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    unmatched = []
    for target, group in groups.items():
        if arch == "flux" and target.endswith(("query_norm.scale", "key_norm.scale")):
            target = target[: -len(".scale")]  # ComfyUI's key for a `.scale` parameter delta
            group = {("weight" if k == "" else k): v for k, v in group.items()}
        fused = None
        if arch == "flux":
            for fre, _, _, member_ts in _FUSED_FROM:
                m = fre.match(target)
                if m:
                    fused = [t.replace("{i}", m.group("i")) for t in member_ts]
                    break
        if fused:
            hidden = None
            for k in ("lora_A.weight", "weight", "diff"):
                if k in group and group[k].dim() == 2:
                    hidden = group[k].shape[1]
                    break
            rows = next(
                v.shape[0] for k, v in group.items() if k in ("lora_B.weight", "weight", "diff", "bias", "diff_b")
            )
            if hidden is None:
                hidden = int(rows // (3 + FLUX_MLP_RATIO)) if len(fused) == 4 else rows // 3
            sizes = [hidden] * 3 + ([rows - 3 * hidden] if len(fused) == 4 else [])
            if sum(sizes) != rows or min(sizes) <= 0:
                raise ValueError(f"{target}: {rows} rows cannot be split into {len(fused)} slices of hidden {hidden}")
            starts = [sum(sizes[:j]) for j in range(len(sizes))]
            for k, v in group.items():
                if k in ("weight", "bias", "diff", "diff_b"):
                    for mt, st, n in zip(fused, starts, sizes):
                        out_groups[mt][k] = v[st : st + n].clone()
                elif k not in ("lora_A.weight", "lora_B.weight", "alpha"):
                    unmatched.append(f"{target}.{k}")
            if "lora_A.weight" in group:
                for mt, g in zip(fused, _split_fused_lora(group, sizes)):
                    if g is not None:
                        out_groups[mt].update(g)
            continue
        mapped = _map_group(target, group, arch, "to_diffusers")
        if mapped is None:
            unmatched += [f"{target}.{s}" if s else target for s in group]
            continue
        out_groups[mapped[0]].update(mapped[1])
    if unmatched:
        raise _unmatched_error(unmatched, arch, "original")
    return _emit(out_groups, prefix, ("lora_A", "lora_B"), arch, "diffusers")


def _check_known(groups: dict, arch: str, direction: str) -> None:
    unmatched = []
    for target, group in groups.items():
        if _map(target, arch, direction) is not None:
            continue
        if arch == "flux" and any(mre.match(target) for _, _, mres, _ in _FUSED_FROM for mre in mres):
            continue
        unmatched += [f"{target}.{s}" if s else target for s in group]
    if unmatched:
        raise _unmatched_error(unmatched, arch, "diffusers")


def _emit(groups: dict, prefix: str, lora_names: tuple[str, str], arch: str, layout: str) -> dict:
    if layout == "original":
        _check_known_original(groups, arch)
    down, up = lora_names
    out = {}
    for target, group in groups.items():
        if arch == "wan" and target == "patch_embedding":
            group = _patch_embedding_forms(group, layout)
        for suffix, v in group.items():
            if suffix == "lora_A.weight":
                s = f"{down}.weight"
            elif suffix == "lora_B.weight":
                s = f"{up}.weight"
            else:
                s = suffix
            if layout == "original" and arch == "flux" and s == "diff" and target.endswith(("query_norm", "key_norm")):
                out[f"{prefix}{target}.scale.diff"] = v  # ComfyUI's key for a `.scale` delta
                continue
            out[f"{prefix}{target}.{s}" if s else f"{prefix}{target}"] = v
    return out


def _patch_embedding_forms(group: dict, layout: str) -> dict:
    """Wan's patch embedding in the form each layout's loader needs (exact reshapes, no model math).

    Weights and full deltas: the Conv3d form ``[dim, C, 1, 2, 2]`` in both layouts (the official
    rCM Linear form ``[dim, C*4]`` is reshaped, see :mod:`.rcm_official`). LoRA factors: the
    Conv3d LoRA of peft in diffusers (``lora_A [r, C, 1, 2, 2]``, ``lora_B [dim, r, 1, 1, 1]``), the
    flat 2-D pair in ComfyUI (its LoRA adapter multiplies flattened factors and reshapes to the weight);
    a ComfyUI *file* holds the full delta instead, see :func:`comfyui_file_forms`.
    """
    from .rcm_official import patch_embedding_to_conv

    g = dict(group)
    for k in ("weight", "diff"):
        if k in g and g[k].dim() == 2:  # other ranks (e.g. name probes) pass through unchanged
            g[k] = patch_embedding_to_conv(g[k])
    if "lora_A.weight" in g and "lora_B.weight" in g:
        A, B = g["lora_A.weight"], g["lora_B.weight"]
        if A.dim() < 2 or B.dim() < 2:
            return g
        if layout == "diffusers":
            g["lora_A.weight"] = patch_embedding_to_conv(A)
            g["lora_B.weight"] = B.reshape(B.shape[0], B.shape[1], 1, 1, 1)
        else:
            g["lora_A.weight"], g["lora_B.weight"] = A.flatten(1), B.flatten(1)
    return g


def _is_power_of_two(x: float) -> bool:
    m, _ = math.frexp(x)
    return x > 0 and m == 0.5


def comfyui_file_forms(comfy_sd: dict, arch: str) -> dict:
    """A ComfyUI-layout Wan LoRA as :func:`to_comfy_keys` writes it, in the forms that both ComfyUI and diffusers'
    ``load_lora_weights`` take; other architectures are returned unchanged.

    diffusers' Wan converter (``_convert_non_diffusers_wan_lora_to_diffusers``) refuses the whole file when a key
    is left over after its rules, and two kinds of ours were:

    - the patch embedding's LoRA pair (it has no rule for one; it drops ``.diff`` keys). Written instead as the
      full delta ``patch_embedding.diff = alpha/r * B @ A`` in the Conv3d form ``[dim, C, 1, 2, 2]`` (float32
      at least, plus any ``diff`` there), which ComfyUI applies to its Conv3d weight: how LightX2V's ComfyUI
      files carry it. dim x C*4 numbers, the size of the weight; one rounding.
    - ``.alpha`` outside the blocks (it reads ``.alpha`` only for block modules): ``head.head``, the time/text
      embeddings, ``time_projection``, ``img_emb``. Folded into ``lora_down`` (``alpha/r * A``, no ``.alpha``:
      scale 1 in both loaders); exact when alpha/r is a power of two (our extraction writes alpha = r), else
      ``lora_down`` is kept in float32 (one float32 rounding).
    """
    if arch != "wan":
        return comfy_sd
    from .rcm_official import patch_embedding_to_conv

    out = dict(comfy_sd)
    for target, g in _group(comfy_sd).items():
        if target.startswith("blocks.") or "lora_A.weight" not in g:
            continue
        name = "diffusion_model." + target  # to_comfy_keys' names
        down, up = f"{name}.lora_down.weight", f"{name}.lora_up.weight"
        A, B, scale = g["lora_A.weight"], g["lora_B.weight"], _scale(g)
        out.pop(f"{name}.alpha", None)
        if target == "patch_embedding":
            dtype = torch.promote_types(torch.promote_types(A.dtype, B.dtype), torch.float32)
            d = patch_embedding_to_conv((B.flatten(1).to(dtype) @ A.flatten(1).to(dtype)).mul_(scale))
            if "diff" in g:
                d = d.add_(patch_embedding_to_conv(g["diff"]).to(dtype))
            out[f"{name}.diff"] = d
            del out[down], out[up]
        elif scale != 1.0:
            folded = A.to(torch.promote_types(A.dtype, torch.float32)) * scale
            out[down] = folded.to(A.dtype) if _is_power_of_two(scale) else folded
    return out


def _check_known_original(groups: dict, arch: str) -> None:
    unmatched = []
    for target, group in groups.items():
        t = target[: -len(".scale")] if arch == "flux" and target.endswith(("_norm.scale",)) else target
        if _map(t, arch, "to_diffusers") is not None:
            continue
        if arch == "flux" and any(fre.match(t) for fre, _, _, _ in _FUSED_FROM):
            continue
        unmatched += [f"{target}.{s}" if s else target for s in group]
    if unmatched:
        raise _unmatched_error(unmatched, arch, "original")


# ----------------------------------------------------------------------------- families ComfyUI maps as they are


def comfyui_as_is_family(state_dict) -> str | None:
    """ "qwen_image", "flux2" or "hunyuan_video15" for a LoRA of a family whose ComfyUI file :func:`comfyui_as_is`
    writes, from the key names (any prefix); None for any other. Qwen-Image and FLUX.2 keep their diffusers names
    (stock ComfyUI maps them as they are: ``names.COMFYUI_AS_IS``); HunyuanVideo-1.5 is renamed to ComfyUI's model
    names (:func:`hunyuan15_to_comfyui`), in either naming."""
    keys = [_strip_prefix(k) for k in state_dict]
    for family, markers in (("qwen_image", _QWEN_MARKERS), ("flux2", _FLUX2_MARKERS)):
        if any(m in k for k in keys for m in markers):
            return family
    if any(_is_hunyuan15(k) for k in keys):
        return "hunyuan_video15"
    return None


def comfyui_as_is(state_dict, family: str) -> dict[str, torch.Tensor]:
    """A Qwen-Image / FLUX.2 LoRA (``transformer.``, ``diffusion_model.`` or no prefix; lora_A/B or lora_down/up) in
    the names stock ComfyUI maps for it: ``transformer.<diffusers target>.lora_A.weight`` / ``.lora_B.weight`` and
    ``.alpha`` (ComfyUI scales by alpha / rank, and reads no peft header; alpha = rank where the input has none).
    A HunyuanVideo-1.5 LoRA goes through :func:`hunyuan15_to_comfyui`.

    ValueError lists every key ComfyUI's map has no entry for (``names.COMFYUI_AS_IS``), and full deltas (``.diff``,
    bias deltas), which are not taken here: nothing is dropped silently."""
    if family == "hunyuan_video15":
        return hunyuan15_to_comfyui(state_dict)
    patterns = [re.compile(p) for p in COMFYUI_AS_IS[family]]
    unmatched, out = [], {}
    for target, group in _group(state_dict).items():
        if not any(p.fullmatch(target) for p in patterns):
            unmatched += [f"{target}.{s}" if s else target for s in group]
            continue
        extra = sorted(set(group) - {"lora_A.weight", "lora_B.weight", "alpha"})
        if extra:
            unmatched += [f"{target}.{s}" if s else target for s in extra]
            continue
        A, B = group.get("lora_A.weight"), group.get("lora_B.weight")
        if A is None or B is None:
            raise ValueError(f"{target}: lora_A without lora_B (or the reverse); the LoRA file is incomplete")
        out[f"transformer.{target}.lora_A.weight"] = A
        out[f"transformer.{target}.lora_B.weight"] = B
        alpha = group.get("alpha")
        out[f"transformer.{target}.alpha"] = (
            torch.tensor(float(A.shape[0])) if alpha is None else alpha.reshape(()).to(torch.float32)
        )
    if unmatched:
        name = {"qwen_image": "Qwen-Image", "flux2": "FLUX.2"}[family]
        raise ValueError(
            f"{len(unmatched)} key(s) of this {name} LoRA have no entry in stock ComfyUI's LoRA key map "
            f"(comfy/lora.py model_lora_keys_unet) or are not LoRA pairs: {sorted(unmatched)[:10]}"
            f"{' ...' if len(unmatched) > 10 else ''}"
        )
    return out


_HY15_RULES = [(_compile(d), o) for d, o in HUNYUAN15_PAIRS]
_HY15_COMFY = [_compile(o) for _, o in HUNYUAN15_PAIRS] + [_compile(f) for f, _ in HUNYUAN15_FUSED]
_HY15_FUSED = [(f, [_compile(m) for m in ms], ms) for f, ms in HUNYUAN15_FUSED]
_HY15_SWAP = [_compile(d) for d in HUNYUAN15_SWAP_ROWS]


def _fill(template: str, m: re.Match) -> str:
    return template.replace("{i}", m.group("i")) if "i" in m.groupdict() else template


def hunyuan15_comfyui_name(target: str) -> str | None:
    """ComfyUI's module name for one diffusers module of HunyuanVideo-1.5 (``names.HUNYUAN15_PAIRS``); None for a
    module with no one-to-one counterpart (q/k/v, which ComfyUI fuses, and modules it does not have)."""
    for rule, dst in _HY15_RULES:
        m = rule.match(target)
        if m:
            return _fill(dst, m)
    return None


def hunyuan15_to_comfyui(state_dict) -> dict[str, torch.Tensor]:
    """A HunyuanVideo-1.5 LoRA (diffusers names, or ComfyUI's already; any prefix, lora_A/B or lora_down/up) in the
    names of ComfyUI's HunyuanVideo-1.5 model: ``diffusion_model.<name>.lora_A.weight`` / ``.lora_B.weight`` and
    ``.alpha``, which stock ComfyUI's LoRA loader maps for every weight of the model.

    Renames follow ``names.HUNYUAN15_PAIRS``; the final AdaLN projection's ``lora_B`` swaps its row halves (diffusers
    orders it (scale, shift), ComfyUI (shift, scale)). The q/k/v LoRAs of one attention become one LoRA on ComfyUI's
    fused ``qkv`` weight (``names.HUNYUAN15_FUSED``): ``A = cat(A_q, A_k, A_v)`` (rank r_q + r_k + r_v),
    ``B = blockdiag(B_q, B_k, B_v)``, and ``alpha = s * rank`` for the common scale ``s = alpha_i / r_i`` (when the
    parts' scales differ, each ``B_i`` carries its own scale and alpha = rank), so its delta is exactly the
    concatenation of the parts' deltas; a missing part adds zero rows. ValueError lists every key of a module ComfyUI's
    model does not have, and full deltas or bias LoRAs (not taken here): nothing is dropped silently.
    """
    groups = _group(state_dict)
    out_groups: dict[str, dict[str, torch.Tensor]] = {}
    pending: dict[str, list[str]] = {}
    unmatched = []
    for target, group in groups.items():
        extra = sorted(set(group) - {"lora_A.weight", "lora_B.weight", "alpha"})
        if extra:
            unmatched += [f"{target}.{s}" if s else target for s in extra]
            continue
        if "lora_A.weight" not in group or "lora_B.weight" not in group:
            raise ValueError(f"{target}: lora_A without lora_B (or the reverse); the LoRA file is incomplete")
        if any(c.match(target) for c in _HY15_COMFY):  # ComfyUI's name already
            out_groups[target] = dict(group)
            continue
        fused = None
        for fused_t, member_res, member_ts in _HY15_FUSED:
            m = next((mm for mm in (r.match(target) for r in member_res) if mm), None)
            if m:
                fused = (_fill(fused_t, m), [_fill(t, m) for t in member_ts])
                break
        if fused:
            pending[fused[0]] = fused[1]
            continue
        name = hunyuan15_comfyui_name(target)
        if name is None:
            unmatched.append(target)
            continue
        g = dict(group)
        if any(r.match(target) for r in _HY15_SWAP):
            g["lora_B.weight"] = _swap_halves(g["lora_B.weight"])
        out_groups[name] = g
    if unmatched:
        shown = sorted(unmatched)
        raise ValueError(
            f"{len(shown)} module(s) of this HunyuanVideo-1.5 LoRA have no counterpart in ComfyUI's HunyuanVideo-1.5 "
            f"model or are not LoRA pairs: {shown[:10]}{' ...' if len(shown) > 10 else ''}"
        )
    for fused_t, members in pending.items():
        if fused_t in out_groups:
            raise ValueError(f"{fused_t}: the LoRA holds it both fused and as q/k/v parts")
        out_groups[fused_t] = _fuse(members, groups, fused_t, _hidden_of(members, groups))
    out = {}
    for target, g in out_groups.items():
        A, B = g["lora_A.weight"], g["lora_B.weight"]
        out[f"diffusion_model.{target}.lora_A.weight"] = A
        out[f"diffusion_model.{target}.lora_B.weight"] = B
        alpha = g.get("alpha")
        out[f"diffusion_model.{target}.alpha"] = (
            torch.tensor(float(A.shape[0])) if alpha is None else alpha.reshape(()).to(torch.float32)
        )
    return out


# ----------------------------------------------------------------------------- front doors


def to_comfy_keys(state_dict, arch: str | None = None) -> dict[str, torch.Tensor]:
    """Any-layout LoRA/delta dict -> the ComfyUI file layout (``diffusion_model.``, lora_down/up)."""
    return to_original(state_dict, arch, prefix="diffusion_model.", lora_names=("lora_down", "lora_up"))


def from_any(state_dict, arch: str | None = None, prefix: str = "transformer.") -> dict[str, torch.Tensor]:
    """Any-layout LoRA/delta dict -> diffusers names (format detected); ValueError lists unknown keys."""
    return to_diffusers(state_dict, arch, prefix=prefix)


def lora_modules(state_dict) -> dict[str, dict[str, torch.Tensor]]:
    """Group a dict by target: ``{target: {canonical suffix: tensor}}`` (prefixes stripped)."""
    return {t: dict(g) for t, g in _group(state_dict).items()}


def check_against_model(state_dict, model_state_dict, prefix: str = "") -> None:
    """Check every LoRA/delta target against a model's parameter names and shapes (same layout).

    ``model_state_dict`` maps names (optionally under ``prefix``) to tensors or shapes.
    Raises ValueError listing missing targets and shape mismatches (:func:`model_mismatches`).
    """
    problems = model_mismatches(state_dict, model_state_dict, prefix)
    if problems:
        shown = "; ".join(problems[:20])
        more = f" (+{len(problems) - 20} more)" if len(problems) > 20 else ""
        raise ValueError(f"{len(problems)} LoRA key(s) do not match the model: {shown}{more}")


def model_mismatches(state_dict, model_state_dict, prefix: str = "") -> list[str]:
    """The LoRA/delta targets of ``state_dict`` missing from a model or of another shape, one line each (empty when
    every target fits); ``model_state_dict`` as for :func:`check_against_model`."""
    shapes = {}
    for k, v in model_state_dict.items():
        if k.startswith(prefix):
            k = k[len(prefix) :]
        shapes[_strip_prefix(k)] = tuple(v.shape) if hasattr(v, "shape") else tuple(v)
    problems = []
    for target, g in _group(state_dict).items():
        w = shapes.get(f"{target}.weight", shapes.get(f"{target}.scale", shapes.get(target)))
        if w is None:
            problems.append(f"{target}: no such parameter in the model")
            continue
        if "lora_A.weight" in g:
            A, B = g["lora_A.weight"], g.get("lora_B.weight")
            if B is None:
                problems.append(f"{target}: lora_A without lora_B")
                continue
            if A.shape[0] != B.shape[1]:
                problems.append(f"{target}: rank mismatch lora_A {tuple(A.shape)} vs lora_B {tuple(B.shape)}")
            lora_shape = (B.shape[0], math.prod(A.shape[1:]))
            if len(w) < 2 or lora_shape != (w[0], math.prod(w[1:])):
                problems.append(f"{target}: LoRA delta {lora_shape} vs weight {w}")
        for k in ("diff", "weight", "", "scale"):
            if k in g and tuple(g[k].shape) != w:
                problems.append(f"{target}.{k}: shape {tuple(g[k].shape)} vs model {w}")
        for k in ("diff_b", "bias"):
            if k in g:
                b = shapes.get(f"{target}.bias")
                if b is None or tuple(g[k].shape) != b:
                    problems.append(f"{target}.{k}: shape {tuple(g[k].shape)} vs model bias {b}")
    return problems
