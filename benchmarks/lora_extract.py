"""Time SVD LoRA extraction per GB of fine-tuned checkpoint (streamed, layer by layer).

Synthetic checkpoint with Wan2.1-1.3B layer shapes (dim 1536, ffn 8960), bf16, 5 blocks
(~0.46 GB), fine-tuned = base + 0.01 * noise, plus a modulation delta (non-linear layer).

    python benchmarks/lora_extract.py [--blocks 5] [--rank 64]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from safetensors.torch import save_file

from rcm_diffusers.lora.extract import extract_lora


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=5, help="transformer blocks in the synthetic checkpoint")
    ap.add_argument("--rank", type=int, default=64, help="LoRA rank to extract")
    args = ap.parse_args()
    torch.manual_seed(0)
    base, ft = {}, {}
    for b in range(args.blocks):
        shapes = {f"blocks.{b}.{a}.{n}.weight": (1536, 1536) for a in ("self_attn", "cross_attn") for n in "qkvo"}
        shapes.update({f"blocks.{b}.ffn.0.weight": (8960, 1536), f"blocks.{b}.ffn.2.weight": (1536, 8960)})
        for k, shape in shapes.items():
            w = torch.randn(*shape, dtype=torch.bfloat16)
            base[k], ft[k] = w, (w.float() + 0.01 * torch.randn(*shape)).bfloat16()
        base[f"blocks.{b}.modulation"] = torch.randn(1, 6, 1536, dtype=torch.bfloat16)
        ft[f"blocks.{b}.modulation"] = base[f"blocks.{b}.modulation"] + 1
    with tempfile.TemporaryDirectory() as d:
        save_file(base, f"{d}/base.safetensors")
        save_file(ft, f"{d}/ft.safetensors")
        gb = os.path.getsize(f"{d}/ft.safetensors") / 1e9
        del base, ft
        t0 = time.perf_counter()
        _, report = extract_lora(f"{d}/ft.safetensors", f"{d}/base.safetensors", rank=args.rank)
        dt = time.perf_counter() - t0
    print(
        f"| {gb:.3f} GB bf16 | {len(report)} tensors | rank {args.rank} | {dt:.1f} s | {dt / gb:.0f} s/GB | "
        f"~{dt / gb * 28 / 60:.0f} min for a 14B bf16 delta (28 GB) |"
    )


if __name__ == "__main__":
    main()
