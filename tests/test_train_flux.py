"""End-to-end trainer run on a tiny random Flux (CPU, ``accelerate launch`` with one process)."""

import json
import os

import torch
from safetensors.torch import load_file
from train_helpers import REPO, make_dataset, make_tiny_flux, run_trainer

from rcm_diffusers.distill.alternation import plan_step

CONFIG = os.path.join(REPO, "training", "configs", "tiny-flux-test.yaml")


def _flux_latents(pipe_dir, data_dir, lora_dir=None):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(
        pipe_dir, text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None
    )
    if lora_dir:
        pipe.load_lora_weights(lora_dir)
    tab = load_file(os.path.join(data_dir, "tables.safetensors"))
    g = torch.Generator().manual_seed(0)
    return pipe(
        prompt_embeds=tab["prompt_embeds"][:1],
        pooled_prompt_embeds=tab["pooled_prompt_embeds"][:1],
        height=4,
        width=4,
        num_inference_steps=2,
        guidance_scale=1.0,
        generator=g,
        output_type="latent",
    ).images


def test_flux_30_steps_fd0_lora_loads(tmp_path):
    pipe_dir = make_tiny_flux(str(tmp_path / "pipe"))
    data_dir = make_dataset(str(tmp_path / "data"), "flux")
    out = tmp_path / "run"
    # exact JVP (fd_type 0) through the Flux transformer via rcm_diffusers.attention
    run_trainer(
        [
            "--config",
            CONFIG,
            "--pretrained",
            pipe_dir,
            "--data_dir",
            data_dir,
            "--output_dir",
            str(out),
            "--fd_type",
            "0",
        ]
    )
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    want = [plan_step(i, 10, 3, 2) for i in range(30)]
    assert [r["net"] for r in recs] == ["student" if p.student else "fake" for p in want]
    assert all(r["nan_scm"] == 0 and 0 < r["loss_scm"] <= 1 for r in recs if r["net"] == "student")
    sd = load_file(out / "pytorch_lora_weights.safetensors")
    assert any("single_transformer_blocks" in k for k in sd) and any(
        "lora_B" in k and v.abs().max() > 0 for k, v in sd.items()
    )
    base = _flux_latents(pipe_dir, data_dir)
    lora = _flux_latents(pipe_dir, data_dir, str(out))
    assert (lora - base).abs().max() > 1e-4
