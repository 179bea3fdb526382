"""Peak memory of streamed ``rcm-lora merge`` / ``transfer`` on a synthetic 14B-shaped bf16 checkpoint.

Wan2.1-14B layer shapes (dim 5120, ffn 13824, original/ComfyUI names), ``--blocks`` blocks in one
bf16 .safetensors file (3 blocks ~ 2.1 GB, 4 ~ 2.8 GB), written tensor by tensor. Each
measurement runs in a fresh Python process and reports its peak resident set (ru_maxrss), next
to the file size ("one shard" here = the whole file). Peak *anonymous* RSS (sampled from
/proc/self/status every 20 ms) is the memory the process allocates; peak total RSS (VmRSS, and
ru_maxrss) also counts file-backed pages: torch's shared libraries and any mmap'ed file data.

    python benchmarks/lora_merge_memory.py [--blocks 3] [--rank 32] [--dir /tmp/rcm-mem]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

DIM, FFN = 5120, 13824

CHILD = r"""
import resource, sys, threading, time, torch
torch.set_num_threads(1)
from rcm_diffusers.lora import merge
from safetensors.torch import load_file
peak = {"RssAnon": 0, "RssFile": 0, "VmRSS": 0}
def status():
    with open("/proc/self/status") as f:
        return {l.split(":")[0]: int(l.split()[1]) for l in f if l.startswith(tuple(peak))}
def sample():
    while True:
        for k, v in status().items():
            peak[k] = max(peak[k], v)
        time.sleep(0.02)
threading.Thread(target=sample, daemon=True).start()
time.sleep(0.1)
base_anon = status()["RssAnon"]
d, what = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
if what == "merge":
    lora = load_file(f"{d}/lora.safetensors")
    merge.merge_lora_to(f"{d}/out.safetensors", f"{d}/base.safetensors", lora, 0.8, progress=False)
elif what == "merge-diffusers":
    lora = load_file(f"{d}/lora.safetensors")
    merge.merge_lora_to(f"{d}/out_dir", f"{d}/base.safetensors", lora, 0.8, layout="diffusers",
                        max_shard_size=1 << 30, progress=False)
else:
    merge.merge_delta_to(f"{d}/out.safetensors", f"{d}/base.safetensors", f"{d}/ft.safetensors",
                         f"{d}/base.safetensors", 0.5, progress=False)
dt = time.perf_counter() - t0
time.sleep(0.1)
print(base_anon, peak["RssAnon"], peak["VmRSS"], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, f"{dt:.1f}")
"""


def shapes(blocks: int) -> dict[str, tuple]:
    out = {"patch_embedding.weight": (DIM, 16, 1, 2, 2), "patch_embedding.bias": (DIM,)}
    for b in range(blocks):
        for a in ("self_attn", "cross_attn"):
            for n in "qkvo":
                out[f"blocks.{b}.{a}.{n}.weight"] = (DIM, DIM)
                out[f"blocks.{b}.{a}.{n}.bias"] = (DIM,)
        out[f"blocks.{b}.ffn.0.weight"], out[f"blocks.{b}.ffn.0.bias"] = (FFN, DIM), (FFN,)
        out[f"blocks.{b}.ffn.2.weight"], out[f"blocks.{b}.ffn.2.bias"] = (DIM, FFN), (DIM,)
        out[f"blocks.{b}.modulation"] = (1, 6, DIM)
    out["head.head.weight"], out["head.head.bias"] = (64, DIM), (64,)
    out["head.modulation"] = (1, 2, DIM)
    return out


def write(path, shp, seed, bump=0.0):
    import torch

    from rcm_diffusers.lora.io import stream_safetensors

    g = torch.Generator().manual_seed(seed)
    specs = [(k, s, torch.bfloat16) for k, s in shp.items()]

    def gen():
        g2 = torch.Generator().manual_seed(seed + 1)
        for k, s in shp.items():
            t = torch.randn(s, generator=g) * 0.02
            if bump:
                t = t + bump * torch.randn(s, generator=g2)
            yield k, t.to(torch.bfloat16)

    stream_safetensors(path, specs, gen())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=3, help="14B-shaped transformer blocks (0.7 GB bf16 each)")
    ap.add_argument("--rank", type=int, default=32, help="rank of the synthetic LoRA on every block Linear")
    ap.add_argument("--dir", default=None, help="scratch folder (default: a temp folder, removed after)")
    args = ap.parse_args()
    import torch
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        shp = shapes(args.blocks)
        write(f"{d}/base.safetensors", shp, 0)
        write(f"{d}/ft.safetensors", shp, 0, bump=1e-3)
        g = torch.Generator().manual_seed(9)
        lora = {}
        for k, s in shp.items():
            if k.startswith("blocks.") and k.endswith(".weight") and len(s) == 2:
                m = "diffusion_model." + k[: -len(".weight")]
                lora[f"{m}.lora_down.weight"] = (torch.randn(args.rank, s[1], generator=g) * 0.01).bfloat16()
                lora[f"{m}.lora_up.weight"] = (torch.randn(s[0], args.rank, generator=g) * 0.01).bfloat16()
                lora[f"{m}.alpha"] = torch.tensor(float(args.rank))
        save_file(lora, f"{d}/lora.safetensors")
        gb = os.path.getsize(f"{d}/base.safetensors") / 2**30
        print(
            f"base file: {gb:.2f} GiB bf16, {len(shp)} tensors, largest {FFN}x{DIM}; LoRA rank {args.rank} "
            f"({os.path.getsize(f'{d}/lora.safetensors') / 2**20:.0f} MiB)"
        )
        print("| command | peak anonymous RSS | of which above imports | / file size | peak total RSS | time |")
        print("|---|---:|---:|---:|---:|---:|")
        for what in ("merge", "merge-diffusers", "transfer"):
            r = subprocess.run(
                [sys.executable, "-c", CHILD, d, what],
                capture_output=True,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            if r.returncode:
                sys.exit(r.stderr)
            base_kb, anon_kb, rss_kb, maxrss_kb, dt = r.stdout.split()
            anon, base = int(anon_kb) / 2**20, int(base_kb) / 2**20
            rss = max(int(rss_kb), int(maxrss_kb)) / 2**20
            print(f"| {what} | {anon:.2f} GiB | {anon - base:.2f} GiB | {anon / gb:.2f}x | {rss:.2f} GiB | {dt} s |")
            for f in ("out.safetensors",):
                if os.path.exists(f"{d}/{f}"):
                    os.unlink(f"{d}/{f}")
        time.sleep(0)


if __name__ == "__main__":
    main()
