"""Teacher, student and fake score as three views of one diffusers transformer (docs/math.md §6), or as
three separate copies (full fine-tune).

``shared`` (LoRA) mode: one frozen base; the teacher is the base with adapters disabled, the
student is the base + peft adapter ``"student"``, the fake score the base + adapter ``"fake"``.
Only adapter weights (and their optimizer states and EMA) are trained and stored. Both adapters
start with ``lora_B = 0``, so student and fake score start equal to the teacher (docs/math.md §4.3).

``full`` mode: the student and the fake score are full trainable copies of the teacher.

Every network is used through ``Networks.F / x0 / v`` with a role name, which switches the
active adapter and calls ``rcm_diffusers.models.velocity_fn`` on the (possibly
accelerate-wrapped) module, so gradient synchronisation of DDP/FSDP applies.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from ..models import CFG_NORM_RESCALE, _base_model, compute_dtype, model_class_name, velocity_fn
from ..trigflow import TrigFlowDenoiser

__all__ = ["ROLES", "DEFAULT_LORA_TARGETS", "Networks", "add_rcm_adapters", "lora_parameters"]

ROLES = ("teacher", "student", "fake")

#: the projections of a joint (image / video and text) attention block: q/k/v/out of the image or video stream, then
#: the text stream's add_q/k/v and to_add_out (FLUX.1, Qwen-Image, FLUX.2 and HunyuanVideo-1.5 name them alike)
_JOINT_ATTENTION = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
]

#: LoRA target modules per transformer family (attention projections and feed-forward)
DEFAULT_LORA_TARGETS = {
    "Wan": ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj", "ffn.net.0.proj", "ffn.net.2"],
    "Flux": [
        *_JOINT_ATTENTION,
        "proj_mlp",
        "proj_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    ],
    # QwenImageTransformerBlock: joint attention (image q/k/v/out, text add_q/k/v and to_add_out) and the image and
    # text feed-forwards (the Linears of diffusers' own _tp_plan for the blocks)
    "QwenImage": [
        *_JOINT_ATTENTION,
        "img_mlp.net.0.proj",
        "img_mlp.net.2",
        "txt_mlp.net.0.proj",
        "txt_mlp.net.2",
    ],
    # Flux2TransformerBlock: joint attention (q/k/v/out, add_q/k/v, to_add_out) and both SwiGLU feed-forwards;
    # Flux2SingleTransformerBlock: the fused q/k/v + MLP-in projection and the fused attention + MLP-out projection
    # (diffusers' _tp_plan of the blocks). "to_out" is a ModuleList in the double blocks: only its Linears are taken
    "Flux2": [
        *_JOINT_ATTENTION,
        "ff.linear_in",
        "ff.linear_out",
        "ff_context.linear_in",
        "ff_context.linear_out",
        "to_qkv_mlp_proj",
        "to_out",
    ],
    # HunyuanVideo15TransformerBlock: joint attention (video q/k/v/out, text add_q/k/v and to_add_out) and the video
    # and text feed-forwards; the same names take the text token refiner's attention and feed-forward
    # (context_embedder.token_refiner.refiner_blocks.N: to_q/k/v, to_out.0, ff.net.0.proj, ff.net.2)
    "HunyuanVideo15": [
        *_JOINT_ATTENTION,
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    ],
}


def default_lora_targets(transformer) -> list[str]:
    """The LoRA targets of the transformer's family (``DEFAULT_LORA_TARGETS``)."""
    base = _base_model(transformer)
    name = type(base).__name__
    prefixes = [p for p in DEFAULT_LORA_TARGETS if name.startswith(p)]
    if prefixes:
        targets = DEFAULT_LORA_TARGETS[max(prefixes, key=len)]  # "Flux2" before "Flux"
        # a name that is a Linear in some blocks and a container in others (FLUX.2's "to_out"): its Linears by full name
        mods = dict(base.named_modules())
        out = []
        for t in targets:
            hits = [n for n in mods if n == t or n.endswith("." + t)]
            if any(isinstance(mods[n], torch.nn.ModuleList) for n in hits):
                out += [n for n in hits if not isinstance(mods[n], torch.nn.ModuleList)]
            else:
                out.append(t)
        return out
    raise ValueError(f"no default LoRA targets for {name!r}; pass lora_target_modules explicitly")


def add_rcm_adapters(
    transformer,
    rank: int,
    alpha: float | None,
    target_modules=None,
    fake_rank: int | None = None,
    with_fake: bool = True,
):
    """Freeze ``transformer`` and add the peft adapters ``"student"`` (and ``"fake"``) (docs/math.md §6)."""
    from peft import LoraConfig

    transformer.requires_grad_(False)
    targets = list(target_modules or default_lora_targets(transformer))
    present = {n.rsplit(".", 1)[-1] for n, _ in transformer.named_modules()} | {
        n for n, _ in transformer.named_modules()
    }
    targets = [t for t in targets if any(n == t or n.endswith("." + t) for n in present)]
    configs = {"student": LoraConfig(r=rank, lora_alpha=alpha or rank, target_modules=targets, init_lora_weights=True)}
    if with_fake:
        fr = fake_rank or rank
        configs["fake"] = LoraConfig(
            r=fr, lora_alpha=(alpha or rank) * fr / rank, target_modules=targets, init_lora_weights=True
        )
    import warnings

    from peft.tuners.tuners_utils import cast_adapter_dtype

    for name, cfg in configs.items():
        with warnings.catch_warnings():
            # peft warns that a second adapter makes "multiple adapters in the model": two adapters on one frozen
            # base are the point here (docs/math.md §6), and the roles switch them explicitly (Networks.role)
            warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute", category=UserWarning)
            transformer.add_adapter(cfg, adapter_name=name)
        # float32 adapters on a bf16/fp16 base (peft's autocast_adapter_dtype; diffusers' add_adapter skips it):
        # in bf16 an AdamW step of lr 1e-5 on a weight of 1e-2 rounds away (spacing 6e-5), so LoRA would stop learning
        cast_adapter_dtype(transformer, name, autocast_adapter_dtype=True)
    for name in configs:
        for p in lora_parameters(transformer, name).values():
            p.requires_grad_(True)
    return configs


def lora_parameters(module, adapter: str) -> dict[str, torch.nn.Parameter]:
    """The named parameters of one peft adapter (``...lora_A.<adapter>.weight`` etc.)."""
    tag = f".{adapter}."
    return {n: p for n, p in module.named_parameters() if ("lora_" in n and tag in n)}


class Networks:
    """Teacher / student / fake score views (docs/math.md §6) with TrigFlow ``F``, ``x0`` and raw ``v``.

    ``modules`` maps role -> module to call (the accelerate-prepared one where trained).
    In shared mode all three roles map to the same module.
    """

    def __init__(self, modules: dict, mode: str, model_dtype: torch.dtype, time_input: str = "float"):
        if mode not in ("shared", "full"):
            raise ValueError(f"mode must be 'shared' (LoRA on one frozen base) or 'full', got {mode!r}")
        self.modules = modules
        self.mode = mode
        self.model_dtype = model_dtype
        self.time_input = time_input
        self._den = {
            role: TrigFlowDenoiser(velocity_fn(m, time_input), model_dtype=model_dtype) for role, m in modules.items()
        }
        self.has_fake = "fake" in modules
        # the teacher's CFG is QwenImagePipeline's norm-rescaled one (distill.terms.teacher_F)
        self.cfg_norm_rescale = model_class_name(modules["teacher"]) in CFG_NORM_RESCALE

    @classmethod
    def build(
        cls,
        transformer,
        mode: str,
        *,
        with_fake: bool,
        lora_rank: int = 16,
        lora_alpha=None,
        lora_target_modules=None,
        fake_lora_rank=None,
        time_input: str = "float",
    ):
        """Set up the roles on ``transformer`` (the teacher weights). Returns ``(networks, trainable)``
        where ``trainable`` maps ``"student"``/``"fake"`` to the module whose parameters train.
        ``time_input`` is how every role sees its time (``rcm_diffusers.models.network_timestep``)."""
        dtype = compute_dtype(transformer)
        if mode == "shared":
            add_rcm_adapters(transformer, lora_rank, lora_alpha, lora_target_modules, fake_lora_rank, with_fake)
            mods = {"teacher": transformer, "student": transformer}
            if with_fake:
                mods["fake"] = transformer
            return cls(mods, mode, dtype, time_input), {"shared": transformer}
        transformer.requires_grad_(False)
        student = copy.deepcopy(transformer).requires_grad_(True)
        mods = {"teacher": transformer, "student": student}
        trainable = {"student": student}
        if with_fake:
            fake = copy.deepcopy(transformer).requires_grad_(True)
            mods["fake"] = fake
            trainable["fake"] = fake
        return cls(mods, mode, dtype, time_input), trainable

    def replace_modules(self, prepared: dict) -> None:
        """Point roles at accelerate-prepared modules (``prepared`` keyed like ``build``'s ``trainable``)."""
        if self.mode == "shared":
            m = prepared["shared"]
            self.modules = {r: m for r in self.modules}
        else:
            self.modules = {**self.modules, **prepared}
        self._den = {
            role: TrigFlowDenoiser(velocity_fn(m, self.time_input), model_dtype=self.model_dtype)
            for role, m in self.modules.items()
        }

    def trainable_parameters(self, role: str) -> dict[str, torch.nn.Parameter]:
        """The parameters trained for ``role`` (adapter weights in shared mode)."""
        m = _base_model(self.modules[role])
        if self.mode == "shared":
            return lora_parameters(m, role)
        return {n: p for n, p in m.named_parameters()}

    @contextlib.contextmanager
    def role(self, role: str):
        """Activate ``role``: adapters disabled for the teacher, the role's adapter otherwise."""
        if role not in self.modules:
            raise KeyError(f"no network for role {role!r}; have {sorted(self.modules)}")
        if self.mode != "shared":
            yield self._den[role]
            return
        base = _base_model(self.modules[role])
        layers = self._tuner_layers(base)
        before = [(m._disable_adapters, m._active_adapter) for m in layers]
        # Plain attribute switches (no requires_grad_ as peft's set_adapter does), so a role can be
        # activated inside torch.func.jvp and the optimizer/DDP parameter sets never change.
        for m in layers:
            if role == "teacher":
                m._disable_adapters = True
            else:
                m._disable_adapters = False
                m._active_adapter = [role]
        try:
            yield self._den[role]
        finally:
            for m, (d, a) in zip(layers, before):
                m._disable_adapters, m._active_adapter = d, a

    def _tuner_layers(self, base):
        key = id(base)
        if getattr(self, "_layers_key", None) != key:
            from peft.tuners.tuners_utils import BaseTunerLayer

            self._layers = [m for m in base.modules() if isinstance(m, BaseTunerLayer)]
            self._layers_key = key
        return self._layers

    def F(self, role: str, x_t, t, cond):
        """TrigFlow velocity ``F_hat`` of ``role`` at ``(x_t, t)`` (docs/math.md §1)."""
        with self.role(role) as d:
            return d.F(x_t, t, **cond)

    def v(self, role: str, x_t, t, cond):
        """The raw model velocity ``v`` of ``role`` at TrigFlow ``(x_t, t)`` (``TrigFlowDenoiser.velocity``)."""
        with self.role(role) as d:
            return d.velocity(x_t, t, **cond)

    def x0(self, role: str, x_t, t, cond):
        """``x0_hat`` of ``role`` at ``(x_t, t)`` (docs/math.md §1)."""
        with self.role(role) as d:
            return d.x0(x_t, t, **cond)

    def F_fn(self, role: str, cond):
        """``F(x_t, t)`` closure for the losses; switches the adapter on every call (JVP-safe)."""
        return lambda x_t, t: self.F(role, x_t, t, cond)

    def x0_fn(self, role: str, cond):
        """``x0(x_t, t)`` closure for backward simulation."""
        return lambda x_t, t: self.x0(role, x_t, t, cond)
