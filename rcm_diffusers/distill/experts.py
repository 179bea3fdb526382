"""Wan 2.2 A14B's two experts as one module (docs/math.md §6.1).

``WanPipeline`` / ``WanImageToVideoPipeline`` with ``boundary_ratio`` call ``transformer`` (the high-noise
expert) at every step whose ``timestep >= boundary_ratio * 1000`` and ``transformer_2`` (the low-noise
expert) below it. :class:`WanExpertSwitch` applies the same rule **per sample** inside one ``forward``
with the Wan transformer's signature, so everything that calls a transformer -- the TrigFlow maps, the
losses and their JVP, the peft role switch, accelerate's DDP wrapper, the samplers -- sees a single
network whose time decides the expert, exactly as the pipeline would. A batch whose samples straddle the
boundary is split, each expert runs on its own samples, and the outputs are put back in order.

Why our own module: diffusers has no module-level expert switch (the pipelines pick the expert in their
step loop), and the trainer needs the choice per sample and inside ``torch.func.jvp``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os

import torch
from torch import nn

from .. import rng

__all__ = [
    "WanExpertSwitch",
    "pipeline_boundary_ratio",
    "index_boundary_ratio",
    "switch_of",
    "expert_lora_weights",
    "boundary_sigma",
    "sample_p_G_experts",
    "HIGH",
    "LOW",
]

#: the pipeline components of the high-noise and low-noise experts
HIGH, LOW = "transformer", "transformer_2"


def pipeline_boundary_ratio(pretrained: str) -> float | None:
    """``boundary_ratio`` of a diffusers pipeline folder's ``model_index.json`` when it has a ``transformer_2``
    (a two-expert Wan 2.2 pipeline), else ``None``."""
    path = os.path.join(pretrained, "model_index.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return index_boundary_ratio(json.load(f))


def index_boundary_ratio(index: dict) -> float | None:
    """``boundary_ratio`` of a loaded ``model_index.json`` that names a ``transformer_2``, else ``None``."""
    t2 = index.get(LOW)
    if not t2 or t2[0] is None or index.get("boundary_ratio") is None:
        return None
    return float(index["boundary_ratio"])


def boundary_sigma(boundary_ratio: float) -> float:
    """The EDM noise level of the switch: ``r = sigma / (1 + sigma)``, so ``sigma_b = b / (1 - b)``
    (docs/math.md §6.1)."""
    if not 0.0 < boundary_ratio < 1.0:
        raise ValueError(f"boundary_ratio must lie in (0, 1), got {boundary_ratio}")
    return boundary_ratio / (1.0 - boundary_ratio)


class WanExpertSwitch(nn.Module):
    """``transformer`` where ``timestep >= boundary_ratio * num_train_timesteps``, ``transformer_2`` elsewhere,
    decided per sample (the rule of diffusers' Wan pipelines, docs/math.md §6.1).

    ``timestep`` is what the network is given (``rcm_diffusers.models.network_timestep``; with
    ``time_input="bf16"`` the rounded value the pipeline compares too). :meth:`pinned` overrides the rule
    with a fixed per-sample choice (the sCM term keeps each sample on the expert that owns its time while
    it evaluates nearby times). ``calls``, when a list, records ``(expert, timesteps)`` per expert call.
    """

    def __init__(
        self, transformer: nn.Module, transformer_2: nn.Module, boundary_ratio: float, num_train_timesteps: int = 1000
    ):
        super().__init__()
        boundary_sigma(boundary_ratio)  # validates
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.boundary_ratio = float(boundary_ratio)
        self.boundary_timestep = float(boundary_ratio) * num_train_timesteps
        self._pin: torch.Tensor | None = None
        self.calls: list | None = None
        # FSDP2 (both experts sharded over all ranks): every call runs both experts on every rank, see forward
        self.run_both = False

    # ---- what the rest of the package reads from a diffusers model
    @property
    def config(self):
        return self.transformer.config

    @property
    def dtype(self) -> torch.dtype:
        from ..models import compute_dtype

        return compute_dtype(self.transformer)

    @property
    def experts(self) -> dict[str, nn.Module]:
        return {HIGH: self.transformer, LOW: self.transformer_2}

    @property
    def peft_config(self) -> dict:
        return self.transformer.peft_config

    def add_adapter(self, adapter_config, adapter_name: str = "default") -> None:
        """diffusers ``add_adapter`` on both experts (same config, separate weights)."""
        for m in self.experts.values():
            m.add_adapter(adapter_config, adapter_name=adapter_name)

    def enable_gradient_checkpointing(self, gradient_checkpointing_func=None) -> None:
        """diffusers ``enable_gradient_checkpointing`` on both experts (``None``: diffusers' default function)."""
        for m in self.experts.values():
            m.enable_gradient_checkpointing(gradient_checkpointing_func=gradient_checkpointing_func)

    @property
    def attn_processors(self) -> dict:
        return {f"{e}.{k}": v for e, m in self.experts.items() for k, v in m.attn_processors.items()}

    def set_attn_processor(self, processors) -> None:
        """Set processors on both experts; a dict is keyed like :attr:`attn_processors`."""
        for e, m in self.experts.items():
            if isinstance(processors, dict):
                m.set_attn_processor({k[len(e) + 1 :]: v for k, v in processors.items() if k.split(".", 1)[0] == e})
            else:
                m.set_attn_processor(processors)

    # ---- the switch
    def is_high(self, timestep: torch.Tensor) -> torch.Tensor:
        """Per-sample ``timestep >= boundary_timestep`` (bool ``[B]``); a ``[B, seq]`` timestep uses its first
        column."""
        ts = torch.as_tensor(timestep).detach()
        return (ts[:, 0] if ts.dim() > 1 else ts) >= self.boundary_timestep

    @contextlib.contextmanager
    def pinned(self, high: torch.Tensor | None):
        """Within the block every call uses ``high`` (bool ``[B]``) instead of the rule; ``None`` = the rule."""
        before, self._pin = self._pin, (None if high is None else high.detach().to(torch.bool))
        try:
            yield
        finally:
            self._pin = before

    def forward(
        self,
        hidden_states,
        timestep,
        encoder_hidden_states,
        encoder_hidden_states_image=None,
        return_dict: bool = True,
        attention_kwargs=None,
        **kw,
    ):
        B = hidden_states.shape[0]
        high = self._pin if self._pin is not None else self.is_high(timestep)
        if high.shape[0] != B:
            raise ValueError(f"expert choice for {high.shape[0]} samples, batch of {B}")
        high = high.to(hidden_states.device)
        _same_choice_in_cp_group(high, self.transformer)

        def run(expert: str, idx, record: bool = True):
            m = self.experts[expert]
            sub = (lambda a: a) if idx is None else (lambda a: a if a is None else a.index_select(0, idx))
            if self.calls is not None and record:
                self.calls.append((expert, sub(timestep).detach().double().cpu().reshape(-1).tolist()))
            return m(
                hidden_states=sub(hidden_states),
                timestep=sub(timestep),
                encoder_hidden_states=sub(encoder_hidden_states),
                encoder_hidden_states_image=sub(encoder_hidden_states_image),
                attention_kwargs=attention_kwargs,
                return_dict=False,
                **kw,
            )[0]

        if self.run_both:
            # FSDP2 gathers an expert's shards in collectives every rank must join, forward and backward: each rank
            # calls both experts in the same order; an expert no sample of this rank needs runs on sample 0 and its
            # output enters the result times zero, so its backward runs too (zero gradients)
            outs, zero = [], 0.0
            idx_h, idx_l = high.nonzero()[:, 0], (~high).nonzero()[:, 0]
            for expert, idx in ((HIGH, idx_h), (LOW, idx_l)):
                if idx.numel():
                    outs.append(run(expert, idx))
                else:
                    zero = zero + 0.0 * run(expert, idx.new_zeros(1), record=False).sum()
            order = torch.argsort(torch.cat([idx_h, idx_l]))
            out = torch.cat(outs).index_select(0, order) + zero
        elif bool(high.all()):
            out = run(HIGH, None)
        elif not bool(high.any()):
            out = run(LOW, None)
        else:
            idx_h, idx_l = high.nonzero()[:, 0], (~high).nonzero()[:, 0]
            order = torch.argsort(torch.cat([idx_h, idx_l]))
            out = torch.cat([run(HIGH, idx_h), run(LOW, idx_l)]).index_select(0, order)
        if not return_dict:
            return (out,)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=out)


def _same_choice_in_cp_group(high: torch.Tensor, expert: nn.Module) -> None:
    """Under context parallelism (``attention.ulysses``) every rank of a group must send each sample to the same
    expert: the all-to-all inside the experts would otherwise mix two experts' tokens without any error. One
    all-reduce of the per-sample choice; a mismatch raises ``ValueError``."""
    from ..attention.ulysses import cp_group_of

    group = cp_group_of(expert)
    if group is None:
        return
    import torch.distributed as dist

    mine = torch.tensor(
        [int(h) for h in high.tolist()], dtype=torch.int32, device=high.device
    )  # plain, also inside a jvp
    total = mine.clone()
    dist.all_reduce(total, group=group)
    if not torch.equal(total, mine * dist.get_world_size(group)):
        raise ValueError(
            f"two experts under context parallelism: the ranks of a group route the batch differently "
            f"(this rank: high-noise expert for {mine.tolist()}); every rank of a group needs the same times"
        )


def sample_p_G_experts(
    high: torch.Tensor,
    boundary_ratio: float,
    P_mean: float = -0.8,
    P_std: float = 1.6,
    video_noise_multiplier: float = 1.0,
    generator: torch.Generator | None = None,
    device=None,
) -> torch.Tensor:
    """sCM angles from ``p_G`` restricted to each sample's expert (docs/math.md §6.1): ``ln sigma ~ N(P_mean, P_std^2)``
    conditioned on ``m sigma >= sigma_b`` where ``high`` is true, ``< sigma_b`` elsewhere (``m`` the video noise
    multiplier, ``sigma_b = b / (1 - b)``), by inverse-CDF sampling of the truncated normal; ``t = arctan(m sigma)``."""
    sb = boundary_sigma(boundary_ratio)
    z_b = (math.log(sb / video_noise_multiplier) - P_mean) / P_std
    cdf_b = float(torch.special.ndtr(torch.tensor(z_b, dtype=torch.float64)))
    u = rng.rand((high.shape[0],), dtype=torch.float64, generator=generator, device=device)
    high = high.to(u.device)
    # high: u in [cdf_b, 1); low: u in [0, cdf_b); kept off the ends so ndtri stays finite
    p = torch.where(high, cdf_b + u * (1.0 - cdf_b), u * cdf_b).clamp(1e-12, 1.0 - 1e-12)
    z = torch.special.ndtri(p)
    sigma = torch.exp(P_mean + P_std * z) * video_noise_multiplier
    return torch.atan(sigma)


def switch_of(module) -> WanExpertSwitch | None:
    """The :class:`WanExpertSwitch` under accelerate / peft wrappers, or ``None`` for a one-network model."""
    from ..models import _base_model

    m = _base_model(module)
    return m if isinstance(m, WanExpertSwitch) else None


def expert_lora_weights(weights: dict, expert: str) -> dict:
    """The entries of a switch-level parameter dict (``"transformer.blocks..."`` / ``"transformer_2.blocks..."``,
    e.g. EMA weights) that belong to ``expert``, with the expert prefix removed."""
    pre = expert + "."
    return {k[len(pre) :]: v for k, v in weights.items() if k.startswith(pre)}
