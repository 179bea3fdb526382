"""Wan 2.2 two-expert rCM end to end: our trainer's LoRA pair through ComfyUI's server vs the diffusers path.

Per ComfyUI checkout in ``COMFYUI_PATH`` (see ``test_server.py`` for the server): two tiny random Wan 2.2
I2V A14B-shaped experts (``comfyui_harness.tiny_wan_state_dict(seed, in_dim=36)``: noise + first-frame mask
+ image latents on the channels, no CLIP image branch) in ComfyUI's layout in ``models/diffusion_models``,
and the same weights as a diffusers ``WanImageToVideoPipeline`` folder (``transformer`` = high-noise expert,
``transformer_2`` = low-noise expert, ``boundary_ratio`` 0.9). ``training/rcm.py`` distils both experts in
one run (``--experts both --time_input float``) on a small ``wan_i2v`` latent dataset of the real 16-channel
shape; ``python -m rcm_diffusers.lora convert ... --format comfyui`` writes each expert's LoRA into
``models/loras`` under the names of the shipped editor workflow
``example_workflows/2. Wan 2.2 I2V A14B, two experts, 4 rCM steps.json`` (two ``UNETLoader``, two ``RCMLoraLoader``,
``RCMSigmas`` at sigma_max 200, ``RCMExpertSplit`` at 0.9, ``RCMSampler``, two ``SamplerCustomAdvanced``, the
second with ``DisableNoise``). That workflow is converted to the API prompt the editor sends, shrunk to
64x64x5, with stand-ins (``comfyui_harness.STANDIN_PACK``): the text encoder returns fixed embeddings,
the VAE given to ComfyUI's own ``WanImageToVideo`` encodes to fixed image latents (``LoadImage`` reads a
real PNG), and the VAE decode is replaced by ``SaveLatent``.

The diffusers reference: the pipeline folder with ``load_rcm_lora(pipe, run_dir)``, stepped by
``RCMScheduler(sigma_max=200, time_input="float")``, the expert per step by ``timestep >= 1000 * 0.9``,
the model input ``[x, mask, (image latents - mean) / std]`` as ``WanImageToVideoPipeline`` builds it, and
ComfyUI's noise streams: the initial ``randn`` from the seed; the re-noising draws of the high-noise steps from
a generator seeded ``seed + renoise_seed_offset`` (the first ``SamplerCustomAdvanced``), those of the
low-noise steps from one seeded ``0 + renoise_seed_offset`` (the second runs with ``DisableNoise``, whose
seed is 0).

Measured (12 trainer steps, lr 1e-2, torch 2.13.0+cpu): max|ComfyUI - diffusers| = 8.1e-6 at max|latent| 8.02 on
ComfyUI 0.29.0 (4f874c5) and 7.4e-6 at 7.63 on 0.3.47, against a tolerance of 1e-5 * max|latent| (as
``test_server.py``, which measures 5.8e-6 at 9.3 with one expert). Swapping the two LoRA files between the
experts moves the latent by 1.07 (0.96 on 0.3.47), dropping the LoRAs by 1.00 (0.89): the high-noise steps ran
with the high-noise expert's LoRA, the low-noise steps with the low-noise one's.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from comfyui_harness import (
    REPO,
    SKIP_REASON,
    TEXT_DIM,
    diffusers_wan_from_comfy,
    have_comfyui,
    renoise_seed_offset,
    tiny_wan_state_dict,
    wan_latent_stats,
)
from safetensors.torch import load_file, save_file
from workflow_format import ui_to_api

if os.path.join(REPO, "tests") not in sys.path:  # train_helpers lives one folder up
    sys.path.insert(0, os.path.join(REPO, "tests"))
from train_helpers import run_trainer  # noqa: E402

SEED = 20260730
BOUNDARY = 0.9  # the shipped workflow's RCMExpertSplit, = the pipeline's boundary_ratio
SIGMA_MAX = 200.0  # the shipped workflow's RCMSigmas (Wan I2V)
WIDTH = HEIGHT = 64
LENGTH = 5  # -> latent (1, 16, 2, 8, 8)
LATENT = (16, 2, 8, 8)
TEXT_LEN = 12
HIGH_LORA = "wan2.2_i2v_high_noise_rcm_lora.safetensors"
LOW_LORA = "wan2.2_i2v_low_noise_rcm_lora.safetensors"
HIGH_UNET, LOW_UNET = "tiny_wan22_i2v_high.safetensors", "tiny_wan22_i2v_low.safetensors"
TRAIN_STEPS = 12
# ComfyUI's WanModel vs diffusers' WanTransformer3DModel in float32 over 4 calls of two experts, and the
# latent going through process_latent_out/in and inverse_noise_scaling/noise_scaling between the two
# samplers: round-off of order 1e-6 relative (test_server.py: 5.8e-6 at max|latent| 9.3, one expert).
# A wrong expert, LoRA, noise draw, sigma or mask moves the result by O(0.1 - 1).
TOL_REL = 1e-5


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two tiny experts (ComfyUI files + diffusers pipeline folder), a wan_i2v dataset and our trainer's LoRA pair."""
    if not have_comfyui():
        pytest.skip(SKIP_REASON)
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline

    from rcm_diffusers.distill.data import write_latent_dataset

    root = tmp_path_factory.mktemp("two_experts")
    experts = {"high": tiny_wan_state_dict(seed=11, in_dim=36), "low": tiny_wan_state_dict(seed=12, in_dim=36)}
    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    pipe = WanImageToVideoPipeline(
        tokenizer=None,
        text_encoder=None,
        image_encoder=None,
        image_processor=None,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        transformer=diffusers_wan_from_comfy(experts["high"]),
        transformer_2=diffusers_wan_from_comfy(experts["low"]),
        boundary_ratio=BOUNDARY,
    )
    pipe_dir = str(root / "pipe")
    pipe.save_pretrained(pipe_dir)

    # wan_i2v latents of the real shape: class-dependent means, the condition = first-frame mask (4 channels)
    # + the (normalised) image latents, as WanImageToVideoPipeline builds it
    g = torch.Generator().manual_seed(0)
    n, classes = 8, 2
    label = torch.arange(n) % classes
    lat = torch.randn(classes, *LATENT, generator=g)[label] + 0.3 * torch.randn(n, *LATENT, generator=g)
    mask = torch.zeros(n, 4, *LATENT[1:])
    mask[:, :, 0] = 1.0
    image = lat + 0.1 * torch.randn(n, *LATENT, generator=g)
    tables = {
        "prompt_embeds": 0.5 * torch.randn(classes, TEXT_LEN, TEXT_DIM, generator=g),
        "negative_prompt_embeds": torch.zeros(1, TEXT_LEN, TEXT_DIM),
    }
    data_dir = write_latent_dataset(
        str(root / "data"),
        {"latents": lat, "prompt_index": label, "condition": torch.cat([mask, image], dim=1)},
        family="wan_i2v",
        tables=tables,
        table_index={"prompt_embeds": "prompt_index", "negative_prompt_embeds": None},
    )
    run_dir = root / "run"
    run_trainer(
        [
            "--config",
            os.path.join(REPO, "training", "configs", "tiny-wan-test.yaml"),
            "--pretrained",
            pipe_dir,
            "--data_dir",
            data_dir,
            "--output_dir",
            str(run_dir),
            "--max_steps",
            str(TRAIN_STEPS),
            "--time_input",
            "float",
            "--experts",
            "both",
            "--lr",
            "1e-2",
            "--checkpoint_every",
            "0",
        ],
        timeout=900,
    )
    files = {
        "high": run_dir / "pytorch_lora_weights.safetensors",
        "low": run_dir / "transformer_2" / "pytorch_lora_weights.safetensors",
    }
    comfy_files, lora_b = {}, {}
    for name, f in files.items():
        sd = load_file(f)
        assert sd and all(k.startswith("transformer.") for k in sd), sorted(sd)[:5]
        b = max(v.abs().max().item() for k, v in sd.items() if "lora_B" in k)
        assert b > 0, f"{name}-noise expert LoRA: all lora_B are zero (never trained)"
        lora_b[name] = b
        out = root / f"{name}_comfyui.safetensors"
        p = subprocess.run(
            [sys.executable, "-m", "rcm_diffusers.lora", "convert", str(f), str(out), "--format", "comfyui"],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": REPO},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
        comfy_files[name] = str(out)
    # the ComfyUI inputs: class 0's text embeddings, sample 0's image latents (back in the VAE's raw space)
    mean, std = wan_latent_stats()
    return {
        "root": root,
        "pipe_dir": pipe_dir,
        "run_dir": str(run_dir),
        "experts": experts,
        "loras": comfy_files,
        "context": tables["prompt_embeds"][:1].clone(),
        "image_raw": image[:1] * std + mean,
        "lora_b": lora_b,
    }


def reference(trained, comfy_path, lora_dir=None):
    """The diffusers path: the two-expert pipeline + load_rcm_lora, RCMScheduler, ComfyUI's noise streams."""
    from diffusers import WanImageToVideoPipeline

    from rcm_diffusers import RCMScheduler
    from rcm_diffusers.lora.pipeline import load_rcm_lora

    pipe = WanImageToVideoPipeline.from_pretrained(
        trained["pipe_dir"], tokenizer=None, text_encoder=None, image_encoder=None, image_processor=None
    )
    assert pipe.config.boundary_ratio == BOUNDARY
    if lora_dir is not None:
        load_rcm_lora(pipe, lora_dir)
    mean, std = wan_latent_stats()
    shape = (1, *LATENT)
    mask = torch.zeros(1, 4, *LATENT[1:])
    mask[:, :, 0] = 1.0  # WanImageToVideo: the start image's latent frame is known
    condition = torch.cat([mask, (trained["image_raw"] - mean) / std], dim=1)
    sched = RCMScheduler(sigma_max=SIGMA_MAX, time_input="float")
    sched.set_timesteps(4)
    x = sched.scale_initial_noise(torch.randn(shape, generator=torch.manual_seed(SEED)))
    offset = renoise_seed_offset(comfy_path)
    renoise = {
        True: torch.Generator().manual_seed(SEED + offset),  # first SamplerCustomAdvanced: RandomNoise(SEED)
        False: torch.Generator().manual_seed(0 + offset),
    }  # second: DisableNoise, seed 0
    experts = []
    with torch.no_grad():
        for t in sched.timesteps:
            high = bool(t >= BOUNDARY * 1000)
            experts.append("high" if high else "low")
            net = pipe.transformer if high else pipe.transformer_2
            v = net(
                hidden_states=torch.cat([x, condition], dim=1),
                timestep=t.reshape(1),
                encoder_hidden_states=trained["context"],
                return_dict=False,
            )[0]
            x = sched.step(v, t, x, generator=renoise[high]).prev_sample
    assert experts == ["high", "high", "low", "low"]  # r = 0.995, 0.934 | 0.853, 0.609 at boundary 0.9
    return x * std + mean  # SaveLatent stores ComfyUI's process_latent_out(x)


@pytest.fixture(scope="module")
def served(comfy_server, trained):
    """The trained files in this server's folders; the PNG, embeddings and image latents in its input folder."""
    from PIL import Image

    base = comfy_server.base
    save_file(trained["experts"]["high"], os.path.join(base, "models", "diffusion_models", HIGH_UNET))
    save_file(trained["experts"]["low"], os.path.join(base, "models", "diffusion_models", LOW_UNET))
    for name, target in (("high", HIGH_LORA), ("low", LOW_LORA)):
        os.symlink(trained["loras"][name], os.path.join(base, "models", "loras", target))
    # the same files under each other's name: the pair swapped between the experts
    os.symlink(trained["loras"]["low"], os.path.join(base, "models", "loras", "swapped_" + HIGH_LORA))
    os.symlink(trained["loras"]["high"], os.path.join(base, "models", "loras", "swapped_" + LOW_LORA))
    save_file({"context": trained["context"]}, os.path.join(base, "input", "embeds.safetensors"))
    save_file({"latent": trained["image_raw"].contiguous()}, os.path.join(base, "input", "image_latent.safetensors"))
    Image.new("RGB", (WIDTH, HEIGHT), (200, 120, 40)).save(os.path.join(base, "input", "example.png"))
    return comfy_server


def i2v_prompt(server, high_lora=HIGH_LORA, low_lora=LOW_LORA, prefix="two_experts"):
    """The shipped Wan 2.2 I2V two-expert editor workflow as the editor would POST it, shrunk, with stand-ins."""
    with open(os.path.join(REPO, "example_workflows", "2. Wan 2.2 I2V A14B, two experts, 4 rCM steps.json")) as f:
        ui = json.load(f)
    api = ui_to_api(ui, server.get("/object_info"))

    def nodes(cls):
        return sorted((k for k, v in api.items() if v["class_type"] == cls), key=int)

    (unet_high, unet_low), (lora_high, lora_low) = nodes("UNETLoader"), nodes("RCMLoraLoader")
    assert api[unet_high]["inputs"]["unet_name"].startswith("wan2.2_i2v_high_noise")
    assert api[lora_high]["inputs"]["model"] == [unet_high, 0] and api[lora_low]["inputs"]["model"] == [unet_low, 0]
    assert api[lora_high]["inputs"]["lora_name"] == HIGH_LORA and api[lora_low]["inputs"]["lora_name"] == LOW_LORA
    (split,) = nodes("RCMExpertSplit")
    (sigmas,) = nodes("RCMSigmas")
    assert api[split]["inputs"]["boundary"] == BOUNDARY and api[sigmas]["inputs"]["sigma_max"] == SIGMA_MAX
    api[unet_high]["inputs"]["unet_name"] = HIGH_UNET
    api[unet_low]["inputs"]["unet_name"] = LOW_UNET
    api[lora_high]["inputs"]["lora_name"] = high_lora
    api[lora_low]["inputs"]["lora_name"] = low_lora
    (i2v,) = nodes("WanImageToVideo")
    api[i2v]["inputs"].update(width=WIDTH, height=HEIGHT, length=LENGTH)
    (noise,) = nodes("RandomNoise")
    api[noise]["inputs"]["noise_seed"] = SEED
    # the pair was trained with --time_input float: the sampler calls it at the exact sigmas (the workflow's bf16
    # is for official / default-trained students)
    (sampler,) = nodes("RCMSampler")
    assert api[sampler]["inputs"] == {"stochastic": True, "time_input": "bf16"}
    api[sampler]["inputs"]["time_input"] = "float"
    # text encoder -> fixed embeddings (both prompts: only the positive one is sampled, BasicGuider);
    # VAE -> the fixed-latent stand-in; VAE decode and video -> the latent itself
    for enc in nodes("CLIPTextEncode"):
        api[enc] = {"class_type": "RCMTestTextEmbeds", "inputs": {"file": "embeds.safetensors"}}
    (vae,) = nodes("VAELoader")
    api[vae] = {"class_type": "RCMTestVAE", "inputs": {"file": "image_latent.safetensors"}}
    for cls in ("CLIPLoader", "VAEDecode", "CreateVideo", "SaveVideo"):
        for k in nodes(cls):
            del api[k]
    # the low-noise sampler: the one fed by the other's output
    samplers = nodes("SamplerCustomAdvanced")
    (last,) = [k for k in samplers if api[k]["inputs"]["latent_image"][0] in samplers]
    assert api[api[last]["inputs"]["noise"][0]]["class_type"] == "DisableNoise"
    api["save"] = {
        "class_type": "SaveLatent",
        "inputs": {"samples": [last, 0], "filename_prefix": f"rcm_test/{prefix}"},
    }
    return api


def saved_latent(server, entry) -> torch.Tensor:
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:3000]
    (item,) = entry["outputs"]["save"]["latents"]
    return load_file(os.path.join(server.base, "output", item["subfolder"], item["filename"]))["latent_tensor"]


def test_two_expert_lora_pair_through_the_server_matches_diffusers(served, trained):
    server = served
    ours = saved_latent(server, server.run_prompt(i2v_prompt(server)))
    ref = reference(trained, server.comfy_path, trained["run_dir"])
    assert ours.shape == ref.shape == (1, *LATENT)
    d_ref = (ours.double() - ref.double()).abs().max().item()
    scale = ref.abs().max().item()
    tol = TOL_REL * scale

    # the pair swapped between the experts (in ComfyUI), and no LoRA at all (diffusers): far outside tol
    swapped = saved_latent(
        server, server.run_prompt(i2v_prompt(server, "swapped_" + HIGH_LORA, "swapped_" + LOW_LORA, prefix="swapped"))
    )
    d_swap = (ours - swapped).abs().max().item()
    base = reference(trained, server.comfy_path, None)
    d_base = (ours.double() - base.double()).abs().max().item()
    print(
        f"\n{os.path.basename(server.comfy_path)}: two-expert RCMSampler vs diffusers max|diff| = {d_ref:.3e} "
        f"(max|latent| {scale:.3f}, tol {tol:.2e}); LoRA pair swapped between the experts {d_swap:.3e}; "
        f"diffusers without the LoRAs {d_base:.3e}; max|lora_B| high {trained['lora_b']['high']:.3e}, "
        f"low {trained['lora_b']['low']:.3e}"
    )
    assert scale > 0.1
    assert d_ref <= tol
    # the high-noise steps ran with the high expert's LoRA and the low-noise steps with the low one's
    assert d_swap > 100 * tol
    assert d_base > 100 * tol
