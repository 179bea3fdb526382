"""``rcm-lora`` command line: convert, extract, merge, transfer, inspect."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rcm-lora", description="LoRA and checkpoint tools for Wan / Flux (rCM).")
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("convert", help="rewrite a LoRA in the diffusers or ComfyUI layout")
    c.add_argument("input")
    c.add_argument("output")
    c.add_argument("--format", choices=("diffusers", "comfyui"), required=True)
    c.add_argument("--arch", choices=("wan", "flux"))

    e = sub.add_parser("extract", help="LoRA from a fine-tuned checkpoint and its base (truncated SVD)")
    e.add_argument("--finetuned", required=True)
    e.add_argument("--base", required=True)
    e.add_argument("--output", required=True)
    g = e.add_mutually_exclusive_group(required=True)
    g.add_argument("--rank", type=int)
    g.add_argument("--energy", type=float, help="keep this fraction of sum S^2 per layer, e.g. 0.99")
    e.add_argument("--max-rank", type=int)
    e.add_argument("--format", choices=("diffusers", "comfyui"), default="comfyui")
    e.add_argument("--nonlinear", choices=("keep", "drop"), default="keep")
    e.add_argument("--arch", choices=("wan", "flux"))
    e.add_argument("--base-model", default=None, help="base model id stored in the metadata")
    e.add_argument("--report", help="write the per-layer report (JSON) here")
    e.add_argument("--ema", action="store_true", help="take the 'ema' weights of nested checkpoints")

    m = sub.add_parser("merge", help="base + weight * LoRA -> diffusers folder or ComfyUI file")
    m.add_argument("--base", required=True)
    m.add_argument("--lora", required=True)
    m.add_argument("--weight", type=float, default=1.0)
    m.add_argument("--output", required=True)
    m.add_argument("--layout", choices=("diffusers", "comfyui"), default="comfyui")
    m.add_argument("--config", help="config.json to copy into a diffusers folder")
    m.add_argument("--skip-missing", action="store_true", help="skip (and list) LoRA layers absent from the base")

    t = sub.add_parser("transfer", help="base + weight * (finetuned - finetuned_base), e.g. T2V rCM -> I2V")
    t.add_argument("--base", required=True)
    t.add_argument("--finetuned", required=True)
    t.add_argument("--finetuned-base", required=True)
    t.add_argument("--weight", type=float, default=1.0)
    t.add_argument("--output", required=True)
    t.add_argument("--layout", choices=("diffusers", "comfyui"), default="comfyui")
    t.add_argument("--config")

    i = sub.add_parser("inspect", help="print a LoRA file's layout, architecture and metadata")
    i.add_argument("input")
    return p


def _cmd_convert(a) -> int:
    from .io import load_lora, save_lora

    sd, meta = load_lora(a.input, arch=a.arch)
    info = save_lora(a.output, sd, a.arch, format=a.format, metadata={k: v for k, v in meta.items()
                                                                        if k in ("base_model", "made_by")})
    print(f"wrote {a.output}: {info['n_lora_modules']} LoRA modules, {info['n_full_deltas']} full deltas "
          f"({a.format}); not applied by the target loader: {len(info['not_applied'])}")
    return 0


def _cmd_extract(a) -> int:
    from .extract import extract_lora, report_table
    from .io import save_lora

    t0 = time.perf_counter()
    sd, report = extract_lora(a.finetuned, a.base, rank=a.rank, energy=a.energy, max_rank=a.max_rank,
                              nonlinear=a.nonlinear, prefer="ema" if a.ema else None)
    dt = time.perf_counter() - t0
    how = {"made_by": f"rcm-lora extract rank={a.rank} energy={a.energy} max_rank={a.max_rank}",
           "base_model": a.base_model or str(a.base), "finetuned": str(a.finetuned)}
    info = save_lora(a.output, sd, a.arch, format=a.format, metadata=how)
    lora = [r for r in report if r.kind == "lora"]
    worst = max(lora, key=lambda r: r.rel_error) if lora else None
    print(f"extracted {len(lora)} LoRA layers in {dt:.1f}s; "
          + (f"worst relative error {worst.rel_error:.3g} ({worst.name}, rank {worst.rank}); " if worst else "")
          + f"{sum(r.kind in ('diff', 'diff_b') for r in report)} full deltas, "
          + f"{sum(r.kind == 'dropped' for r in report)} dropped, {sum(r.kind == 'zero' for r in report)} unchanged; "
          + f"not applied by the target loader: {info['not_applied'][:5]}")
    if a.report:
        Path(a.report).write_text(json.dumps(report_table(report), indent=1))
    return 0


def _load_config(path):
    return json.loads(Path(path).read_text()) if path else None


def _cmd_merge(a) -> int:
    from .checkpoint import load_state_dict
    from .io import load_lora
    from .merge import merge_lora, save_model

    base = load_state_dict(a.base)
    lora, _ = load_lora(a.lora)
    merged, skipped = merge_lora(base, lora, a.weight, on_missing="skip" if a.skip_missing else "error")
    save_model(merged, a.output, a.layout, config=_load_config(a.config))
    print(f"wrote {a.output} ({a.layout}); skipped: {skipped}")
    return 0


def _cmd_transfer(a) -> int:
    from .checkpoint import load_state_dict
    from .merge import merge_delta, save_model

    merged, untouched = merge_delta(load_state_dict(a.base), a.finetuned, a.finetuned_base, a.weight)
    save_model(merged, a.output, a.layout, config=_load_config(a.config))
    print(f"wrote {a.output} ({a.layout}); {len(untouched)} base parameters untouched: {untouched[:10]}")
    return 0


def _cmd_inspect(a) -> int:
    from .io import load_lora, read_metadata
    from .keys import detect_arch, detect_format

    from safetensors.torch import load_file

    raw = load_file(a.input)
    print(json.dumps({"layout": detect_format(raw), "arch": detect_arch(raw), "n_tensors": len(raw),
                      "metadata": {k: (json.loads(v) if k == "rcm_lora" else v) for k, v in read_metadata(a.input).items()}},
                     indent=1, default=str))
    load_lora(a.input)  # validates every key
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``rcm-lora``; returns the exit status (2 with a one-line message on bad input)."""
    a = _parser().parse_args(argv)
    cmd = {"convert": _cmd_convert, "extract": _cmd_extract, "merge": _cmd_merge, "transfer": _cmd_transfer,
           "inspect": _cmd_inspect}[a.cmd]
    try:
        return cmd(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"rcm-lora {a.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
