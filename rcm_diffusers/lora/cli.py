"""``rcm-lora`` command line: convert, extract, merge, transfer, inspect."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rcm-lora",
        description="LoRA and checkpoint tools for Wan / Flux (rCM).",
        epilog="Checkpoints: .safetensors, .pt/.pth (read with weights_only=True) or a diffusers model folder "
        "(sharded or not). Official rCM dumps, TurboDiffusion int8 files, and LoRAs in diffusers, ComfyUI, "
        "LightX2V, Kijai and kohya/musubi layouts are read; see docs/lora_formats.md.",
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("convert", help="rewrite a LoRA, or a model checkpoint, in the diffusers or ComfyUI layout")
    c.add_argument(
        "input",
        help="LoRA file, a training/rcm.py output folder (two experts: both LoRAs), or model "
        "checkpoint (.safetensors/.pt/.pth/diffusers folder)",
    )
    c.add_argument(
        "output",
        help="a .safetensors file (two experts: NAME.safetensors -> NAME_high_noise / NAME_low_noise); "
        "for a model in the diffusers layout, a folder",
    )
    c.add_argument(
        "--format",
        choices=("diffusers", "comfyui", "rcm"),
        required=True,
        help="layout to write; rcm (models only): the official rCM .pt (net.*, Linear patch embedding)",
    )
    c.add_argument("--arch", choices=("wan", "flux"), help="architecture, when the key names do not tell")
    c.add_argument("--config", help="config.json to copy into a diffusers model folder")
    _network(c)
    _overwrite(c)

    e = sub.add_parser("extract", help="LoRA from a fine-tuned checkpoint and its base (truncated SVD)")
    e.add_argument(
        "--finetuned", required=True, help="fine-tuned model: file (.safetensors/.pt/.pth) or diffusers folder"
    )
    e.add_argument("--base", required=True, help="the model it was fine-tuned from (file or diffusers folder)")
    e.add_argument("--output", required=True, help="LoRA file to write (.safetensors)")
    g = e.add_mutually_exclusive_group(required=True)
    g.add_argument("--rank", type=int, help="LoRA rank per layer (>= 1)")
    g.add_argument("--energy", type=float, help="keep this fraction of sum S^2 per layer, e.g. 0.99")
    e.add_argument("--max-rank", type=int, help="cap on the energy-chosen rank (>= 1)")
    e.add_argument("--format", choices=("diffusers", "comfyui"), default="comfyui", help="layout of the LoRA file")
    e.add_argument(
        "--nonlinear",
        choices=("keep", "drop"),
        default="keep",
        help="non-2-D deltas (biases, norms, modulation): keep as full .diff/.diff_b, or drop",
    )
    e.add_argument("--arch", choices=("wan", "flux"), help="architecture, when the key names do not tell")
    e.add_argument("--base-model", default=None, help="base model id stored in the metadata")
    e.add_argument("--report", help="write the per-layer report (JSON) here")
    e.add_argument("--ema", action="store_true", help="same as --network ema (the default)")
    _network(e)
    _overwrite(e)

    m = sub.add_parser("merge", help="base + weight * LoRA -> diffusers folder or ComfyUI file")
    m.add_argument("--base", required=True, help="model checkpoint file or diffusers model folder")
    m.add_argument("--lora", required=True, help="LoRA file (any supported layout)")
    m.add_argument("--weight", type=float, default=1.0, help="LoRA strength w (finite)")
    m.add_argument("--output", required=True, help="a .safetensors file (comfyui) or a folder (diffusers)")
    m.add_argument(
        "--layout",
        choices=("diffusers", "comfyui", "rcm"),
        default="comfyui",
        help="comfyui: one .safetensors in original names; diffusers: a model folder; "
        "rcm: the official rCM .pt (net.*, Linear patch embedding; held in memory)",
    )
    m.add_argument("--config", help="config.json to copy into a diffusers folder")
    m.add_argument("--skip-missing", action="store_true", help="skip (and list) LoRA layers absent from the base")
    _network(m)
    _overwrite(m)

    t = sub.add_parser("transfer", help="base + weight * (finetuned - finetuned_base), e.g. T2V rCM -> I2V")
    t.add_argument("--base", required=True, help="model to add the delta to (file or diffusers folder)")
    t.add_argument("--finetuned", required=True, help="fine-tuned model, e.g. the rCM T2V checkpoint")
    t.add_argument("--finetuned-base", required=True, help="the model it was fine-tuned from")
    t.add_argument("--weight", type=float, default=1.0, help="delta strength w (finite)")
    t.add_argument("--output", required=True, help="a .safetensors file (comfyui) or a folder (diffusers)")
    t.add_argument(
        "--layout",
        choices=("diffusers", "comfyui", "rcm"),
        default="comfyui",
        help="comfyui: one .safetensors in original names; diffusers: a model folder; "
        "rcm: the official rCM .pt (net.*, Linear patch embedding; held in memory)",
    )
    t.add_argument("--config", help="config.json to copy into a diffusers folder")
    _overwrite(t)

    i = sub.add_parser("inspect", help="print a LoRA or checkpoint's layout, architecture, dtypes and metadata")
    i.add_argument("input", help=".safetensors, .pt/.pth file or diffusers model folder")
    _network(i)
    return p


def _network(p) -> None:
    p.add_argument(
        "--network",
        choices=("ema", "net", "fake_score"),
        default=None,
        help="which network of an official rCM training dump (net./net_ema./net_fake_score.) to take; default ema",
    )


def _overwrite(p) -> None:
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing output (never one of the inputs: that is always refused)",
    )


def _check_output(out, inputs, overwrite: bool) -> None:
    """Refuse to write ``out`` over an input (always: the same file, a folder holding an input, or an existing file
    inside an input folder) or over an existing file or non-empty folder (unless ``overwrite``), before any work."""
    po = Path(out).resolve()
    for i in inputs:
        if i is None:
            continue
        pi = Path(i).resolve()
        if po == pi or po in pi.parents or (pi.is_dir() and pi in po.parents and po.exists()):
            raise ValueError(
                f"{out} would write over the input {i}; choose another output (inputs are never overwritten)"
            )
    if po.exists() and not (po.is_dir() and not any(po.iterdir())) and not overwrite:
        raise ValueError(f"{out} already exists; pass --overwrite to replace it, or choose another output")


def _cmd_convert(a) -> int:
    from .checkpoint import CheckpointReader
    from .describe import _is_lora
    from .io import check_lora, load_comfyui_as_is, load_lora, save_lora
    from .keys import detect_arch
    from .pipeline import WEIGHT_NAME, expert_lora_files

    if (
        Path(a.input).is_dir() and (Path(a.input) / WEIGHT_NAME).is_file()
    ):  # a training/rcm.py output folder (or its ema/)
        files = expert_lora_files(a.input)
        if len(files) == 1:
            a.input = files["transformer"]
        else:  # two experts: one file each, named as ComfyUI's Wan 2.2 files are (high_noise / low_noise)
            if not a.output.endswith(".safetensors"):
                raise ValueError(
                    f"{a.input} holds a LoRA per expert: give OUTPUT as NAME.safetensors; "
                    "NAME_high_noise.safetensors and NAME_low_noise.safetensors are written"
                )
            stem = a.output[: -len(".safetensors")]
            for tag in ("high_noise", "low_noise"):
                _check_output(f"{stem}_{tag}.safetensors", [a.input], a.overwrite)
            for component, tag in (("transformer", "high_noise"), ("transformer_2", "low_noise")):
                a.input, a.output = files[component], f"{stem}_{tag}.safetensors"
                _cmd_convert(a)
            return 0

    _check_output(a.output, [a.input], a.overwrite)
    reader = CheckpointReader(a.input, a.network)
    if a.format == "rcm" and _is_lora(reader.raw_keys()):
        raise ValueError("--format rcm writes model checkpoints; a LoRA converts to diffusers or comfyui")
    if not _is_lora(reader.raw_keys()):
        from .merge import convert_checkpoint

        _report_reader(a.input, a.network)
        out = convert_checkpoint(reader, a.output, a.format, config=_load_config(a.config), arch=a.arch)
        print(f"wrote {out}: model checkpoint, {len(reader)} tensors ({a.format})")
        return 0

    as_is = load_comfyui_as_is(a.input) if a.arch is None else None
    if as_is is not None:  # Qwen-Image, FLUX.2 (diffusers names as they are), HunyuanVideo-1.5 (ComfyUI's names)
        return _convert_as_is(a, *as_is)
    sd, meta = load_lora(a.input, arch=a.arch)
    # the check inspect warns about and merge refuses (rank >= 1, matching factors, finite values), plus the shapes
    # against the target architecture where it is known: a LoRA that fails it is not written
    check_lora(sd, f"{a.input} (nothing was written)", arch=a.arch or detect_arch(sd))
    info = save_lora(
        a.output,
        sd,
        a.arch,
        format=a.format,
        metadata={k: v for k, v in meta.items() if k in ("base_model", "made_by")},
    )
    print(
        f"wrote {a.output}: {info['n_lora_modules']} LoRA modules, {info['n_full_deltas']} full deltas "
        f"({a.format}); not applied by the target loader: {len(info['not_applied'])}"
    )
    return 0


FAMILY_NAMES = {"qwen_image": "Qwen-Image", "flux2": "FLUX.2", "hunyuan_video15": "HunyuanVideo-1.5"}
#: what the ComfyUI file of each family holds (the convert message)
COMFYUI_NAMES = {
    "qwen_image": "the transformer.* names stock ComfyUI maps, with .alpha",
    "flux2": "the transformer.* names stock ComfyUI maps, with .alpha",
    "hunyuan_video15": "the diffusion_model.* names of ComfyUI's model, q/k/v fused, with .alpha",
}


def _convert_as_is(a, family: str, sd: dict, meta: dict) -> int:
    """A Qwen-Image / FLUX.2 LoRA: ComfyUI's file keeps the diffusers names (``transformer.``), adds ``.alpha``; a
    HunyuanVideo-1.5 LoRA: ComfyUI's model names (``diffusion_model.``, q/k/v fused), with ``.alpha``."""
    from .io import METADATA_KEY, atomic_save_safetensors, check_lora

    name = FAMILY_NAMES[family]
    if a.format != "comfyui" and family == "hunyuan_video15":
        raise ValueError(
            f"{a.input} is a HunyuanVideo-1.5 LoRA: rcm-lora converts it to ComfyUI's names only (--format comfyui); "
            "the diffusers pipeline loads the trainer's file as it is"
        )
    if a.format != "comfyui":
        raise ValueError(
            f"{a.input} is a {name} LoRA in diffusers names already: the diffusers pipeline loads it as it is "
            "(--format comfyui writes the file for ComfyUI's LoRA loader)"
        )
    check_lora(sd, f"{a.input} (nothing was written)")
    n = sum(k.endswith(".lora_A.weight") for k in sd)
    summary = {"arch": family, "format": "comfyui", "n_lora_modules": n, "n_full_deltas": 0, "not_applied": []}
    summary.update({k: v for k, v in meta.items() if k in ("base_model", "made_by")})
    atomic_save_safetensors(sd, a.output, {"format": "pt", METADATA_KEY: json.dumps(summary, sort_keys=True)})
    print(
        f"wrote {a.output}: {n} LoRA modules, 0 full deltas ({a.format}; {name}: {COMFYUI_NAMES[family]}); "
        "not applied by the target loader: 0"
    )
    return 0


def _cmd_extract(a) -> int:
    from .extract import extract_lora, report_table
    from .io import save_lora
    from .keys import lora_modules

    _check_output(a.output, [a.finetuned, a.base], a.overwrite)
    if a.report:
        _check_output(a.report, [a.finetuned, a.base], a.overwrite)
    _report_reader(a.finetuned, a.network or ("ema" if a.ema else None))
    t0 = time.perf_counter()
    sd, report = extract_lora(
        a.finetuned,
        a.base,
        rank=a.rank,
        energy=a.energy,
        max_rank=a.max_rank,
        nonlinear=a.nonlinear,
        prefer=a.network or ("ema" if a.ema else None),
    )
    dt = time.perf_counter() - t0
    how = {
        "made_by": f"rcm-lora extract rank={a.rank} energy={a.energy} max_rank={a.max_rank}",
        "base_model": a.base_model or str(a.base),
        "finetuned": str(a.finetuned),
    }
    info = save_lora(a.output, sd, a.arch, format=a.format, metadata=how)
    lora = [r for r in report if r.kind == "lora"]
    worst = max(lora, key=lambda r: r.rel_error) if lora else None
    print(
        f"extracted {len(lora)} LoRA layers in {dt:.1f}s; "
        + (f"worst relative error {worst.rel_error:.3g} ({worst.name}, rank {worst.rank}); " if worst else "")
        + f"{sum(r.kind in ('diff', 'diff_b') for r in report)} full deltas, "
        + f"{sum(r.kind == 'dropped' for r in report)} dropped, {sum(r.kind == 'zero' for r in report)} unchanged; "
        + f"not applied by the target loader: {info['not_applied'][:5]}"
    )
    if a.report:
        Path(a.report).write_text(json.dumps(report_table(report), indent=1))
    _warn_stock_diffusers_drops(a.output, "lora_A.weight" in lora_modules(sd).get("patch_embedding", {}))
    return 0


def _warn_stock_diffusers_drops(path, patch_embedding_pair: bool) -> None:
    """One warning line (stderr) when the written LoRA file holds deltas that stock diffusers' ``load_lora_weights``
    drops with no more than an INFO log, naming them and what keeps them. ``patch_embedding_pair``: the extracted
    patch-embedding delta is a LoRA pair (official rCM Linear form), which ``--format diffusers`` keeps as peft's
    Conv3d LoRA; a ComfyUI file holds it as a full ``.diff``."""
    from safetensors import safe_open

    from .io import dropped_by_stock_diffusers

    with safe_open(str(path), "pt") as f:
        size = {k: math.prod(f.get_slice(k).get_shape()) for k in dropped_by_stock_diffusers(f.keys())}
    if not size:
        return
    dropped = [k.removeprefix("diffusion_model.") for k in sorted(size, key=lambda k: (-size[k], k))]  # largest first
    shown = ", ".join(dropped[:5]) + (f" (+{len(dropped) - 5} more)" if len(dropped) > 5 else "")
    keeps = (
        "--format diffusers keeps the patch embedding's (as a LoRA pair), "
        if (patch_embedding_pair and "patch_embedding.diff" in dropped)
        else ""
    )
    print(
        f"rcm-lora extract: warning: stock diffusers (pipe.load_lora_weights) drops {len(dropped)} full delta(s) of "
        f'{path} with no more than an INFO log: {shown}; {keeps}rcm_diffusers.load_full_lora(pipe, "{path}") '
        "applies every delta of the file",
        file=sys.stderr,
    )


def _load_config(path):
    return json.loads(Path(path).read_text()) if path else None


def _report_reader(path, prefer) -> None:
    """One line naming what was taken from an outside checkpoint (network, keys set aside, dequantized)."""
    from .checkpoint import CheckpointReader

    info = CheckpointReader(path, prefer).info
    notes = []
    if "network" in info:
        notes.append(f"took the {info['network']!r} network of {info['networks']}")
    if info.get("set_aside"):
        notes.append(
            f"set aside {len(info['set_aside'])} sparse-linear-attention key(s) that a diffusers/ComfyUI "
            f"Wan has no layer for (e.g. {info['set_aside'][0]})"
        )
    if info.get("dequantized_int8"):
        notes.append(f"dequantized {info['dequantized_int8']} int8 Linear(s)")
    if notes:
        print(f"{path}: " + "; ".join(notes))


def _cmd_merge(a) -> int:
    from .io import load_lora
    from .merge import merge_lora_to

    _check_output(a.output, [a.base, a.lora], a.overwrite)
    _report_reader(a.base, a.network)
    lora, _ = load_lora(a.lora)
    out, skipped = merge_lora_to(
        a.output,
        a.base,
        lora,
        a.weight,
        a.layout,
        on_missing="skip" if a.skip_missing else "error",
        config=_load_config(a.config),
        prefer=a.network,
    )
    print(f"wrote {out} ({a.layout}); skipped: {skipped}")
    return 0


def _cmd_transfer(a) -> int:
    from .merge import merge_delta_to

    _check_output(a.output, [a.base, a.finetuned, a.finetuned_base], a.overwrite)
    for p in (a.base, a.finetuned, a.finetuned_base):
        _report_reader(p, None)
    out, untouched = merge_delta_to(
        a.output, a.base, a.finetuned, a.finetuned_base, a.weight, a.layout, config=_load_config(a.config)
    )
    print(f"wrote {out} ({a.layout}); {len(untouched)} base parameters untouched: {untouched[:10]}")
    return 0


def _cmd_inspect(a) -> int:
    from .describe import inspect_file

    info = inspect_file(a.input, prefer=a.network)
    print(json.dumps(info, indent=1, default=str))
    for p in info.get("problems", []):
        print(f"rcm-lora inspect: warning: {a.input}: {p}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``rcm-lora``; returns the exit status (2 with a one-line message on bad input)."""
    a = _parser().parse_args(argv)
    cmd = {
        "convert": _cmd_convert,
        "extract": _cmd_extract,
        "merge": _cmd_merge,
        "transfer": _cmd_transfer,
        "inspect": _cmd_inspect,
    }[a.cmd]
    try:
        return cmd(a)
    except (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as e:
        print(f"rcm-lora {a.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
