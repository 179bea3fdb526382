"""A tiny Wan T2V transformer and a tiny two-expert Wan I2V switch with image tokens (each with a LoRA) on 1 process,
or Ulysses context parallel over all processes (gloo): writes the outputs, the exact JVPs (fd_type 0), the
finite-difference tangents (fd_type 2), the sCM losses and the LoRA gradients of their sum to
``$CP_OUT/world{P}-rank{r}.safetensors`` (the I2V ones prefixed ``i2v.``). Used by tests/test_context_parallel.py."""

import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

from peft import LoraConfig  # noqa: E402
from train_helpers import TEXT_DIM, tiny_wan_transformer  # noqa: E402

from rcm_diffusers.attention import enable_jvp_attention  # noqa: E402
from rcm_diffusers.attention import ulysses as U  # noqa: E402
from rcm_diffusers.attention.ulysses import context_parallel_groups, enable_context_parallel  # noqa: E402
from rcm_diffusers.distill import losses as L  # noqa: E402
from rcm_diffusers.distill.experts import WanExpertSwitch  # noqa: E402
from rcm_diffusers.models import velocity_fn  # noqa: E402
from rcm_diffusers.trigflow import TrigFlowDenoiser  # noqa: E402

world = int(os.environ.get("WORLD_SIZE", "1"))
if world > 1:
    dist.init_process_group("gloo")
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj"]
group = context_parallel_groups(world)[2] if world > 1 else None


def with_lora(m, seed, targets):
    """``m`` frozen with a random LoRA (``targets``) as its only trainable parameters, JVP attention and, on several
    processes, context parallelism; returns the LoRA parameters by name."""
    torch.manual_seed(seed)
    m.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False, target_modules=targets))
    m.requires_grad_(False)
    lora = {n: p for n, p in m.named_parameters() if "lora_" in n}
    for p in lora.values():
        p.requires_grad_(True)
    enable_jvp_attention(m)
    if group is not None:
        enable_context_parallel(m, group)
    return lora


model = tiny_wan_transformer()
lora = with_lora(model, 1, LORA_TARGETS)
seen = {"tokens": [], "i2v_tokens": [], "exchanges": 0}  # evidence that the model really ran split
model.blocks[1].register_forward_pre_hook(lambda m, a: seen["tokens"].append(a[0].shape[1]))
a2a = U._a2a


def counted(*a, **k):
    seen["exchanges"] += 1
    return a2a(*a, **k)


U._a2a = counted


def measure(model, shape, t, cond, lora, dtype=torch.float32) -> dict:
    """Output, exact JVP, FD tangent, both sCM losses and the LoRA gradients of their sum (this rank's share summed
    over the group) of ``model`` on a batch of ``shape`` latents at angles ``t`` with conditions ``cond``."""
    g = torch.Generator().manual_seed(0)
    x_t = torch.randn(len(t), *shape, generator=g, dtype=torch.float64)
    F_T = torch.randn(len(t), *shape, generator=g, dtype=torch.float64)
    den = TrigFlowDenoiser(velocity_fn(model, "float"), dtype)

    def F(x, tt):
        return den.F(x, tt, **cond)

    res = {"output": velocity_fn(model, "float")(x_t.to(dtype), t.to(dtype), **cond)}
    with torch.no_grad():
        _, res["jvp"] = L.scm_dF(F, x_t, t, F_T, fd_type=0)
        _, res["fd"] = L.scm_dF(F, x_t, t, F_T, fd_type=2, h=1e-2)
    l0, _ = L.scm_loss(F, x_t, t, F_T, step=0, tangent_warmup=0, fd_type=0)
    l2, _ = L.scm_loss(F, x_t, t, F_T, step=0, tangent_warmup=0, fd_type=2, h=1e-2)
    (l0.sum() + l2.sum()).backward()
    res.update(loss_jvp=l0.detach(), loss_fd=l2.detach())
    grads = {f"grad.{n}": p.grad for n, p in lora.items()}
    if world > 1:  # each rank holds its share of the gradient (attention/ulysses.py): the group's sum is the gradient
        for v in grads.values():
            dist.all_reduce(v, group=group)
    res.update(grads)
    return res


g0 = torch.Generator().manual_seed(0)
cond = {"encoder_hidden_states": torch.randn(2, 5, TEXT_DIM, generator=g0)}
# 2 x 2 x 4 = 16 video tokens per sample
out = measure(model, (4, 2, 4, 8), torch.tensor([0.4, 1.1], dtype=torch.float64), cond, lora)

# Wan I2V with image tokens, as two experts (the Wan 2.2 A14B switch): the condition channels concatenated to the
# latents, 3 image tokens and 512 text tokens that every rank keeps whole, a batch straddling the boundary
i2v = WanExpertSwitch(*[tiny_wan_transformer(seed=s, in_channels=12, image_dim=8) for s in (1, 2)], boundary_ratio=0.9)
lora_i2v = with_lora(i2v, 2, LORA_TARGETS + ["add_k_proj", "add_v_proj"])
cond_i2v = {
    "encoder_hidden_states": torch.randn(2, 512, TEXT_DIM, generator=g0),
    "condition": torch.randn(2, 8, 2, 4, 8, generator=g0),
    "encoder_hidden_states_image": torch.randn(2, 3, 8, generator=g0),
}
i2v.calls = []
i2v.transformer.blocks[1].register_forward_pre_hook(lambda m, a: seen["i2v_tokens"].append(a[0].shape[1]))
i2v.transformer_2.blocks[1].register_forward_pre_hook(lambda m, a: seen["i2v_tokens"].append(a[0].shape[1]))
# RF times 0.297 (low-noise expert) and 0.934 (high-noise expert)
res = measure(i2v, (4, 2, 4, 8), torch.tensor([0.4, 1.5], dtype=torch.float64), cond_i2v, lora_i2v)
out.update({f"i2v.{k}": v for k, v in res.items()})
out["i2v.experts_used"] = torch.tensor(sorted({0 if e == "transformer" else 1 for e, _ in i2v.calls}))
out["i2v.tokens"] = torch.tensor(sorted(set(seen["i2v_tokens"])))
if world == 1:  # the float64 run: how far float32 round-off alone moves the unsplit numbers
    for p in lora_i2v.values():
        p.grad = None
    res = measure(
        i2v.double(),
        (4, 2, 4, 8),
        torch.tensor([0.4, 1.5], dtype=torch.float64),
        {k: v.double() for k, v in cond_i2v.items()},
        lora_i2v,
        torch.float64,
    )
    out.update({f"i2v64.{k}": v for k, v in res.items()})
out.update(tokens=torch.tensor(sorted(set(seen["tokens"]))), exchanges=torch.tensor(seen["exchanges"]))
os.makedirs(os.environ["CP_OUT"], exist_ok=True)
rank = dist.get_rank() if world > 1 else 0
refusals = {}
if world > 1:  # the one-line refusals: heads not divisible by the group size, token count not divisible
    from diffusers import WanTransformer3DModel

    odd = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=3,
        attention_head_dim=4,
        in_channels=4,
        out_channels=4,
        text_dim=TEXT_DIM,
        freq_dim=32,
        ffn_dim=16,
        num_layers=1,
        rope_max_seq_len=32,
    )
    enable_jvp_attention(odd)
    try:
        enable_context_parallel(odd, group)
    except ValueError as e:
        refusals["heads"] = str(e)
    try:
        model(
            torch.randn(1, 4, 1, 2, 6), torch.tensor([500.0]), encoder_hidden_states=cond["encoder_hidden_states"][:1]
        )
    except ValueError as e:
        refusals["tokens"] = str(e)
    try:  # ranks that disagree on the expert of a sample: refused before any exchange
        i2v(
            torch.randn(1, 12, 2, 4, 8),
            torch.tensor([950.0 if rank == 0 else 100.0]),
            cond_i2v["encoder_hidden_states"][:1],
            cond_i2v["encoder_hidden_states_image"][:1],
        )
    except ValueError as e:
        refusals["routing"] = str(e)
with open(os.path.join(os.environ["CP_OUT"], f"refusals{world}-rank{rank}.json"), "w") as f:
    json.dump(refusals, f)
save_file(
    {k: v.detach().contiguous() for k, v in out.items()},
    os.path.join(os.environ["CP_OUT"], f"world{world}-rank{rank}.safetensors"),
)
if world > 1:
    dist.destroy_process_group()
