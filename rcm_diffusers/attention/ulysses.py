"""Ulysses context parallelism for the Wan transformer, through the primal, the JVP tangent and the backward
(docs/math.md §5).

A context-parallel (CP) group of ``P`` processes runs one sample together: after the patch embedding each rank
keeps its contiguous block of ``S / P`` video tokens (and the RoPE angles of those true positions); around every
self-attention an all-to-all turns the sequence shards of ``q, k, v`` into head shards (all ``S`` tokens,
``H / P`` heads) and the attention output back; cross-attention to the text (and the I2V image context) stays
local, every rank holding the full context; after ``proj_out`` the token blocks are gathered, so every rank
returns the full output.

Why our own collectives and not ``torch.distributed.nn.functional.all_to_all`` or diffusers' context parallel
(``ContextParallelConfig(ulysses_degree=P)`` with ``enable_parallelism``, read in diffusers 0.42): both define
their collectives as ``torch.autograd.Function`` with ``forward(ctx, ...)`` / ``backward`` only, which gives
reverse-mode gradients but no forward-mode rule, and ``torch.func.jvp`` refuses an autograd.Function without
``setup_context`` and ``jvp``; diffusers also routes the attention through its backends' templated
forward/backward ops, which have no tangent. On a machine without an accelerator ``enable_parallelism`` does not
even start in diffusers 0.42 (``ZeroDivisionError``: ``rank % torch.accelerator.device_count()`` in
``_resolve_parallel_config``, tried on 2 gloo processes), so its training gradients could not be measured here.
``_AllToAll`` and ``_Gather`` below are linear maps with all three rules: the tangent goes through the same
collective as the primal, the gradient through its adjoint.

The gather's adjoint takes the rank's own block of the output gradient without summing over the group: each
rank of a CP group computes the same loss on the same gathered output, one copy of the loss. Each rank's
parameter gradients are then its share (the contributions through its tokens), and the group's sum is the
unsplit gradient; a trainer that averages gradients over all processes multiplies its loss by ``P``
(``training/rcm.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "all_to_all",
    "gather_seq",
    "enable_context_parallel",
    "disable_context_parallel",
    "context_parallel_groups",
    "WanUlyssesAttnProcessor",
    "cp_group_of",
    "check_context_parallel",
]


def _a2a(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    P = dist.get_world_size(group)
    if x.shape[scatter_dim] % P:
        raise ValueError(
            f"all-to-all over {P} ranks: dimension {scatter_dim} of {tuple(x.shape)} is not divisible by {P}"
        )
    send = torch.stack([c.contiguous() for c in x.chunk(P, dim=scatter_dim)])
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    out = torch.cat(recv.unbind(0), dim=gather_dim)
    _release(send, recv)
    return out


def _gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    send = x.clone(memory_format=torch.contiguous_format)  # ours to free (the caller's x may be dropped first)
    dist.all_gather(parts, send, group=group)
    out = torch.cat(parts, dim=dim)
    _release(send, *parts)
    return out


def _release(*buffers: torch.Tensor) -> None:
    """Free a finished CPU collective's exchange buffers on this thread. gloo's work object keeps a reference to
    them and its worker thread drops it after the op completes, so without this the memory is returned at a time
    that depends on thread scheduling, on a thread torch.profiler's allocation trace does not see (the trace then
    counts the buffers as held). Safe once the synchronous op has returned: gloo no longer touches the data. CUDA
    buffers are left to their process group (NCCL keeps them until its stream is done with them)."""
    for b in buffers:
        while torch._C._functorch.is_functorch_wrapped_tensor(b):  # inside torch.func: free the tensor underneath
            b = torch._C._functorch.get_unwrapped(b)
        if b.device.type == "cpu":
            b.untyped_storage().resize_(0)


class _AllToAll(torch.autograd.Function):
    """Split ``scatter_dim`` into ``P`` blocks, send block ``j`` to rank ``j``, concatenate the received blocks along
    ``gather_dim`` in rank order. Linear: the tangent takes the same map, the gradient the inverse exchange."""

    @staticmethod
    def forward(x, group, scatter_dim, gather_dim):
        return _a2a(x, group, scatter_dim, gather_dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group, ctx.scatter_dim, ctx.gather_dim = inputs[1:]

    @staticmethod
    def backward(ctx, grad):
        return _a2a(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None

    @staticmethod
    def jvp(ctx, x_dot, *_):
        return _a2a(x_dot, ctx.group, ctx.scatter_dim, ctx.gather_dim)


class _Gather(torch.autograd.Function):
    """Concatenate every rank's block along ``dim`` (rank order). Tangent: gathered alike; gradient: the rank's own
    block of the incoming gradient (one copy of the loss per group, see the module docstring)."""

    @staticmethod
    def forward(x, group, dim):
        return _gather(x, group, dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group, ctx.dim = inputs[1:]
        ctx.size = inputs[0].shape[inputs[2]]

    @staticmethod
    def backward(ctx, grad):
        r = dist.get_rank(ctx.group)
        return grad.narrow(ctx.dim, r * ctx.size, ctx.size), None, None

    @staticmethod
    def jvp(ctx, x_dot, *_):
        return _gather(x_dot, ctx.group, ctx.dim)


def all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Differentiable (reverse and forward mode) all-to-all over ``group``."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


def gather_seq(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Differentiable (reverse and forward mode) gather of the token blocks of ``group`` along ``dim``."""
    return _Gather.apply(x, group, dim)


def _shard(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    P, r = dist.get_world_size(group), dist.get_rank(group)
    n = x.shape[dim]
    if n % P:
        raise ValueError(
            f"context parallel size {P}: the sample has {n} video tokens, not divisible by {P}; "
            "choose a context_parallel_size that divides (frames / p_t) x (height / p_h) x (width / p_w)"
        )
    return x.narrow(dim, r * (n // P), n // P)


def context_parallel_groups(size: int):
    """``(dp_rank, dp_world, group)``: the CP group of this process (ranks ``[g P, (g + 1) P)``, created on every rank
    in the same order as torch.distributed requires), its data-parallel index ``g`` and the number of groups."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(f"context_parallel_size {size} does not divide the {world} processes")
    mine = None
    for g in range(world // size):
        grp = dist.new_group(list(range(g * size, (g + 1) * size)))
        if g == rank // size:
            mine = grp
    return rank // size, world // size, mine


def cp_group_of(model):
    """The CP group ``enable_context_parallel`` installed on ``model`` (a diffusers Wan transformer), else ``None``."""
    return getattr(model, "_rcm_cp", {}).get("group")


def enable_context_parallel(transformer, group):
    """Run the diffusers ``WanTransformer3DModel`` ``transformer`` (peft-wrapped or a two-expert switch: every expert)
    Ulysses-parallel over ``group``. Installs ``WanUlyssesAttnProcessor`` on every attention (the stock computation
    with the exchange around self-attention; with ``enable_jvp_attention`` its JVP passes take the fused kernel as any
    SDPA call does); hooks shard the RoPE angles and the patch embedding's tokens (as copies) and gather
    ``proj_out``'s output. Refuses (``ValueError``, one line) head counts not divisible by the group size and non-Wan
    models; a token count not divisible is refused at the call. Returns ``transformer``."""
    from .processors import _parts

    for model in _parts(transformer):
        _enable(model, group)
    return transformer


WAN_TEXT_TOKENS = 512  # Wan I2V: the last 512 context tokens are text, the ones before are image


def _wan_rotary(x, freqs_cos, freqs_sin):
    """Wan RoPE on interleaved pairs ``(x[2i], x[2i+1])``: rotate each by the angle of its frequency."""
    x_even, x_odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class WanUlyssesAttnProcessor:
    """diffusers' ``WanAttnProcessor`` computation (self-attention with RoPE, text cross-attention, the I2V image
    branch) with the Ulysses exchange around self-attention: token shards -> head shards, attend, and back. Attention
    goes through diffusers' ``dispatch_attention_fn`` as in the stock processor. ``stock``: the processor it
    replaced, put back by ``disable_context_parallel``."""

    def __init__(self, stock, group):
        self.stock, self.cp_group = stock, group
        self._attention_backend = getattr(stock, "_attention_backend", None)

    def _attend(self, q, k, v, attn_mask=None):
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        return dispatch_attention_fn(
            q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=False, backend=self._attention_backend
        )

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        from diffusers.models.transformers import transformer_wan

        context_img = None
        if attn.add_k_proj is not None:  # I2V: split image tokens off the front of the context
            n_img = encoder_hidden_states.shape[1] - WAN_TEXT_TOKENS
            context_img = encoder_hidden_states[:, :n_img]
            encoder_hidden_states = encoder_hidden_states[:, n_img:]

        q, k, v = transformer_wan._get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (x.unflatten(2, (attn.heads, -1)) for x in (q, k, v))
        if rotary_emb is not None:
            q, k = _wan_rotary(q, *rotary_emb), _wan_rotary(k, *rotary_emb)

        out_img = None
        if context_img is not None:
            k_img, v_img = transformer_wan._get_added_kv_projections(attn, context_img)
            k_img = attn.norm_added_k(k_img).unflatten(2, (attn.heads, -1))
            v_img = v_img.unflatten(2, (attn.heads, -1))
            out_img = self._attend(q, k_img, v_img).flatten(2, 3).type_as(q)

        if encoder_hidden_states is None:  # self-attention: token shards -> head shards, attend, and back
            q, k, v = (all_to_all(x, self.cp_group, 2, 1) for x in (q, k, v))
            out = all_to_all(self._attend(q, k, v, attention_mask), self.cp_group, 1, 2).flatten(2, 3).type_as(q)
        else:
            out = self._attend(q, k, v, attention_mask).flatten(2, 3).type_as(q)
        if out_img is not None:
            out = out + out_img
        return attn.to_out[1](attn.to_out[0](out))


def check_context_parallel(transformer, size: int) -> None:
    """Refuse (``ValueError``, one line) what ``enable_context_parallel`` with a group of ``size`` ranks cannot run:
    a model that is not a diffusers Wan transformer (every expert of a two-expert switch is checked) or whose head
    count ``size`` does not divide. Needs no process group."""
    from .processors import _parts

    for model in _parts(transformer):
        if type(model).__name__ != "WanTransformer3DModel":
            raise ValueError(f"context parallelism is implemented for Wan transformers, not {type(model).__name__}")
        heads = model.config.num_attention_heads
        if heads % size:
            raise ValueError(
                f"context_parallel_size {size} does not divide the {heads} attention heads of {type(model).__name__}"
            )


def _enable(model, group) -> None:
    check_context_parallel(model, dist.get_world_size(group))
    _disable(model)
    procs = model.attn_processors
    model.set_attn_processor({n: WanUlyssesAttnProcessor(p, group) for n, p in procs.items()})

    # The shards are copies: a view would keep the full tensor's storage alive on every rank (the RoPE tables through
    # the blocks that use them; the token embedding through the first block's checkpoint, which holds its argument),
    # and a rank would hold all tokens of those two instead of tokens / P (measured: tests/test_memory_model.py).
    def rope_out(_m, _args, out):
        return tuple(_shard(f, group, 1).clone() for f in out)

    def patch_out(_m, _args, out):
        # [B, C, F, H, W] -> this rank's token block as [B, C, S / P, 1, 1]: the forward's flatten(2).transpose(1, 2)
        # then gives [B, S / P, C], sharded before the blocks (and their checkpoints) see it
        return _shard(out.flatten(2), group, 2).clone()[..., None, None]

    def proj_out(_m, _args, out):
        return gather_seq(out, group, 1)

    def per_token_time(_m, args, kwargs):
        t = args[1] if len(args) > 1 else kwargs.get("timestep")
        if t is not None and t.dim() == 2:
            raise ValueError("context parallelism: per-token timesteps (Wan 2.2 TI2V) are not supported")

    handles = [
        model.rope.register_forward_hook(rope_out),
        model.patch_embedding.register_forward_hook(patch_out),
        model.proj_out.register_forward_hook(proj_out),
        model.register_forward_pre_hook(per_token_time, with_kwargs=True),
    ]
    model._rcm_cp = {"group": group, "handles": handles}


def disable_context_parallel(transformer):
    """Undo ``enable_context_parallel``."""
    from .processors import _parts

    for model in _parts(transformer):
        _disable(model)
    return transformer


def _disable(model) -> None:
    state = model.__dict__.pop("_rcm_cp", None)
    if state is None:
        return
    for h in state["handles"]:
        h.remove()
    model.set_attn_processor(
        {n: (p.stock if isinstance(p, WanUlyssesAttnProcessor) else p) for n, p in model.attn_processors.items()}
    )
