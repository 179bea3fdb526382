"""What one rank of a Ulysses context-parallel group (all processes, gloo) holds in a grad-enabled student forward of
tiny-width Wan transformers, against the memory model (rcm_diffusers/distill/memory.py) at ``context_parallel`` = the
group size. Per case (``CASES``: held-out widths, depths, token and text counts, LoRA rank 8, float32 and bf16 autocast)
and checkpointing policy: without checkpointing the bytes autograd saves (``saved_activation_bytes``) against
``activation_bytes``; with ``full`` / ``selective`` checkpointing the bytes the checkpoints hold
(``checkpoint_held_bytes``) against ``checkpoint_held``. Also the unsplit rule's prediction (``context_parallel`` 1).
Then the allocator trace (``allocation_trace``) of a JVP pass and a grad forward + backward on the first case: its
peaks and what it leaves allocated. Writes ``$CP_OUT/memory-rank{r}.json``. Used by tests/test_memory_model.py."""

import json
import os
import sys

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

from rcm_diffusers.arch import build_transformer  # noqa: E402
from rcm_diffusers.attention import enable_jvp_attention  # noqa: E402
from rcm_diffusers.attention.ulysses import context_parallel_groups, enable_context_parallel  # noqa: E402
from rcm_diffusers.distill.activation_checkpointing import enable_checkpointing  # noqa: E402
from rcm_diffusers.distill.adapters import Networks  # noqa: E402
from rcm_diffusers.distill.memory import (  # noqa: E402
    TrainSetup,
    activation_bytes,
    allocation_trace,
    checkpoint_held,
    checkpoint_held_bytes,
    saved_activation_bytes,
)
from rcm_diffusers.models import velocity_fn  # noqa: E402

# held-out widths as in tests/test_memory_model.py (D 384 and 128, head dims 192 and 64; the Wan ACT_COEFFS were
# counted at D 512 / 1536 / 3072 / 5120 with head dim 128), with 2 heads so that a group of 2 divides them
CASES = [
    dict(
        overrides=dict(num_layers=3, num_attention_heads=2, attention_head_dim=192, ffn_dim=1024),
        frames=3,
        hw=8,
        text=40,
    ),
    dict(
        overrides=dict(num_layers=2, num_attention_heads=2, attention_head_dim=64, ffn_dim=4096),
        frames=2,
        hw=12,
        text=100,
    ),
]
RANK_LORA = 8

dist.init_process_group("gloo")
P, rank = dist.get_world_size(), dist.get_rank()
_, _, group = context_parallel_groups(P)
rows = []
for i, c in enumerate(CASES):
    for dtype in (torch.float32, torch.bfloat16):
        m = build_transformer("wan2.1-t2v-1.3b", dtype=dtype, **c["overrides"])
        m.rope.float()  # from_pretrained keeps the RoPE tables in float32 (_keep_in_fp32_modules), as the trainer loads
        nets, _ = Networks.build(m, "shared", with_fake=True, lora_rank=RANK_LORA)
        enable_jvp_attention(m)
        enable_context_parallel(m, group)
        cfg = m.config
        g = torch.Generator().manual_seed(0)  # the same sample on every rank of the group
        x = torch.randn(1, cfg.in_channels, c["frames"], c["hw"], c["hw"], generator=g).to(dtype)
        cond = {"encoder_hidden_states": torch.randn(1, c["text"], cfg.text_dim, generator=g).to(dtype)}
        v = velocity_fn(m)
        tokens = c["frames"] * c["hw"] ** 2 // 4
        seen = []
        hook = m.blocks[-1].register_forward_pre_hook(lambda _m, a: seen.append(a[0].shape[1]))
        for policy in ("off", "full", "selective"):
            if policy == "off":
                m.disable_gradient_checkpointing()
            else:
                enable_checkpointing(m, policy, RANK_LORA)
            count = saved_activation_bytes if policy == "off" else checkpoint_held_bytes
            with nets.role("student"), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                measured = count(lambda: v(x, torch.tensor([0.5]), **cond), exclude=m.parameters())
            s = TrainSetup.from_config(
                dict(cfg),
                type(m).__name__,
                tokens=tokens,
                text_tokens=c["text"],
                lora_rank=RANK_LORA,
                weight_dtype=str(dtype).split(".")[-1],
                gradient_checkpointing=policy != "off",
                checkpointing_policy="full" if policy == "off" else policy,
                context_parallel=P,
            )
            predict = (lambda s: activation_bytes(s)[0]) if policy == "off" else checkpoint_held
            predicted = predict(s)
            s.context_parallel = 1
            rows.append(
                dict(
                    case=i,
                    dtype=str(dtype).split(".")[-1],
                    policy=policy,
                    tokens=tokens,
                    measured=measured,
                    predicted=predicted,
                    unsplit=predict(s),
                    rank_tokens=sorted(set(seen)),
                )
            )
        hook.remove()

# the allocator trace of a CP rank: a JVP pass, then a grad forward and its backward (float32, first case, no
# checkpointing)
c = CASES[0]
m = build_transformer("wan2.1-t2v-1.3b", **c["overrides"])
nets, _ = Networks.build(m, "shared", with_fake=False, lora_rank=RANK_LORA)
enable_jvp_attention(m)
enable_context_parallel(m, group)
g = torch.Generator().manual_seed(0)
x = torch.randn(1, m.config.in_channels, c["frames"], c["hw"], c["hw"], generator=g)
cond = {"encoder_hidden_states": torch.randn(1, c["text"], m.config.text_dim, generator=g)}
v = velocity_fn(m)
with nets.role("student"), allocation_trace() as tr:
    tr.mark("start")
    with torch.no_grad():
        out = torch.func.jvp(lambda x_: v(x_, torch.tensor([0.5]), **cond), (x,), (torch.ones_like(x),))
    del out
    tr.mark("jvp")
    v(x, torch.tensor([0.5]), **cond).square().mean().backward()
    tr.mark("backward")
    for p in m.parameters():
        p.grad = None
    tr.mark("end")
trace = dict(
    jvp_peak=tr.peak("start", "jvp"),
    backward_peak=tr.peak("jvp", "backward"),
    left=tr.live("start", "end"),
    allocated=sum(b for _, b in tr.events if b > 0),
)

os.makedirs(os.environ["CP_OUT"], exist_ok=True)
with open(os.path.join(os.environ["CP_OUT"], f"memory-rank{rank}.json"), "w") as f:
    json.dump({"world": P, "rows": rows, "trace": trace}, f)
dist.destroy_process_group()
