"""What one Wan (or Flux) block saves for its backward, per video token and per text token, at real widths, against the
memory model's activation terms (``ACT_COEFFS`` in rcm_diffusers/distill/memory.py).

For each width (heads x 128, FFN width F) and dtype it builds the real Wan block (random weights; in bf16 the modules
``from_pretrained`` keeps in float32 stay float32, under bf16 autocast as the shipped configs), adds the trainer's LoRA
student and fake score and the JVP attention processors, and counts the bytes autograd saves in one student forward
(``saved_activation_bytes``). A block's share is the difference between 2-block and 1-block models; per video token
and per text token are differences over token and text counts, so what lies outside the blocks cancels.

    python benchmarks/activation_terms.py                       # the widths of docs/benchmarks.md
    python benchmarks/activation_terms.py --widths 40:13824 --dtypes bfloat16 --lora_rank 64
    python benchmarks/activation_terms.py --family flux --widths 4,12,24   # Flux double and single blocks (heads)
    python benchmarks/activation_terms.py --family hunyuan15 --widths 2,3,4  # also qwen, flux2
    python benchmarks/activation_terms.py --family hunyuan15 --dense_mask  # diffusers' stock HunyuanVideo-1.5 masks
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from rcm_diffusers.arch import build_transformer  # noqa: E402
from rcm_diffusers.distill.memory import ACT_COEFFS, TrainSetup, _block_bytes, saved_activation_bytes  # noqa: E402


def student_saved_bytes(m, dtype, x, cond, rank: int) -> int:
    """Bytes autograd saves in one forward of ``m``'s LoRA student (the trainer's shared-base networks, rank ``rank``;
    bf16 under bf16 autocast)."""
    from rcm_diffusers.distill.adapters import Networks
    from rcm_diffusers.models import velocity_fn

    nets, _ = Networks.build(m, "shared", with_fake=True, lora_rank=rank, time_input="float")
    v = velocity_fn(m)
    with nets.role("student"), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        return saved_activation_bytes(lambda: v(x, torch.tensor([0.5]), **cond), exclude=m.parameters())


def saved(dtype, layers: int, heads: int, ffn: int, frames: int, text: int, rank: int) -> int:
    """Bytes autograd saves in one student forward of a ``layers``-block Wan (16 x 16 latent, ``frames`` frames), with
    the JVP attention processors the trainer installs."""
    from rcm_diffusers.attention import enable_jvp_attention

    m = build_transformer(
        "wan2.1-t2v-1.3b", dtype=dtype, keep_fp32=True, num_layers=layers, num_attention_heads=heads, ffn_dim=ffn
    )
    enable_jvp_attention(m)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, m.config.in_channels, frames, 16, 16, generator=g).to(dtype)
    cond = {"encoder_hidden_states": torch.randn(1, text, m.config.text_dim, generator=g).to(dtype)}
    return student_saved_bytes(m, dtype, x, cond, rank)


def saved_flux(dtype, double: int, single: int, heads: int, hw: int, text: int, rank: int) -> int:
    """Bytes autograd saves in one student forward of a Flux with ``double`` / ``single`` blocks (``hw`` x ``hw``
    latent)."""
    from rcm_diffusers.distill.data import _flux_img_ids

    m = build_transformer(
        "flux.1-dev",
        dtype=dtype,
        keep_fp32=True,
        num_layers=double,
        num_single_layers=single,
        num_attention_heads=heads,
    )
    cfg, g = m.config, torch.Generator().manual_seed(0)
    x = torch.randn(1, hw * hw // 4, cfg.in_channels, generator=g).to(dtype)
    cond = {
        "encoder_hidden_states": torch.randn(1, text, cfg.joint_attention_dim, generator=g).to(dtype),
        "pooled_projections": torch.randn(1, cfg.pooled_projection_dim, generator=g).to(dtype),
        "txt_ids": torch.zeros(text, 3),
        "img_ids": _flux_img_ids(hw, hw),
        "guidance": torch.full((1,), 3.5),
    }
    return student_saved_bytes(m, dtype, x, cond, rank)


def flux_rows(a) -> None:
    """Per token of either stream, one double and one single block (differences of block counts)."""
    print(
        "| dtype | D | block | per image token: measured / model, bytes | per text token: measured |"
        "\n|---|---|---|---|---|"
    )
    for dt in a.dtypes.split(","):
        dtype = getattr(torch, dt)
        for heads in (int(v) for v in a.widths.split(",")):
            for kind, (one, two) in {"double": ((1, 0), (2, 0)), "single": ((1, 1), (1, 2))}.items():
                blk = {
                    (hw, text): saved_flux(dtype, *two, heads, hw, text, a.lora_rank)
                    - saved_flux(dtype, *one, heads, hw, text, a.lora_rank)
                    for hw, text in ((16, 16), (24, 16), (16, 48))
                }  # 64 / 144 image tokens, 16 / 48 text tokens
                per_img, per_txt = (blk[24, 16] - blk[16, 16]) / 80, (blk[16, 48] - blk[16, 16]) / 32
                s = TrainSetup(
                    family="flux",
                    dim=128 * heads,
                    ffn_dim=4 * 128 * heads,
                    num_layers=1,
                    num_single_layers=0,
                    params=0,
                    lora_params_student=0,
                    lora_params_fake=0,
                    tokens=0,
                    text_tokens=0,
                    weight_dtype=dt,
                    lora_rank=a.lora_rank,
                )
                c = ACT_COEFFS["flux_" + kind]
                model = _block_bytes(c, s, 1, 0) - _block_bytes(c, s, 0, 0)
                print(
                    f"| {dt} | {128 * heads} | {kind} | {per_img:.0f} / {model:.0f} ({per_img / model:.3f}) "
                    f"| {per_txt:.0f} |",
                    flush=True,
                )


#: the newer double-stream families: architecture, and per block kind the (1-block, 2-block) depths whose difference is
#: one block's share (FLUX.2: double / single blocks; HunyuanVideo-1.5: double-stream blocks / token refiner blocks)
NEW_FAMILIES = {
    "qwen": ("qwen-image", {"double": ({"num_layers": 1}, {"num_layers": 2})}),
    "flux2": (
        "flux.2-dev",
        {
            "double": ({"num_layers": 1, "num_single_layers": 0}, {"num_layers": 2, "num_single_layers": 0}),
            "single": ({"num_layers": 1, "num_single_layers": 1}, {"num_layers": 1, "num_single_layers": 2}),
        },
    ),
    "hunyuan15": (
        "hunyuanvideo-1.5-t2v-480p",
        {
            "double": ({"num_layers": 1, "num_refiner_layers": 1}, {"num_layers": 2, "num_refiner_layers": 1}),
            "refiner": ({"num_layers": 1, "num_refiner_layers": 1}, {"num_layers": 1, "num_refiner_layers": 2}),
        },
    ),
}


def saved_new_family(
    family, dtype, overrides, side: int, text: int, rank: int, dense_mask: bool = False
) -> tuple[int, int]:
    """``(bytes saved, tokens of a block's attention)`` in one student forward of a Qwen-Image / FLUX.2 /
    HunyuanVideo-1.5 model (``side`` x ``side`` image tokens, or 1 x ``side`` x 4 video tokens; ``text`` prompt tokens;
    HunyuanVideo-1.5 also 8 ByT5 and the pipeline's 729 masked image tokens, with the trainer's key-padding masks or,
    ``dense_mask``, diffusers' stock processors)."""
    from rcm_diffusers.attention.hunyuan15 import enable_key_padding_mask
    from rcm_diffusers.distill.data import flux2_ids

    arch = NEW_FAMILIES[family][0]
    m = build_transformer(arch, dtype=dtype, keep_fp32=True, **overrides)
    cfg, g = m.config, torch.Generator().manual_seed(0)
    if family == "hunyuan15":
        if not dense_mask:
            enable_key_padding_mask(m)
        x = torch.randn(1, cfg.out_channels, 1, side, 4, generator=g).to(dtype)
        cond = {
            "encoder_hidden_states": torch.randn(1, text, cfg.text_embed_dim, generator=g).to(dtype),
            "encoder_attention_mask": torch.ones(1, text),
            "encoder_hidden_states_2": torch.randn(1, 8, cfg.text_embed_2_dim, generator=g).to(dtype),
            "encoder_attention_mask_2": torch.ones(1, 8),
        }
        return student_saved_bytes(m, dtype, x, cond, rank), 4 * side + text + 8 + 729
    x = torch.randn(1, side * side, cfg.in_channels, generator=g).to(dtype)
    cond = {"encoder_hidden_states": torch.randn(1, text, cfg.joint_attention_dim, generator=g).to(dtype)}
    if family == "qwen":
        cond["img_shapes"] = [[(1, side, side)]]
    else:
        img_ids, txt_ids = flux2_ids(1, side, side, text)
        cond.update(img_ids=img_ids, txt_ids=txt_ids, guidance=torch.full((1,), 4.0))
    return student_saved_bytes(m, dtype, x, cond, rank), side * side + text


def new_family_rows(a) -> None:
    """One block's share (difference of block counts) at two image / video token counts (HunyuanVideo-1.5's refiner:
    two prompt lengths), against ``_block_bytes`` of the family's ``ACT_COEFFS`` at the same tokens."""
    arch, kinds = NEW_FAMILIES[a.family]
    print("| dtype | D | block | tokens | measured / model, bytes |\n|---|---|---|---|---|")
    for dt in a.dtypes.split(","):
        dtype = getattr(torch, dt)
        for heads in (int(v) for v in a.widths.split(",")):
            for kind, (one, two) in kinds.items():
                coeffs = ACT_COEFFS[f"{a.family}_{kind}" + ("_dense_mask" if a.dense_mask else "")]
                for side, text in ((4, 8), (8, 8)) if kind != "refiner" else ((4, 8), (4, 24)):
                    ov = lambda d: dict(d, num_attention_heads=heads)  # noqa: E731
                    big, L = saved_new_family(a.family, dtype, ov(two), side, text, a.lora_rank, a.dense_mask)
                    blk = big - saved_new_family(a.family, dtype, ov(one), side, text, a.lora_rank, a.dense_mask)[0]
                    s = TrainSetup(
                        family=a.family,
                        dim=128 * heads,
                        ffn_dim=4 * 128 * heads,
                        num_layers=1,
                        num_single_layers=0,
                        params=0,
                        lora_params_student=0,
                        lora_params_fake=0,
                        tokens=0,
                        text_tokens=0,
                        weight_dtype=dt,
                        lora_rank=a.lora_rank,
                    )
                    n = text if kind == "refiner" else L
                    model = _block_bytes(coeffs, s, n, 0)
                    print(
                        f"| {dt} | {128 * heads} | {kind} | {n} | {blk} / {model:.0f} ({blk / model:.3f}) |", flush=True
                    )


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--family",
        default="wan",
        choices=["wan", "flux", *NEW_FAMILIES],
        help="Wan blocks, Flux double / single blocks, Qwen-Image double blocks, FLUX.2 double / single blocks or "
        "HunyuanVideo-1.5 double-stream and token refiner blocks",
    )
    p.add_argument(
        "--widths",
        default=None,
        help="Wan: comma-separated HEADS:FFN pairs (width D = 128 x heads; default 4:1024,12:8960,24:8960,40:13824, "
        "12:8960 is Wan2.1-1.3B, 40:13824 the 14B); Flux: comma-separated head counts "
        "(default 4,12,24; 24 is FLUX.1-dev); qwen / flux2 / hunyuan15: head counts (default 2,3,4)",
    )
    p.add_argument("--dtypes", default="bfloat16,float32", help="weight dtypes (bfloat16: under bf16 autocast)")
    p.add_argument("--lora_rank", type=int, default=32, help="LoRA rank of student and fake score")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument(
        "--dense_mask",
        action="store_true",
        help="hunyuan15: diffusers' stock attention processors (dense [B, 1, L, L] masks) instead of the trainer's "
        "key-padding masks, against the *_dense_mask coefficients",
    )
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore", message="There are modules in")
    from diffusers.utils import logging as diffusers_logging

    # the float32-kept modules are cast on purpose, as from_pretrained keeps them
    diffusers_logging.set_verbosity_error()
    if a.family == "flux":
        a.widths = a.widths or "4,12,24"
        return flux_rows(a)
    if a.family in NEW_FAMILIES:
        a.widths = a.widths or "2,3,4"
        return new_family_rows(a)
    a.widths = a.widths or "4:1024,12:8960,24:8960,40:13824"
    print(
        "| dtype | D | F | per video token: measured / model | per text token: measured / model |"
        "\n|---|---|---|---|---|"
    )
    for dt in a.dtypes.split(","):
        dtype = getattr(torch, dt)
        for pair in a.widths.split(","):
            heads, ffn = (int(v) for v in pair.split(":"))
            block = {}
            for frames, text in ((1, 16), (2, 16), (1, 64)):  # 64 / 128 video tokens, 16 / 64 text tokens
                block[frames, text] = saved(dtype, 2, heads, ffn, frames, text, a.lora_rank) - saved(
                    dtype, 1, heads, ffn, frames, text, a.lora_rank
                )
            per_tok = (block[2, 16] - block[1, 16]) / 64
            per_txt = (block[1, 64] - block[1, 16]) / 48
            s = TrainSetup(
                family="wan",
                dim=128 * heads,
                ffn_dim=ffn,
                num_layers=1,
                num_single_layers=0,
                params=0,
                lora_params_student=0,
                lora_params_fake=0,
                tokens=0,
                text_tokens=0,
                weight_dtype=dt,
                lora_rank=a.lora_rank,
            )
            model_tok = _block_bytes(ACT_COEFFS["wan"], s, 1, 0) - _block_bytes(ACT_COEFFS["wan"], s, 0, 0)
            model_txt = _block_bytes(ACT_COEFFS["wan"], s, 0, 1) - _block_bytes(ACT_COEFFS["wan"], s, 0, 0)
            print(
                f"| {dt} | {128 * heads} | {ffn} | {per_tok:.0f} / {model_tok:.0f} ({per_tok / model_tok:.3f}) | "
                f"{per_txt:.0f} / {model_txt:.0f} ({per_txt / model_txt:.3f}) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
