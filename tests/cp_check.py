"""One tiny Wan T2V transformer (with a LoRA) on 1 process, or Ulysses context parallel over all processes (gloo):
writes the transformer output, the exact JVP (fd_type 0), the finite-difference tangent (fd_type 2), the sCM
losses and the LoRA gradients of their sum to ``$CP_OUT/world{P}.safetensors``. Used by tests/test_context_parallel.py."""

import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

from peft import LoraConfig  # noqa: E402

from rcm_diffusers.attention import enable_jvp_attention  # noqa: E402
from rcm_diffusers.attention import ulysses as U  # noqa: E402
from rcm_diffusers.attention.ulysses import context_parallel_groups, enable_context_parallel  # noqa: E402
from rcm_diffusers.distill import losses as L  # noqa: E402
from rcm_diffusers.models import velocity_fn  # noqa: E402
from rcm_diffusers.trigflow import TrigFlowDenoiser  # noqa: E402
from train_helpers import TEXT_DIM, tiny_wan_transformer  # noqa: E402

world = int(os.environ.get("WORLD_SIZE", "1"))
if world > 1:
    dist.init_process_group("gloo")
model = tiny_wan_transformer()
torch.manual_seed(1)
model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False, target_modules=["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj"]))
model.requires_grad_(False)
lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
for p in lora.values():
    p.requires_grad_(True)
enable_jvp_attention(model)
if world > 1:
    _, _, group = context_parallel_groups(world)
    enable_context_parallel(model, group)
seen = {"tokens": [], "exchanges": 0}  # evidence that the model really ran split
model.blocks[1].register_forward_pre_hook(lambda m, a: seen["tokens"].append(a[0].shape[1]))
a2a = U._a2a


def counted(*a, **k):
    seen["exchanges"] += 1
    return a2a(*a, **k)


U._a2a = counted

g = torch.Generator().manual_seed(0)
B, shape = 2, (4, 2, 4, 8)  # 2 x 2 x 4 = 16 video tokens per sample
x_t = torch.randn(B, *shape, generator=g, dtype=torch.float64)
t = torch.tensor([0.4, 1.1], dtype=torch.float64)
F_T = torch.randn(B, *shape, generator=g, dtype=torch.float64)
cond = {"encoder_hidden_states": torch.randn(B, 5, TEXT_DIM, generator=g)}
den = TrigFlowDenoiser(velocity_fn(model, "float"), torch.float32)


def F(x, tt):
    return den.F(x, tt, **cond)


out = {"output": model(x_t[:, :, :, :, :].float(), torch.tensor([300.0, 800.0]), **cond).sample}
with torch.no_grad():
    dx, dt = L.scm_tangents(x_t, t, F_T)
    _, out["jvp"] = L.scm_dF(F, x_t, t, F_T, fd_type=0)
    _, out["fd"] = L.scm_dF(F, x_t, t, F_T, fd_type=2, h=1e-2)
l0, _ = L.scm_loss(F, x_t, t, F_T, step=0, tangent_warmup=0, fd_type=0)
l2, _ = L.scm_loss(F, x_t, t, F_T, step=0, tangent_warmup=0, fd_type=2, h=1e-2)
(l0.sum() + l2.sum()).backward()
out.update(loss_jvp=l0.detach(), loss_fd=l2.detach())
grads = {f"grad.{n}": p.grad for n, p in lora.items()}
if world > 1:  # each rank holds its share of the gradient (attention/ulysses.py): the group's sum is the gradient
    for v in grads.values():
        dist.all_reduce(v, group=group)
out.update(grads)
out.update(tokens=torch.tensor(sorted(set(seen["tokens"]))), exchanges=torch.tensor(seen["exchanges"]))
os.makedirs(os.environ["CP_OUT"], exist_ok=True)
rank = dist.get_rank() if world > 1 else 0
refusals = {}
if world > 1:  # the one-line refusals: heads not divisible by the group size, token count not divisible
    from diffusers import WanTransformer3DModel

    odd = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=4, in_channels=4, out_channels=4,
                                text_dim=TEXT_DIM, freq_dim=32, ffn_dim=16, num_layers=1, rope_max_seq_len=32)
    enable_jvp_attention(odd)
    try:
        enable_context_parallel(odd, group)
    except ValueError as e:
        refusals["heads"] = str(e)
    try:
        model(torch.randn(1, 4, 1, 2, 6), torch.tensor([500.0]), encoder_hidden_states=cond["encoder_hidden_states"][:1])
    except ValueError as e:
        refusals["tokens"] = str(e)
with open(os.path.join(os.environ["CP_OUT"], f"refusals{world}-rank{rank}.json"), "w") as f:
    json.dump(refusals, f)
save_file({k: v.detach().contiguous() for k, v in out.items()}, os.path.join(os.environ["CP_OUT"], f"world{world}-rank{rank}.safetensors"))
if world > 1:
    dist.destroy_process_group()
