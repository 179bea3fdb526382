"""Save/load and safe checkpoint loading; LoRA -> ComfyUI -> back reproduces pipeline output."""

import json
import os
import pickle

import pytest
import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline
from test_lora_keys import assert_same, assert_same_effect, random_lora, tiny_flux, tiny_wan

from rcm_diffusers.lora import checkpoint, io, keys


def tiny_pipe():
    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    return WanPipeline(
        transformer=tiny_wan(),
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        text_encoder=None,
        tokenizer=None,
    )


def run(pipe):
    emb = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(5))
    return pipe(
        prompt_embeds=emb,
        negative_prompt_embeds=torch.zeros_like(emb),
        height=16,
        width=16,
        num_frames=5,
        num_inference_steps=2,
        guidance_scale=2.0,
        output_type="latent",
        generator=torch.Generator().manual_seed(7),
    ).frames


def test_lora_via_comfyui_and_back_reproduces_pipeline_output(tmp_path):
    pipe = tiny_pipe()
    base = run(pipe)
    # unequal ranks and alphas, scaled so that the LoRA visibly changes the output
    lora = {k: (v * 0.3 if "lora" in k else v) for k, v in random_lora(pipe.transformer, rank=2, vary=True).items()}
    io.save_lora(tmp_path / "ref.safetensors", lora, "wan", format="diffusers")
    pipe.load_lora_weights(str(tmp_path), weight_name="ref.safetensors", adapter_name="ref")
    ref = run(pipe)
    assert (ref - base).abs().max() > 1e-2  # the LoRA matters

    info = io.save_lora(
        tmp_path / "comfy.safetensors",
        lora,
        "wan",
        format="comfyui",
        metadata={"base_model": "tiny-wan", "made_by": "test"},
    )
    raw = io.read_metadata(tmp_path / "comfy.safetensors")
    assert json.loads(raw["rcm_lora"])["base_model"] == "tiny-wan" and info["n_lora_modules"] == 2 * 10 + 6
    sd, meta = io.load_lora(tmp_path / "comfy.safetensors", format="diffusers")
    assert meta["format"] == "comfyui" and meta["ranks_min_max"] == [2, 4]
    # exact round trip through the file inside the blocks; outside, alpha/r is folded into lora_down (not a power
    # of two here: lora_down kept in float32, one float32 rounding of each element)
    blocks = lambda d: {k: v for k, v in d.items() if k.startswith("transformer.blocks.")}  # noqa: E731
    assert_same(blocks(sd), blocks(lora))
    assert_same_effect(sd, lora, rtol=2**-22)
    io.save_lora(tmp_path / "back.safetensors", sd, format="diffusers")
    pipe.load_lora_weights(str(tmp_path), weight_name="back.safetensors", adapter_name="back")
    # exact: every LoRA'd layer gets the same delta weight (B A * alpha/r, bias) from both files
    from peft.tuners.lora import LoraLayer

    layers = [m for m in pipe.transformer.modules() if isinstance(m, LoraLayer) and "ref" in m.lora_A]
    assert len(layers) == info["n_lora_modules"] and all("back" in m.lora_A for m in layers)
    folded = 0
    for m in layers:
        if m.scaling["back"] == m.scaling["ref"]:
            assert torch.equal(m.get_delta_weight("back"), m.get_delta_weight("ref"))
        else:  # alpha folded into lora_down (outside the blocks): float32 round-off of B A * alpha/r
            folded += 1
            ref_d = m.get_delta_weight("ref")
            torch.testing.assert_close(
                m.get_delta_weight("back"), ref_d, rtol=0, atol=4 * 2**-23 * ref_d.abs().max().item()
            )
        assert (m.lora_B["ref"].bias is None) == (m.lora_B["back"].bias is None)
        if m.lora_B["ref"].bias is not None:
            assert torch.equal(m.lora_B["back"].bias, m.lora_B["ref"].bias)
    # the pipeline output: equal up to float32 round-off. Two loads build separate adapter modules, and
    # BLAS kernels/thread counts may sum in another order (seen: 2.4e-6 of latents ~1 on one CPU); 1e-5 is
    # ~100 float32 ulps of the output and 1000x below the LoRA's own effect checked above
    pipe.set_adapters("back")
    out = run(pipe)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    outside = [k for k in lora if k.endswith(".alpha") and not k.startswith("transformer.blocks.")]
    assert folded == sum(float(lora[k]) != lora[k.replace(".alpha", ".lora_A.weight")].shape[0] for k in outside) > 0
    # and the ComfyUI file read back in diffusers names by our loader gives the same state dict
    back, _ = io.load_lora(tmp_path / "back.safetensors", format="diffusers")
    assert_same_effect(back, sd)  # (the diffusers header gives every module an alpha back, = rank where folded)


def test_diffusers_save_drops_and_lists_unloadable_deltas(tmp_path, caplog):
    lora = random_lora(tiny_wan(), rank=2)
    lora["transformer.blocks.0.scale_shift_table.diff"] = torch.ones(1, 6, 24)
    lora["transformer.blocks.0.attn1.to_q.diff_b"] = torch.ones(24)
    info = io.save_lora(tmp_path / "d.safetensors", lora, "wan", format="diffusers")
    assert info["not_applied"] == ["transformer.blocks.0.scale_shift_table.diff"]
    assert "dropped" in caplog.text
    sd, _ = io.load_lora(tmp_path / "d.safetensors")
    assert torch.equal(sd["transformer.blocks.0.attn1.to_q.diff_b"], torch.ones(24))  # kept as lora_B.bias
    info = io.save_lora(tmp_path / "c.safetensors", lora, "wan", format="comfyui")
    assert info["not_applied"] == ["diffusion_model.blocks.0.modulation.diff"]  # kept, but listed
    sd, _ = io.load_lora(tmp_path / "c.safetensors", format="comfyui")
    assert torch.equal(sd["diffusion_model.blocks.0.modulation.diff"], torch.ones(1, 6, 24))


def test_flux_save_load_comfyui(tmp_path):
    lora = random_lora(tiny_flux(), rank=3)
    io.save_lora(tmp_path / "f.safetensors", lora, format="comfyui")
    sd, meta = io.load_lora(tmp_path / "f.safetensors", format="comfyui")
    assert "diffusion_model.double_blocks.0.img_attn.qkv.lora_up.weight" in sd and meta["arch"] == "flux"
    back, _ = io.load_lora(tmp_path / "f.safetensors")
    assert_same(back, lora)
    with pytest.raises(ValueError, match="format must be"):
        io.save_lora(tmp_path / "x.safetensors", lora, format="kohya")


def test_corrupt_and_missing_files(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="not a readable safetensors"):
        io.load_lora(bad)
    with pytest.raises(FileNotFoundError):
        io.load_lora(tmp_path / "nope.safetensors")
    pt = tmp_path / "trunc.pt"
    torch.save({"a": torch.ones(100)}, pt)
    pt.write_bytes(pt.read_bytes()[:50])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        checkpoint.load_state_dict(pt)


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_pickled_code_is_refused(tmp_path):
    p = tmp_path / "evil.pt"
    torch.save({"model": {"w": torch.ones(2)}, "hook": Evil()}, p)
    with pytest.raises(checkpoint.UnsafeCheckpointError, match="pickled code"):
        checkpoint.load_state_dict(p)
    p2 = tmp_path / "evil_plain.pth"
    with open(p2, "wb") as f:
        pickle.dump(Evil(), f)
    with pytest.raises(checkpoint.UnsafeCheckpointError, match="refused"):
        checkpoint.load_state_dict(p2)


@pytest.mark.parametrize("wrap", ["model", "net", "ema", "plain"])
def test_nested_and_prefixed_checkpoints_keep_dtype(tmp_path, wrap):
    sd = keys.to_original(tiny_wan().state_dict(), "wan", prefix="")
    sd = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    if wrap == "plain":
        obj = {f"model.diffusion_model.{k}": v for k, v in sd.items()}
    elif wrap == "ema":
        obj = {
            "iteration": 7,
            "net": {k: torch.zeros_like(v) for k, v in sd.items()},
            "ema": {f"net.{k}": v for k, v in sd.items()},
        }
    else:
        obj = {wrap: {f"module.{k}": v for k, v in sd.items()}, "step": 3}
    p = tmp_path / "ckpt.pt"
    torch.save(obj, p)
    got = checkpoint.load_state_dict(p, prefer="ema" if wrap == "ema" else None)
    assert_same(got, sd)  # names, values and bf16 dtype
    assert keys.detect_format(got) == "original"
