"""Do diffusers' inference-time memory hooks hold under what LoRA training on a frozen base needs? One JSON of checks
behind the docstring of ``rcm_diffusers/distill/lowmem.py`` (why the trainer has its own ``FrozenLinear`` /
``BlockSwap``):

* ``apply_layerwise_casting(storage_dtype=float8_e4m3fn)`` on a tiny Wan with LoRA adapters: which trainable
  parameters end up stored in float8; a backward through a cast Linear (what the saved weight is then); a
  ``torch.func.jvp`` through it; the error of the unscaled E4M3 cast on weights of Wan's size (std 0.02) against
  ``lowmem``'s per-block-scaled FP8.
* ``param.data`` reassigned between a forward and its backward (what group offloading does when it offloads a block):
  which weight the backward reads (the forward's: the saved tensor keeps that memory alive until the backward).
* ``torch.func.jvp`` through ``apply_group_offloading(offload_type="block_level")`` with host and device both the CPU.
* CUDA only (``--cuda``; part of ``benchmarks/gpu_check.py``): ``apply_group_offloading(offload_type="block_level",
  use_stream=True)`` on the tiny Wan with adapters: whether a LoRA update made between two calls survives the next
  offload / onload, and whether a grad-enabled forward's backward runs.

    python benchmarks/lowmem_probe.py            # CPU checks
    python benchmarks/lowmem_probe.py --cuda     # also the group-offloading checks (needs CUDA)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))


def _tiny_wan_with_adapters(device="cpu"):
    from diffusers import WanTransformer3DModel

    from rcm_diffusers.distill.adapters import Networks

    torch.manual_seed(0)
    m = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        rope_max_seq_len=32,
    )
    nets, _ = Networks.build(m.to(device), "shared", with_fake=True, lora_rank=4)
    return m, nets


def _err(fn):
    try:
        return {"ok": True, "value": fn()}
    except Exception as e:  # noqa: BLE001 - the probe records what fails and how
        return {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}


def layerwise_casting() -> dict:
    from diffusers.hooks import apply_layerwise_casting

    m, _ = _tiny_wan_with_adapters()
    apply_layerwise_casting(m, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    lora = {n: p for n, p in m.named_parameters() if "lora_" in n}
    out = {
        "lora_params": len(lora),
        "lora_params_stored_float8": sum(p.dtype == torch.float8_e4m3fn for p in lora.values()),
    }

    lin = torch.nn.Linear(64, 32, bias=False)
    lin.requires_grad_(False)
    apply_layerwise_casting(
        lin, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32, skip_modules_pattern=None
    )
    x = torch.randn(8, 64, requires_grad=True)

    def backward():
        y = lin(x)
        y.sum().backward()
        want = torch.ones(8, 32) @ lin.weight.float()
        return {
            "saved_weight_dtype_at_backward": str(lin.weight.dtype),
            "grad_matches": bool(torch.equal(x.grad, want)),
        }

    out["backward"] = _err(backward)
    out["jvp"] = _err(lambda: tuple(torch.func.jvp(lin, (x.detach(),), (torch.ones(8, 64),))[1].shape))
    w = 0.02 * torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    plain = w.to(torch.float8_e4m3fn).float()
    from rcm_diffusers.distill.lowmem import dequantized_weight

    rel = lambda a: float((a - w).norm() / w.norm())  # noqa: E731
    out["fp8_relative_error"] = {"unscaled_cast": rel(plain), "per_block_scaled": rel(dequantized_weight(w, "fp8"))}
    return out


def data_swap_backward() -> dict:
    """A frozen weight whose ``.data`` is replaced after the forward: the backward reads the new data."""
    p = torch.nn.Parameter(torch.randn(4, 3), requires_grad=False)
    x = torch.randn(2, 3, requires_grad=True)
    y = F.linear(x, p)
    before = p.data.clone()
    p.data = torch.zeros_like(p.data)  # what an offload does: param.data = <the host copy>
    y.sum().backward()
    return {
        "grad_uses_the_forward_weight": bool(torch.equal(x.grad, torch.ones(2, 4) @ before)),
        "grad_uses_the_replaced_data": bool(torch.equal(x.grad, torch.zeros(2, 3))),
    }


def group_offloading_jvp_cpu() -> dict:
    """``torch.func.jvp`` through ``apply_group_offloading(offload_type="block_level")`` with host = device = CPU (the
    hooks run, the moves are no-ops). Run last: a failed transform can leave the process unusable for autograd."""
    from diffusers.hooks import apply_group_offloading

    m, nets = _tiny_wan_with_adapters()
    apply_group_offloading(
        m,
        onload_device=torch.device("cpu"),
        offload_device=torch.device("cpu"),
        offload_type="block_level",
        num_blocks_per_group=1,
    )
    x, e, t = torch.randn(1, 4, 2, 4, 8), torch.randn(1, 5, 16), torch.tensor([500.0])
    with nets.role("student"):
        return _err(
            lambda: tuple(
                torch.func.jvp(lambda a: m(a, t, e, return_dict=False)[0], (x,), (torch.ones_like(x),))[1].shape
            )
        )


def group_offloading_cuda() -> dict:
    from diffusers.hooks import apply_group_offloading

    m, nets = _tiny_wan_with_adapters("cuda")
    apply_group_offloading(
        m, onload_device=torch.device("cuda"), offload_type="block_level", num_blocks_per_group=1, use_stream=True
    )
    x = torch.randn(1, 4, 2, 4, 8, device="cuda")
    e = torch.randn(1, 5, 16, device="cuda")
    t = torch.tensor([500.0], device="cuda")
    name, p = next((n, q) for n, q in m.named_parameters() if "blocks.0" in n and "lora_B.student" in n)
    out = {"lora_device_after_call": None}

    def update_survives():
        with nets.role("student"), torch.no_grad():
            m(x, t, e, return_dict=False)
        out["lora_device_after_call"] = str(p.device)
        with torch.no_grad():
            p.data = p.data.to("cuda") + 1.0  # an optimizer step on the device
        want = p.data.detach().clone()
        with nets.role("student"), torch.no_grad():
            m(x, t, e, return_dict=False)
        return bool(torch.equal(p.data.to("cuda"), want))

    out["lora_update_survives_next_call"] = _err(update_survives)

    def backward():
        with nets.role("student"):
            m(x, t, e, return_dict=False)[0].square().sum().backward()
        return "ran"

    out["backward"] = _err(backward)
    out["param"] = name
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cuda", action="store_true", help="also the group-offloading checks (needs CUDA)")
    ap.add_argument("--out", default="", help="write the JSON here too")
    a = ap.parse_args(argv)
    res = {"torch": torch.__version__, "layerwise_casting": layerwise_casting(), "data_swap": data_swap_backward()}
    if a.cuda and torch.cuda.is_available():
        res["group_offloading"] = _err(group_offloading_cuda)
    res["group_offloading_jvp_cpu"] = group_offloading_jvp_cpu()
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
