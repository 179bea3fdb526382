"""The memory-model table of docs/benchmarks.md ("Memory model"): rcm_diffusers.distill.memory.predict_training for
Wan2.1-1.3B / 14B, Wan2.2-A14B (one expert, and both in one run), FLUX.1-dev, Qwen-Image, FLUX.2-dev and
HunyuanVideo-1.5 T2V at their training shapes, LoRA vs full three-network mode, the batch x LoRA-rank dependence for
Wan2.1-14B 480p, what fits one 24 GB / 48 GB card under each checkpointing policy, and 8 x 80 GB with FSDP2 and Ulysses
context parallelism 1/2/4/8 for the 14B models at 480p/720p x 81 frames against a 72 GiB per-rank budget, with full and
selective gradient checkpointing (GC) and without; and the cheapest one-card setting (base format, blocks swapped to the
host, activation offload, LoRA rank) that fits a 24 GB or 48 GB card, with its predicted step-time slowdown from host
transfers on PCIe 4.0 x16. Prints markdown; CPU, seconds.

    python benchmarks/memory_table.py            # all tables
    python benchmarks/memory_table.py --one-card # the one-card table only
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rcm_diffusers.distill.memory import (
    CARDS,
    GiB,
    TrainSetup,
    cheapest_fitting,
    fits,
    per_rank,  # noqa: E402
    predict_training,
)


def g(x) -> str:
    return f"{x / GiB:.1f}"


ONE_CARD_MODELS = (
    ("Wan2.1-T2V-1.3B", "wan2.1-t2v-1.3b", 1, 5),
    ("Wan2.1-T2V-14B", "wan2.1-t2v-14b", 1, 10),
    ("Wan2.2-A14B, both experts", "wan2.2-i2v-a14b", 2, 10),
)
ONE_CARD_SHAPES = (("480p x 33", 9 * 30 * 52), ("480p x 81", 21 * 30 * 52), ("720p x 81", 21 * 45 * 80))


def one_card_rows():
    """``(model, shape, tokens, card, best, fp8)`` per row: ``best`` = ``cheapest_fitting`` over the weight_dtype and
    fp8 bases, ``fp8`` = the same restricted to an fp8 base; each ``(setup, prediction, step time)`` or ``None``."""
    for label, arch, experts, freq in ONE_CARD_MODELS:
        for res, tok in ONE_CARD_SHAPES:
            s = TrainSetup.from_arch(
                arch,
                tokens=tok,
                text_tokens=512,
                lora_rank=64,
                experts=experts,
                student_update_freq=freq,
                max_simulation_steps=4,
            )
            for card in CARDS:
                kw = dict(card=card, link="PCIe 4.0 x16", ranks=[64, 32, 16, 8])
                yield (
                    label,
                    res,
                    tok,
                    card,
                    cheapest_fitting(s, CARDS[card]["memory"], formats=["weight_dtype", "fp8"], **kw),
                    cheapest_fitting(s, CARDS[card]["memory"], formats=["fp8"], **kw),
                )


def one_card_table() -> None:
    print(
        "One card: the cheapest setting that fits 90 % of the card (bf16 weights under bf16 autocast, shared LoRA, "
        "fd_type 0, batch 1, GC full, student_update_freq 5 (1.3B) / 10 (14B, A14B), max_simulation_steps 4): "
        "least predicted step time on PCIe 4.0 x16 (25 GB/s), then least host memory; LoRA rank lowered from 64 only "
        "where nothing fits at it"
    )
    print()
    print(
        "| model | shape (tokens) | card | base | blocks on host | activation offload | LoRA rank "
        "| device GiB | host GiB | "
        "slowdown | with an fp8 base: blocks on host, offload, rank, device / host GiB, slowdown |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, res, tok, card, best, fp8 in one_card_rows():
        short = card.split(" (")[0]
        if best is None:
            print(f"| {label} | {res} ({tok}) | {short} | does not fit at rank >= 8 | | | | | | | |")
            continue
        c, p, t = best
        base = "bf16" if c.base_dtype == "weight_dtype" else c.base_dtype
        if fp8 is None:
            alt = "does not fit"
        else:
            f, fp, ft = fp8
            alt = (
                f"{f.blocks_to_swap}, {'yes' if f.activation_offload else 'no'}, r{f.lora_rank}, "
                f"{fp['total'] / GiB:.1f} / {fp['host'] / GiB:.1f}, {ft['slowdown']:.2f}x"
            )
        print(
            f"| {label} | {res} ({tok}) | {short} | {base} | {c.blocks_to_swap} "
            f"| {'yes' if c.activation_offload else 'no'} "
            f"| {c.lora_rank} | {p['total'] / GiB:.1f} | {p['host'] / GiB:.1f} | {t['slowdown']:.2f}x | {alt} |"
        )


def main() -> None:
    if sys.argv[1:] == ["--one-card"]:
        one_card_table()
        return
    rows = [
        ("Wan2.1-T2V-1.3B", "wan2.1-t2v-1.3b", "480p x 81", 21 * 30 * 52, 512),
        ("Wan2.1-T2V-14B", "wan2.1-t2v-14b", "480p x 81", 21 * 30 * 52, 512),
        ("Wan2.1-T2V-14B", "wan2.1-t2v-14b", "720p x 81", 21 * 45 * 80, 512),
        ("Wan2.2-I2V-A14B (one expert per run)", "wan2.2-i2v-a14b", "720p x 81", 21 * 45 * 80, 512),
        ("Wan2.2-I2V-A14B (both experts in one run)", "wan2.2-i2v-a14b", "480p x 81", 21 * 30 * 52, 512),
        ("Wan2.2-I2V-A14B (both experts in one run)", "wan2.2-i2v-a14b", "720p x 81", 21 * 45 * 80, 512),
        ("FLUX.1-dev", "flux.1-dev", "1024 x 1024", 64 * 64, 512),
        ("Qwen-Image", "qwen-image", "1024 x 1024", 64 * 64, 512),
        ("FLUX.2-dev", "flux.2-dev", "1024 x 1024", 64 * 64, 512),
        # context: 1000 Qwen2.5-VL + 256 ByT5 + 729 (masked) image tokens, as HunyuanVideo15Pipeline passes them
        ("HunyuanVideo-1.5 T2V", "hunyuanvideo-1.5-t2v-480p", "480p x 121", 31 * 30 * 53, 1985),
        ("HunyuanVideo-1.5 T2V", "hunyuanvideo-1.5-t2v-480p", "720p x 121", 31 * 45 * 80, 1985),
    ]
    print(
        "| model | shape (tokens) | mode | weights | trainable + grads + AdamW + EMA "
        "| activations (GC full / selective / off) | JVP | total GC full (selective; off), GiB "
        "| 8-GPU FSDP2 per rank (GC full) | H200 141 GB | 80 GB | 48 GB | 24 GB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, arch, res, tok, txt in rows:
        for mode in ("shared", "full"):
            s = TrainSetup.from_arch(
                arch,
                tokens=tok,
                text_tokens=txt,
                lora_rank=64,
                mode=mode,
                gradient_checkpointing=True,
                experts=2 if "both experts" in label else 1,
            )
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
            print(
                f"| {label} | {res} ({tok}) | {'LoRA r64, shared base' if mode == 'shared' else 'full, 3 networks'} "
                f"| {g(on['weights'])} | {g(tr)} | {g(on['activations'])} / {sa} / {g(off['activations'])} "
                f"| {g(on['jvp'])} | {g(on['total'])} ({st}; {g(off['total'])}) | {per8} "
                f"| {yes(f['H200 (141 GB)'])} | {yes(f['80 GB (A100/H100)'])} "
                f"| {yes(f['48 GB (L40S / RTX 6000 Ada)'])} | {yes(f['24 GB (RTX 4090)'])} |"
            )
    print()
    print("| Wan2.1-T2V-14B 480p x 81, shared LoRA, GC on | rank 16 | rank 64 | rank 256 |")
    print("|---|---|---|---|")
    for b in (1, 2, 4):
        cells = []
        for r in (16, 64, 256):
            s = TrainSetup.from_arch("wan2.1-t2v-14b", tokens=21 * 30 * 52, text_tokens=512, lora_rank=r, batch=b)
            cells.append(g(predict_training(s)["total"]))
        print(f"| batch {b} | " + " | ".join(cells) + " |")
    print()
    print(
        "One card, shared LoRA r64, bf16, fd_type 0, batch 1: total GiB per checkpointing policy; "
        "fits = total <= 90% of the card"
    )
    print()
    print(
        "| model | shape (tokens) | GC off | GC full | GC selective "
        "| 24 GB: off / full / selective | 48 GB: off / full / selective |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, arch, res, tok in (
        ("Wan2.1-T2V-1.3B", "wan2.1-t2v-1.3b", "480p x 33", 9 * 30 * 52),
        ("Wan2.1-T2V-1.3B", "wan2.1-t2v-1.3b", "480p x 81", 21 * 30 * 52),
        ("Wan2.1-T2V-1.3B", "wan2.1-t2v-1.3b", "720p x 81", 21 * 45 * 80),
        ("Wan2.1-T2V-14B", "wan2.1-t2v-14b", "480p x 33", 9 * 30 * 52),
        ("Wan2.1-T2V-14B", "wan2.1-t2v-14b", "480p x 81", 21 * 30 * 52),
    ):
        tot = {}
        for pol in ("off", "full", "selective"):
            s = TrainSetup.from_arch(
                arch,
                tokens=tok,
                text_tokens=512,
                lora_rank=64,
                gradient_checkpointing=pol != "off",
                checkpointing_policy="full" if pol == "off" else pol,
            )
            tot[pol] = predict_training(s)["total"]
        fit = {pol: fits(t) for pol, t in tot.items()}
        cells = [
            " / ".join("yes" if fit[p][card] else "no" for p in ("off", "full", "selective"))
            for card in ("24 GB (RTX 4090)", "48 GB (L40S / RTX 6000 Ada)")
        ]
        print(
            f"| {label} | {res} ({tok}) | {g(tot['off'])} | {g(tot['full'])} | {g(tot['selective'])} | "
            + " | ".join(cells)
            + " |"
        )
    print()
    print(
        "8 x 80 GB, FSDP2 (frozen base sharded over 8 ranks), shared LoRA r64, bf16, fd_type 0, batch 1 per CP group; "
        "GiB per rank, budget 72 GiB"
    )
    print()
    print(
        "| model | shape (tokens) | CP | tokens per rank | activations GC full | total GC full | <= 72 GiB "
        "| activations GC selective | total GC selective | <= 72 GiB "
        "| activations GC off | total GC off | <= 72 GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, arch, experts in (
        ("Wan2.1-T2V-14B", "wan2.1-t2v-14b", 1),
        ("Wan2.2-I2V-A14B (one expert per run)", "wan2.2-i2v-a14b", 1),
        ("Wan2.2-I2V-A14B (both experts in one run)", "wan2.2-i2v-a14b", 2),
    ):
        for res, tok in (("480p x 81", 21 * 30 * 52), ("720p x 81", 21 * 45 * 80)):
            for cp in (1, 2, 4, 8):
                cells = []
                for gc in ("full", "selective", None):
                    s = TrainSetup.from_arch(
                        arch,
                        tokens=tok,
                        text_tokens=512,
                        lora_rank=64,
                        gradient_checkpointing=gc is not None,
                        checkpointing_policy=gc or "full",
                        context_parallel=cp,
                        experts=experts,
                    )
                    p = per_rank(s, 8)
                    cells += [g(p["activations"]), g(p["total"]), "yes" if p["total_gib"] <= 72 else "no"]
                print(f"| {label} | {res} ({tok}) | {cp} | {-(-tok // cp)} | " + " | ".join(cells) + " |")
    print()
    one_card_table()


if __name__ == "__main__":
    main()
