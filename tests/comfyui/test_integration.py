"""The node pack inside a real ComfyUI process, on the CPU, with a tiny random Wan 2.1 model.

Runs only when COMFYUI_PATH points at a ComfyUI checkout (the first one, if several) and this
Python has ComfyUI's requirements (plus peft); see docs/comfyui.md. The pack is linked as
``custom_nodes/<name> -> comfy_nodes`` here; tests/comfyui/test_server.py links the repository root. It loads the
pack with ComfyUI's own custom-node loader, the model with UNETLoader, a LoRA with RCMLoraLoader, samples with
SamplerCustomAdvanced + RCMSigmas + RCMSampler and compares with ComfyUI's built-in ``lcm``.
"""

import asyncio
import os

import pytest
import torch
from comfyui_harness import (
    COMFYUI_PATHS,
    DIM,
    FFN,
    LAYERS,
    REPO,
    SKIP_REASON,
    TEXT_DIM,
    have_comfyui,
    import_comfy,
    tiny_wan_state_dict,
)

pytestmark = pytest.mark.skipif(not have_comfyui(), reason=SKIP_REASON)
SEED = 1234


@pytest.fixture(scope="module")
def comfy_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("comfy")
    import_comfy(COMFYUI_PATHS[0])
    import folder_paths
    import nodes

    for name in ("diffusion_models", "loras", "custom_nodes"):
        (root / name).mkdir()
        folder_paths.add_model_folder_path(name, str(root / name), is_default=True)
    os.symlink(os.path.join(REPO, "comfy_nodes"), root / "custom_nodes" / "rcm_nodes")
    loaded = nodes.init_extra_nodes(init_custom_nodes=True, init_api_nodes=False)
    if asyncio.iscoroutine(loaded):  # async since 2025-06
        asyncio.run(loaded)
    return root, nodes, folder_paths


def call(nodes, name, **kw):
    """Run a node class as ComfyUI would: new-schema ``execute`` or the legacy FUNCTION."""
    cls = nodes.NODE_CLASS_MAPPINGS[name]
    if hasattr(cls, "define_schema"):
        return cls.execute(**kw).args
    return getattr(cls(), cls.FUNCTION)(**kw)


def make_peft_lora(model_sd, rank=4):
    """A LoRA made with peft on the tiny model (original layer names), random B as if trained."""
    import comfy.ops
    from comfy.ldm.wan.model import WanModel
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    net = WanModel(
        dim=DIM,
        ffn_dim=FFN,
        num_heads=DIM // 128,
        num_layers=LAYERS,
        text_dim=TEXT_DIM,
        in_dim=16,
        out_dim=16,
        operations=comfy.ops.disable_weight_init,
    )
    net.load_state_dict({k.removeprefix("model.diffusion_model."): v for k, v in model_sd.items()})
    cfg = LoraConfig(
        r=rank,
        lora_alpha=rank,
        target_modules=r"blocks\.\d+\.(self_attn|cross_attn)\.(q|k|v|o)|blocks\.\d+\.ffn\.(0|2)",
    )
    peft_net = get_peft_model(net, cfg)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in peft_net.named_parameters():
            if "lora_B" in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_net).items()}


def test_pack_loads_and_samples_like_lcm(comfy_env):
    root, nodes, folder_paths = comfy_env
    from safetensors.torch import save_file

    from rcm_diffusers.lora.io import save_lora

    for name in ("RCMSigmas", "RCMSampler", "TrigFlowTeacherSigmas", "RCMLoraLoader", "RCMExpertSplit"):
        assert name in nodes.NODE_CLASS_MAPPINGS, f"{name} not registered by ComfyUI's custom-node loader"

    model_sd = tiny_wan_state_dict()
    save_file(model_sd, root / "diffusion_models" / "tiny_wan21.safetensors")
    (model,) = call(nodes, "UNETLoader", unet_name="tiny_wan21.safetensors", weight_dtype="default")
    assert type(model.model).__name__ == "WAN21"

    # LoRA: peft on the tiny model, saved with our io in the diffusers layout (ComfyUI's own loader
    # does not read diffusers Wan names) and in the ComfyUI layout.
    peft_sd = make_peft_lora(model_sd)
    save_lora(root / "loras" / "rcm_diffusers.safetensors", peft_sd, arch="wan", format="diffusers")
    save_lora(root / "loras" / "rcm_comfy.safetensors", peft_sd, arch="wan", format="comfyui")
    (lora_model,) = call(nodes, "RCMLoraLoader", model=model, lora_name="rcm_diffusers.safetensors", strength_model=0.7)
    (lora_model2,) = call(nodes, "RCMLoraLoader", model=model, lora_name="rcm_comfy.safetensors", strength_model=0.7)
    n_targets = LAYERS * 10
    assert len(lora_model.patches) == n_targets and set(lora_model.patches) == set(lora_model2.patches)

    # the patched weight is W + strength * B A (alpha = rank)
    key = "diffusion_model.blocks.1.cross_attn.o.weight"
    A = peft_sd["base_model.model.blocks.1.cross_attn.o.lora_A.weight"]
    B = peft_sd["base_model.model.blocks.1.cross_attn.o.lora_B.weight"]
    expected = model_sd["model." + key] + 0.7 * B @ A
    lora_model.patch_model()
    try:
        got = lora_model.model.diffusion_model.blocks[1].cross_attn.o.weight.detach().clone()
    finally:
        lora_model.unpatch_model()
    assert (got - expected).abs().max().item() < 1e-5
    assert (B @ A).abs().max().item() > 1e-3

    # full-weight deltas on Wan's modulation parameters: stock ComfyUI registers but never applies
    # them; RCMLoraLoader does (object patch), and the shared base model is left as it was
    mod_key = "diffusion_model.blocks.0.modulation"
    save_file({f"{mod_key}.diff": torch.full((1, 6, DIM), 0.5)}, root / "loras" / "modulation.safetensors")
    base_mod = model_sd["model." + mod_key]
    for loader, change in (("LoraLoaderModelOnly", 0.0), ("RCMLoraLoader", 0.5)):
        (m,) = call(nodes, loader, model=model, lora_name="modulation.safetensors", strength_model=1.0)
        m.patch_model()
        try:
            got_mod = m.model.diffusion_model.blocks[0].modulation.detach().clone()
        finally:
            m.unpatch_model()
        assert abs((got_mod - base_mod).abs().max().item() - change) < 1e-6, loader
    assert torch.equal(model.model.diffusion_model.blocks[0].modulation.detach(), base_mod)

    # bad input: a name ComfyUI does not list (a missing file, a path out of models/loras), a LoRA of another
    # architecture
    for name in (
        "missing.safetensors",
        "../loras/rcm_comfy.safetensors",
        str(root / "loras" / "rcm_comfy.safetensors"),
    ):
        with pytest.raises(ValueError, match=r"is not in ComfyUI's loras list .* pick it from the list\.$"):
            call(nodes, "RCMLoraLoader", model=model, lora_name=name, strength_model=1.0)
    save_file(
        {
            "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 128),
            "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(128, 4),
        },
        root / "loras" / "flux.safetensors",
    )
    with pytest.raises(ValueError, match="for Flux but the model is Wan"):
        call(nodes, "RCMLoraLoader", model=model, lora_name="flux.safetensors", strength_model=1.0)

    # sampling: 4 rCM steps vs ComfyUI's lcm with the same sigmas and noise seed
    (sigmas,) = call(nodes, "RCMSigmas", steps=4, sigma_max=80.0, mid_t="1.5, 1.4, 1.0", model=lora_model)
    assert torch.allclose(sigmas, torch.tensor([0.98765, 0.93378, 0.85289, 0.60898, 0.0]), atol=1e-5)
    cond = [[0.1 * torch.randn(1, 8, TEXT_DIM, generator=torch.Generator().manual_seed(2)), {}]]
    (guider,) = call(nodes, "BasicGuider", model=lora_model, conditioning=cond)
    (noise,) = call(nodes, "RandomNoise", noise_seed=SEED)
    latent = {"samples": torch.zeros(1, 16, 2, 8, 8)}

    def run(sampler, sig=sigmas, lat=latent, nz=noise, gd=guider):
        out, _ = call(
            nodes, "SamplerCustomAdvanced", noise=nz, guider=gd, sampler=sampler, sigmas=sig, latent_image=lat
        )
        return out

    # time_input float: the model at the exact sigmas, as lcm calls it
    (rcm_sampler,) = call(nodes, "RCMSampler", stochastic=True, time_input="float")
    (lcm_sampler,) = call(nodes, "KSamplerSelect", sampler_name="lcm")
    ours = run(rcm_sampler)["samples"]
    lcm = run(lcm_sampler)["samples"]
    diff = (ours - lcm).abs().max().item()
    print(f"\nrCM vs lcm: max|diff| = {diff:.3e}, max|sample| = {ours.abs().max().item():.4f}")
    assert torch.isfinite(ours).all() and ours.abs().max().item() > 1e-2
    assert diff < 1e-5

    # the seed matters, the LoRA matters, the deterministic option differs
    (noise2,) = call(nodes, "RandomNoise", noise_seed=SEED + 1)
    (plain_guider,) = call(nodes, "BasicGuider", model=model, conditioning=cond)
    (ode_sampler,) = call(nodes, "RCMSampler", stochastic=False, time_input="float")
    for other in (run(rcm_sampler, nz=noise2), run(rcm_sampler, gd=plain_guider), run(ode_sampler)):
        assert (other["samples"] - ours).abs().max().item() > 1e-3
    # time_input bf16 (the widget's default): the model at bf16(1000 sigma)/1000, x0 re-anchored at sigma;
    # the same as sample_rcm(time_input="bf16") over ComfyUI's model, and not the float/lcm sample
    (bf16_sampler,) = call(nodes, "RCMSampler", stochastic=True, time_input="bf16")
    bf16 = run(bf16_sampler)["samples"]
    d_bf16 = (bf16 - ours).abs().max().item()
    print(f"rCM time_input bf16 vs float: max|diff| = {d_bf16:.3e}")
    assert d_bf16 > 1e-3

    # expert split: two chained samplers (second without added noise) equal one run
    high, low = call(nodes, "RCMExpertSplit", sigmas=sigmas, boundary=0.9)
    (no_noise,) = call(nodes, "DisableNoise")
    mid = run(rcm_sampler, sig=high)
    # one noise stream per sampler call: compare against lcm split the same way
    mid_lcm = run(lcm_sampler, sig=high)
    assert (mid["samples"] - mid_lcm["samples"]).abs().max().item() < 1e-5
    end = run(rcm_sampler, sig=low, lat=mid, nz=no_noise)
    end_lcm = run(lcm_sampler, sig=low, lat=mid_lcm, nz=no_noise)
    split_diff = (end["samples"] - end_lcm["samples"]).abs().max().item()
    print(f"two-expert split (0.9): high {high.tolist()}, low {low.tolist()}, rCM vs lcm max|diff| = {split_diff:.3e}")
    assert split_diff < 1e-5
