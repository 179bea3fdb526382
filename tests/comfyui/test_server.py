"""End to end through ComfyUI's own HTTP server, as the editor's Queue button does it.

Per ComfyUI checkout in ``COMFYUI_PATH`` (a current one and one from before ``comfy_api.latest``):
``main.py --cpu`` on a free port of 127.0.0.1 with the repository root symlinked into
``custom_nodes/`` (the ComfyUI-Manager / Registry layout), a tiny random Wan 2.1 T2V model in
``models/diffusion_models``, a peft-made LoRA in ``models/loras``. The shipped editor workflow
``example_workflows/1. Wan 2.1 T2V in 4 rCM steps.json`` is converted to the API prompt the editor would send,
shrunk to a 64x64x5 video, its text encoder replaced by a stand-in node that returns fixed text
embeddings (see ``comfyui_harness.STANDIN_PACK``), and its VAE decode by ``SaveLatent``. The test POSTs
it to ``/prompt``, polls ``/history`` and compares the saved latent with

* with ``RCMSampler``'s ``time_input`` set to ``float``: ComfyUI's built-in ``lcm`` sampler on the same
  graph and seed (the same move at the same times; ComfyUI's own noise sampler in both, so equal up to
  float32 rounding), and the diffusers path: diffusers' ``WanTransformer3DModel`` with the same weights
  (diffusers' own single-file converter) and the LoRA through peft, stepped by
  ``rcm_diffusers.RCMScheduler(time_input="float")`` with ComfyUI's noise: the initial ``randn`` from
  ``seed`` (``comfy.sample.prepare_noise``) and the re-noising draws from a generator seeded as that
  ComfyUI's ``default_noise_sampler`` does;
* with the workflow's own ``time_input`` (``bf16``, the model called at ``bf16(1000 r) / 1000``): the same
  diffusers path stepped by ``RCMScheduler(time_input="bf16")`` (the diffusers default), and far from the
  ``float`` result.

A bad widget value comes back in ``/prompt``'s 400 response as one error naming it; widgets that do not fit
together (more steps than angles) and a wrong LoRA as an execution error.
The server is stopped by its PID when the module ends.
"""

import copy
import json
import os

import pytest
import torch
from comfyui_harness import (
    DIM,
    LAYERS,
    REPO,
    TEXT_DIM,
    diffusers_wan_from_comfy,
    renoise_seed_offset,
    tiny_wan_state_dict,
    wan_latent_stats,
)
from safetensors.torch import load_file, save_file
from workflow_format import ui_to_api

SEED = 20260729
LORA_STRENGTH = 0.8
WIDTH = HEIGHT = 64
LENGTH = 5  # -> latent (1, 16, 2, 8, 8)


def peft_lora_for(model, rank=4):
    """A LoRA (diffusers names) made with peft on the diffusers model, random B as if trained."""
    from peft import LoraConfig, get_peft_model_state_dict

    torch.manual_seed(4)  # peft draws lora_A from the global generator
    model.add_adapter(
        LoraConfig(
            r=rank, lora_alpha=rank, target_modules=["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]
        )
    )
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


@pytest.fixture(scope="module")
def setup(comfy_server):
    """Tiny model, LoRA and text embeddings in the server's folders; the diffusers reference sample."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from rcm_diffusers import RCMScheduler
    from rcm_diffusers.lora.io import save_lora

    base = comfy_server.base
    model_sd = tiny_wan_state_dict()
    save_file(model_sd, os.path.join(base, "models", "diffusion_models", "tiny_wan21.safetensors"))
    model = diffusers_wan_from_comfy(model_sd)
    lora = peft_lora_for(model)
    save_lora(
        os.path.join(base, "models", "loras", "tiny_rcm_lora.safetensors"),
        {f"transformer.{k}": v for k, v in lora.items()},
        arch="wan",
        format="diffusers",
    )
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.scaling = {k: LORA_STRENGTH * v for k, v in module.scaling.items()}
    context = 0.5 * torch.randn(1, 12, TEXT_DIM, generator=torch.Generator().manual_seed(2))
    save_file({"context": context}, os.path.join(base, "input", "embeds.safetensors"))

    # the diffusers path: RCMScheduler over the diffusers transformer, ComfyUI's noise streams; the
    # scheduler's time_input as RCMSampler's (float: the model at the exact sigma; bf16: at the rounded one)
    shape = (1, 16, (LENGTH - 1) // 4 + 1, HEIGHT // 8, WIDTH // 8)
    mean, std = wan_latent_stats()
    references = {}
    for time_input in ("float", "bf16"):
        sched = RCMScheduler(sigma_max=80.0, time_input=time_input)
        sched.set_timesteps(4)
        noise = torch.randn(shape, generator=torch.manual_seed(SEED))
        x = sched.scale_initial_noise(noise)
        renoise = torch.Generator().manual_seed(SEED + renoise_seed_offset(comfy_server.comfy_path))
        with torch.no_grad():
            for t in sched.timesteps:
                v = model(hidden_states=x, timestep=t.reshape(1), encoder_hidden_states=context, return_dict=False)[0]
                x = sched.step(v, t, x, generator=renoise).prev_sample
        references[time_input] = x * std + mean  # SaveLatent stores ComfyUI's process_latent_out(x)
    assert references["bf16"].shape == references["float"].shape
    return {
        "reference": references["float"],
        "reference_bf16": references["bf16"],
        "timesteps_bf16": sched.timesteps.tolist(),
    }


def t2v_prompt(server, sampler="RCMSampler", time_input=None, prefix=None, **rcm_sigmas):
    """The shipped Wan 2.1 T2V editor workflow as the editor would POST it, shrunk and with stand-ins.

    ``time_input``: RCMSampler's widget, else the workflow's own (bf16); ``sampler``: a built-in sampler
    (KSamplerSelect) in place of RCMSampler."""
    with open(os.path.join(REPO, "example_workflows", "1. Wan 2.1 T2V in 4 rCM steps.json")) as f:
        ui = json.load(f)
    api = ui_to_api(ui, server.get("/object_info"))
    by_type = {v["class_type"]: k for k, v in api.items()}
    api[by_type["UNETLoader"]]["inputs"]["unet_name"] = "tiny_wan21.safetensors"
    lora = api[by_type["RCMLoraLoader"]]["inputs"]
    lora.update(lora_name="tiny_rcm_lora.safetensors", strength_model=LORA_STRENGTH)
    api[by_type["EmptyHunyuanLatentVideo"]]["inputs"].update(width=WIDTH, height=HEIGHT, length=LENGTH)
    api[by_type["RandomNoise"]]["inputs"]["noise_seed"] = SEED
    api[by_type["RCMSigmas"]]["inputs"].update(rcm_sigmas)
    # text encoder -> fixed embeddings; VAE decode and video -> the latent itself
    api[by_type["CLIPTextEncode"]] = {"class_type": "RCMTestTextEmbeds", "inputs": {"file": "embeds.safetensors"}}
    for name in ("CLIPLoader", "VAELoader", "VAEDecode", "CreateVideo", "SaveVideo"):
        del api[by_type[name]]
    assert api[by_type["RCMSampler"]]["inputs"] == {"stochastic": True, "time_input": "bf16"}
    if time_input is not None:
        api[by_type["RCMSampler"]]["inputs"]["time_input"] = time_input
    if sampler != "RCMSampler":
        api[by_type["RCMSampler"]] = {"class_type": "KSamplerSelect", "inputs": {"sampler_name": sampler}}
    prefix = prefix or f"rcm_test/{sampler}_{time_input}"
    api["save"] = {
        "class_type": "SaveLatent",
        "inputs": {"samples": [by_type["SamplerCustomAdvanced"], 0], "filename_prefix": prefix},
    }
    return api


def saved_latent(server, entry) -> torch.Tensor:
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:3000]
    (item,) = entry["outputs"]["save"]["latents"]
    return load_file(os.path.join(server.base, "output", item["subfolder"], item["filename"]))["latent_tensor"]


def test_wan_t2v_workflow_through_the_server_matches_lcm_and_diffusers(comfy_server, setup):
    """time_input float: RCMSampler = lcm, and = RCMScheduler(time_input="float")."""
    ours = saved_latent(comfy_server, comfy_server.run_prompt(t2v_prompt(comfy_server, time_input="float")))
    lcm = saved_latent(comfy_server, comfy_server.run_prompt(t2v_prompt(comfy_server, sampler="lcm")))
    ref = setup["reference"]
    assert ours.shape == ref.shape == (1, 16, 2, 8, 8)
    d_lcm = (ours - lcm).abs().max().item()
    d_ref = (ours.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    print(
        f"\n{os.path.basename(comfy_server.comfy_path)}: RCMSampler (float) vs lcm max|diff| = {d_lcm:.3e}; "
        f"vs diffusers RCMScheduler {d_ref:.3e} (max|latent| {scale:.3f})"
    )
    # same graph, same float32 ops in another order: rounding only
    assert d_lcm <= 1e-5 * scale
    # another implementation of the transformer (diffusers vs ComfyUI), float32 over 4 model calls and
    # a float64 scheduler: round-off of order 1e-6 relative per call; a wrong noise draw, sigma or LoRA
    # strength moves the result by O(1)
    assert d_ref <= 1e-5 * scale
    assert scale > 0.1


def test_wan_t2v_workflow_at_its_bf16_time_input_matches_the_diffusers_default(comfy_server, setup):
    """The shipped workflow's time_input (bf16) = RCMScheduler(time_input="bf16"), the diffusers default and
    the time official rCM checkpoints and training/rcm.py train with; far from the float-time sample."""
    ours = saved_latent(comfy_server, comfy_server.run_prompt(t2v_prompt(comfy_server)))
    exact = saved_latent(
        comfy_server,
        comfy_server.run_prompt(t2v_prompt(comfy_server, time_input="float", prefix="rcm_test/float_vs_bf16")),
    )
    ref = setup["reference_bf16"]
    assert setup["timesteps_bf16"] == [988.0, 932.0, 852.0, 608.0]  # bf16(1000 r), not 987.65, 933.78, ...
    d_ref = (ours.double() - ref).abs().max().item()
    d_float = (ours - exact).abs().max().item()
    d_refs = (ref - setup["reference"]).abs().max().item()
    scale = ref.abs().max().item()
    tol = 1e-5 * scale  # as the float test above: round-off of two transformer implementations
    print(
        f"\n{os.path.basename(comfy_server.comfy_path)}: RCMSampler (bf16) vs diffusers RCMScheduler(bf16) "
        f"max|diff| = {d_ref:.3e} (max|latent| {scale:.3f}, tol {tol:.2e}); vs RCMSampler (float) {d_float:.3e}; "
        f"diffusers bf16 vs float {d_refs:.3e}"
    )
    assert scale > 0.1
    assert d_ref <= tol
    # the rounded time moves the sample far beyond round-off, the same way in both implementations
    assert d_float > 100 * tol and d_refs > 100 * tol


@pytest.mark.parametrize(
    "rcm_sigmas, widget, fragment",
    [
        ({"mid_t": "1.5, 1.4.0"}, "mid_t", "rCM Sigmas: mid_t: cannot read ['1.4.0'] as numbers"),
        ({"sigma_max": 0.0}, "sigma_max", "Value 0.0 smaller than min of 0.01"),
        ({"sigma_max": -3.0}, "sigma_max", "Value -3.0 smaller than min of 0.01"),
        ({"steps": 9}, "steps", "Value 9 bigger than max of 8"),
    ],
)
def test_bad_widget_values_come_back_in_the_prompt_response(comfy_server, setup, rcm_sigmas, widget, fragment):
    """One error per bad value, naming that widget (ComfyUI reports a failed custom check once per input the check
    takes: the check takes mid_t alone; steps and sigma_max are refused by their ranges)."""
    status, body = comfy_server.post("/prompt", {"prompt": t2v_prompt(comfy_server, **rcm_sigmas)})
    assert status == 400, body
    errors = [e for ne in body["node_errors"].values() for e in ne["errors"]]
    assert len(errors) == 1, errors
    (e,) = errors
    assert e["extra_info"]["input_name"] == widget and fragment in f"{e['message']}: {e['details']}", e


@pytest.mark.parametrize(
    "rcm_sigmas, fragment",
    [
        (
            {"steps": 6},
            "rCM Sigmas: steps=6 is out of range: with mid_t=[1.5, 1.4, 1.0] the rCM sampler takes 1..4 steps",
        ),
        ({"steps": 4, "sigma_max": 2.0}, "arctan(sigma_max=2.0)"),
    ],
)
def test_widgets_that_do_not_fit_together_are_one_execution_error(comfy_server, setup, rcm_sigmas, fragment):
    entry = comfy_server.run_prompt(t2v_prompt(comfy_server, **rcm_sigmas))
    assert entry["status"]["status_str"] == "error"
    (err,) = [m[1] for m in entry["status"]["messages"] if m[0] == "execution_error"]
    assert err["node_type"] == "RCMSigmas" and fragment in err["exception_message"], err["exception_message"]


def test_wrong_lora_for_the_model_is_an_execution_error_naming_the_widget(comfy_server, setup):
    save_file(
        {
            "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, DIM),
            "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(DIM, 4),
        },
        os.path.join(comfy_server.base, "models", "loras", "a_flux_lora.safetensors"),
    )
    wan14b = {
        f"diffusion_model.blocks.{LAYERS + 3}.self_attn.q.lora_down.weight": torch.zeros(4, DIM),
        f"diffusion_model.blocks.{LAYERS + 3}.self_attn.q.lora_up.weight": torch.zeros(DIM, 4),
    }
    save_file(wan14b, os.path.join(comfy_server.base, "models", "loras", "a_deeper_wan_lora.safetensors"))
    for lora_name, fragment in (
        ("a_flux_lora.safetensors", "this LoRA is for Flux but the model is Wan"),
        ("a_deeper_wan_lora.safetensors", ""),
    ):
        prompt = t2v_prompt(comfy_server)
        loader = next(v for v in prompt.values() if v["class_type"] == "RCMLoraLoader")
        loader["inputs"]["lora_name"] = lora_name
        entry = comfy_server.run_prompt(copy.deepcopy(prompt))
        assert entry["status"]["status_str"] == "error"
        (err,) = [m[1] for m in entry["status"]["messages"] if m[0] == "execution_error"]
        assert err["node_type"] == "RCMLoraLoader"
        assert f"lora_name={lora_name!r}" in err["exception_message"], err["exception_message"]
        assert fragment in err["exception_message"]
        assert err["exception_message"].count(lora_name) == 1 and err["exception_message"].lower().count("pick a") == 1
