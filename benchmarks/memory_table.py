"""The memory-model table of docs/benchmarks.md ("Memory model"): rcm_diffusers.distill.memory.predict_training for
Wan2.1-1.3B / 14B, Wan2.2-A14B (one expert, and both in one run), FLUX.1-dev at their training shapes, LoRA vs full three-network mode,
the batch x LoRA-rank dependence for Wan2.1-14B 480p, what fits one 24 GB / 48 GB card under each checkpointing policy,
and 8 x 80 GB with FSDP2 and Ulysses context parallelism 1/2/4/8 for the 14B models at 480p/720p x 81 frames against a
72 GiB per-rank budget, with full and selective gradient checkpointing (GC) and without. Prints markdown; CPU, seconds.

    python benchmarks/memory_table.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rcm_diffusers.distill.memory import GiB, TrainSetup, fits, per_rank, predict_training  # noqa: E402


def g(x) -> str:
    return f"{x / GiB:.1f}"


def main() -> None:
    rows = [("Wan2.1-T2V-1.3B", "wan2.1-t2v-1.3b", "480p x 81", 21*30*52, 512),
            ("Wan2.1-T2V-14B", "wan2.1-t2v-14b", "480p x 81", 21*30*52, 512),
            ("Wan2.1-T2V-14B", "wan2.1-t2v-14b", "720p x 81", 21*45*80, 512),
            ("Wan2.2-I2V-A14B (one expert per run)", "wan2.2-i2v-a14b", "720p x 81", 21*45*80, 512),
            ("Wan2.2-I2V-A14B (both experts in one run)", "wan2.2-i2v-a14b", "480p x 81", 21*30*52, 512),
            ("Wan2.2-I2V-A14B (both experts in one run)", "wan2.2-i2v-a14b", "720p x 81", 21*45*80, 512),
            ("FLUX.1-dev", "flux.1-dev", "1024 x 1024", 64*64, 512)]
    print("| model | shape (tokens) | mode | weights | trainable + grads + AdamW + EMA | activations (GC full / selective / off) | JVP | total GC full (selective; off), GiB | 8-GPU FSDP2 per rank (GC full) | H200 141 GB | 80 GB | 48 GB | 24 GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, arch, res, tok, txt in rows:
        for mode in ("shared", "full"):
            s = TrainSetup.from_arch(arch, tokens=tok, text_tokens=txt, lora_rank=64, mode=mode, gradient_checkpointing=True,
                                     experts=2 if "both experts" in label else 1)
            on = predict_training(s)
            if s.family == "wan":
                s.checkpointing_policy = "selective"
                sel = predict_training(s)
                s.checkpointing_policy = "full"
            else:  # the selective term is modelled for Wan only
                sel = None
            s.gradient_checkpointing = False
            off = predict_training(s)
            tr = on["trainable"] + on["grads"] + on["optimizer"] + on["ema"]
            if mode == "shared":
                per8 = on["total"] - on["weights"] * 7 / 8
            else:  # official: everything sharded
                per8 = on["total"] - (on["weights"] + tr) * 7 / 8
            f = fits(on["total"])
            per8 = g(per8)  # two experts: both bases sharded (each rank runs both experts in every call under FSDP2)
            yes = lambda b: "yes" if b else "no"
            sa, st = (g(sel["activations"]), g(sel["total"])) if sel else ("-", "-")
            print(f"| {label} | {res} ({tok}) | {'LoRA r64, shared base' if mode=='shared' else 'full, 3 networks'} | {g(on['weights'])} | {g(tr)} | {g(on['activations'])} / {sa} / {g(off['activations'])} | {g(on['jvp'])} | {g(on['total'])} ({st}; {g(off['total'])}) | {per8} | {yes(f['H200 (141 GB)'])} | {yes(f['80 GB (A100/H100)'])} | {yes(f['48 GB (L40S / RTX 6000 Ada)'])} | {yes(f['24 GB (RTX 4090)'])} |")
    print()
    print("| Wan2.1-T2V-14B 480p x 81, shared LoRA, GC on | rank 16 | rank 64 | rank 256 |")
    print("|---|---|---|---|")
    for b in (1, 2, 4):
        cells = []
        for r in (16, 64, 256):
            s = TrainSetup.from_arch("wan2.1-t2v-14b", tokens=21*30*52, text_tokens=512, lora_rank=r, batch=b)
            cells.append(g(predict_training(s)["total"]))
        print(f"| batch {b} | " + " | ".join(cells) + " |")
    print()
    print("One card, shared LoRA r64, bf16, fd_type 0, batch 1: total GiB per checkpointing policy; fits = total <= 90% of the card")
    print()
    print("| model | shape (tokens) | GC off | GC full | GC selective | 24 GB: off / full / selective | 48 GB: off / full / selective |")
    print("|---|---|---|---|---|---|---|")
    for label, arch, res, tok in (("Wan2.1-T2V-1.3B", "wan2.1-t2v-1.3b", "480p x 33", 9*30*52), ("Wan2.1-T2V-1.3B", "wan2.1-t2v-1.3b", "480p x 81", 21*30*52),
                                  ("Wan2.1-T2V-1.3B", "wan2.1-t2v-1.3b", "720p x 81", 21*45*80), ("Wan2.1-T2V-14B", "wan2.1-t2v-14b", "480p x 33", 9*30*52),
                                  ("Wan2.1-T2V-14B", "wan2.1-t2v-14b", "480p x 81", 21*30*52)):
        tot = {}
        for pol in ("off", "full", "selective"):
            s = TrainSetup.from_arch(arch, tokens=tok, text_tokens=512, lora_rank=64, gradient_checkpointing=pol != "off",
                                     checkpointing_policy="full" if pol == "off" else pol)
            tot[pol] = predict_training(s)["total"]
        fit = {pol: fits(t) for pol, t in tot.items()}
        cells = [" / ".join("yes" if fit[p][card] else "no" for p in ("off", "full", "selective"))
                 for card in ("24 GB (RTX 4090)", "48 GB (L40S / RTX 6000 Ada)")]
        print(f"| {label} | {res} ({tok}) | {g(tot['off'])} | {g(tot['full'])} | {g(tot['selective'])} | " + " | ".join(cells) + " |")
    print()
    print("8 x 80 GB, FSDP2 (frozen base sharded over 8 ranks), shared LoRA r64, bf16, fd_type 0, batch 1 per CP group; "
          "GiB per rank, budget 72 GiB")
    print()
    print("| model | shape (tokens) | CP | tokens per rank | activations GC full | total GC full | <= 72 GiB | activations GC selective | total GC selective | <= 72 GiB | activations GC off | total GC off | <= 72 GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, arch, experts in (("Wan2.1-T2V-14B", "wan2.1-t2v-14b", 1), ("Wan2.2-I2V-A14B (one expert per run)", "wan2.2-i2v-a14b", 1),
                                 ("Wan2.2-I2V-A14B (both experts in one run)", "wan2.2-i2v-a14b", 2)):
        for res, tok in (("480p x 81", 21*30*52), ("720p x 81", 21*45*80)):
            for cp in (1, 2, 4, 8):
                cells = []
                for gc in ("full", "selective", None):
                    s = TrainSetup.from_arch(arch, tokens=tok, text_tokens=512, lora_rank=64, gradient_checkpointing=gc is not None,
                                             checkpointing_policy=gc or "full", context_parallel=cp, experts=experts)
                    p = per_rank(s, 8)
                    cells += [g(p["activations"]), g(p["total"]), "yes" if p["total_gib"] <= 72 else "no"]
                print(f"| {label} | {res} ({tok}) | {cp} | {-(-tok // cp)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
