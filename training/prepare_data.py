"""Precompute an rCM latent dataset (docs/math.md §8) with a pipeline's own VAE and text encoder.

Real pairs (folder of media + same-stem .txt captions, or a .jsonl/.csv manifest)::

    python training/prepare_data.py --pretrained Wan-AI/Wan2.1-T2V-1.3B-Diffusers --source data/raw \\
        --output_dir data/wan2.1-t2v-480p --height 480 --width 832 --num_frames 81

Synthetic teacher samples (TrigFlow Euler 100 steps at the pipeline's own shift and CFG by default)::

    python training/prepare_data.py --pretrained Wan-AI/Wan2.1-T2V-1.3B-Diffusers --synthetic \\
        --prompts prompts.txt --num_samples 10000 --output_dir data/wan-synthetic \\
        --height 480 --width 832 --num_frames 81

The result is read by ``training/rcm.py --data_dir <output_dir>`` (``rcm_diffusers.distill.data.LatentDataset``).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from rcm_diffusers.distill import prepare as P  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    ap.add_argument(
        "--pretrained",
        required=True,
        help="diffusers pipeline directory or hub id (WanPipeline, WanImageToVideoPipeline, FluxPipeline, "
        "QwenImagePipeline, Flux2Pipeline, HunyuanVideo15Pipeline) whose VAE, text encoder(s) and transformer are used",
    )
    ap.add_argument(
        "--output_dir", required=True, help="directory to write (meta.json, shard-*.safetensors, tables.safetensors)"
    )
    ap.add_argument(
        "--source",
        default="",
        help="real data: a folder of images/videos each with <name>.txt, or a .jsonl/.csv manifest with file and "
        "caption columns (paths relative to it). With --synthetic: prompts (and, for I2V, first-frame images) from "
        "such a folder/manifest",
    )
    ap.add_argument("--prompts", default="", help="--synthetic: a .txt file with one prompt per line (T2V/T2I)")
    ap.add_argument(
        "--synthetic",
        action="store_true",
        help="generate x0 with the teacher (TrigFlow ODE + CFG) instead of encoding media; "
        "each sample's starting noise is stored too, so the dataset also serves as ODE pairs "
        "(rcm.py --regression_data_dir)",
    )
    ap.add_argument(
        "--num_samples",
        type=int,
        default=0,
        help="--synthetic: number of samples; sample i uses prompt i %% P and seed seed+i (default: one per prompt)",
    )
    ap.add_argument(
        "--height", type=int, required=True, help="pixel height; media of another size are an error unless --resize"
    )
    ap.add_argument("--width", type=int, required=True, help="pixel width")
    ap.add_argument(
        "--num_frames",
        type=int,
        default=1,
        help="frames per sample (Wan: 4k+1, e.g. 81; 1 = images); videos are cut to their first num_frames",
    )
    ap.add_argument(
        "--resize",
        default="error",
        choices=["error", "crop", "stretch"],
        help="media of another size: error (default), crop (scale to cover + centre crop) or stretch",
    )
    ap.add_argument(
        "--caption_ext", default=".txt", help="caption file extension next to each media file in a folder source"
    )
    ap.add_argument(
        "--negative_prompt",
        default=None,
        help="negative prompt stored for the teacher's CFG (default: '' for Wan and HunyuanVideo-1.5, none for Flux "
        "and FLUX.2, ' ' for Qwen-Image)",
    )
    ap.add_argument(
        "--no_negative_prompt",
        action="store_true",
        help="store no negative embeddings (the trainer's teacher then runs without CFG)",
    )
    ap.add_argument(
        "--max_sequence_length",
        type=int,
        default=0,
        help="text tokens (0 = 512, what WanPipeline and FluxPipeline pad prompts to when sampling; QwenImagePipeline "
        "cuts them there; HunyuanVideo15Pipeline: its own fixed 1000 + 256, this option is not used)",
    )
    ap.add_argument("--steps", type=int, default=100, help="--synthetic: teacher ODE steps (docs/math.md §8: 100)")
    ap.add_argument(
        "--shift",
        type=float,
        default=None,
        help="--synthetic: flow shift of the teacher grid (default: what the teacher's pipeline uses at this size: "
        "its scheduler's shift, or its resolution-dependent shift under dynamic shifting; docs/math.md §8)",
    )
    ap.add_argument(
        "--guidance_scale",
        type=float,
        default=None,
        help="--synthetic: standard CFG scale s, v_u + s (v_c - v_u); Qwen-Image: its true_cfg_scale, with the "
        "pipeline's norm rescale; 1 = no CFG (default: the pipeline's own: Wan 5, Qwen-Image 4, HunyuanVideo-1.5 "
        "its guider's scale, FLUX.1 / FLUX.2 1)",
    )
    ap.add_argument(
        "--solver",
        default="euler",
        choices=["euler", "unipc"],
        help="--synthetic: TrigFlowEulerScheduler or TrigFlowUniPCScheduler",
    )
    ap.add_argument(
        "--sigma_max",
        type=float,
        default=5000.0,
        help="--synthetic: EDM sigma of the first grid point (r_max = sigma_max / (1 + sigma_max))",
    )
    ap.add_argument(
        "--flux_guidance",
        type=float,
        default=None,
        help="--synthetic, a guidance-distilled teacher: guidance-embedding value (default: the pipeline's default "
        "guidance_scale, 3.5 for FluxPipeline, 4.0 for Flux2Pipeline)",
    )
    ap.add_argument("--seed", type=int, default=0, help="--synthetic: base seed")
    ap.add_argument("--batch_size", type=int, default=4, help="samples per VAE / text-encoder / teacher batch")
    ap.add_argument(
        "--shard_size",
        type=int,
        default=256,
        help="samples per shard file (written as they are encoded; memory stays bounded)",
    )
    ap.add_argument(
        "--save_dtype",
        default="float32",
        choices=sorted(DTYPES),
        help="dtype of the stored latents/embeddings (bfloat16 halves the disk; the trainer casts to float32 on load)",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(DTYPES),
        help="dtype the pipeline is loaded in (bfloat16 for 14B models on GPU)",
    )
    ap.add_argument("--no_progress", action="store_true", help="no tqdm bars")
    a = ap.parse_args(argv)
    if not a.synthetic and not a.source:
        ap.error("give --source (real data) or --synthetic with --prompts/--source")
    if a.synthetic and not (a.prompts or a.source):
        ap.error("--synthetic needs --prompts FILE.txt or --source FOLDER/MANIFEST")
    return a


#: the negative prompt stored when none is given: none for Flux and FLUX.2 (their pipelines sample without CFG); " " for
#: Qwen-Image (QwenImagePipeline's docstring: "even an empty negative prompt like " " should enable classifier-free
#: guidance computations"); "" otherwise (HunyuanVideo15Pipeline: no negative_prompt encodes "")
_DEFAULT_NEGATIVE = {"flux": None, "qwen": " ", "flux2": None}

#: the guidance-embedding value of a guidance-distilled teacher when none is given: its pipeline's default
#: guidance_scale (FluxPipeline 3.5, Flux2Pipeline 4.0)
_DEFAULT_FLUX_GUIDANCE = {"flux": 3.5, "flux2": 4.0}


def main(argv=None):
    a = parse_args(argv)
    from diffusers import DiffusionPipeline

    # read the sources before loading a (possibly 14B) pipeline, so their errors come first
    if a.synthetic and a.prompts:
        prompts, images = P.read_prompts(a.prompts), None
    else:
        items = P.read_items(a.source, a.caption_ext)
        prompts, images = [it.caption for it in items], [it.media for it in items]
    pipe = DiffusionPipeline.from_pretrained(a.pretrained, torch_dtype=DTYPES[a.dtype]).to(a.device)
    enc = P.PipelineEncoder(
        pipe, a.height, a.width, a.num_frames, a.max_sequence_length or None, a.device, DTYPES[a.dtype]
    )
    negative = (
        None
        if a.no_negative_prompt
        else (a.negative_prompt if a.negative_prompt is not None else _DEFAULT_NEGATIVE.get(enc.family, ""))
    )
    common = dict(
        negative_prompt=negative,
        resize=a.resize,
        batch_size=a.batch_size,
        shard_size=a.shard_size,
        save_dtype=DTYPES[a.save_dtype],
        progress=not a.no_progress,
    )
    if a.synthetic:
        chosen = P.synthetic_defaults(enc, a.steps)
        for k in ("shift", "guidance_scale"):
            if getattr(a, k) is None:
                setattr(a, k, chosen[k])
                print(f"--{k} {chosen[k]:g} (the {type(pipe).__name__}'s own at this size)")
        out = P.prepare_synthetic(
            enc,
            prompts,
            a.output_dir,
            num_samples=a.num_samples or len(prompts),
            seed=a.seed,
            steps=a.steps,
            shift=a.shift,
            guidance_scale=a.guidance_scale,
            solver=a.solver,
            sigma_max=a.sigma_max,
            flux_guidance=a.flux_guidance if a.flux_guidance is not None else _DEFAULT_FLUX_GUIDANCE.get(enc.family),
            images=images,
            **common,
        )
    else:
        out = P.prepare_real(enc, items, a.output_dir, **common)
    print(f"wrote {out} ({enc.family}, latents {enc.latent_shape})")


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"prepare_data: {e}")
