"""Memory model of rCM training (docs/math.md §4, §6): how many bytes a configuration needs, part by part.

``predict_training(TrainSetup(...))`` returns, in bytes and GiB (``total`` = weights + trainable + grads + optimizer +
ema + step_peak + overhead):

* ``weights``: the frozen base (teacher; also the shared base of student and fake in LoRA mode),
  ``n_params x bytes(weight_dtype)``;
* ``trainable``: LoRA adapters (student + fake score, float32 as peft keeps them) or, in ``full``
  mode, the two full trainable copies (float32 master weights);
* ``grads``: one role's gradients at a time (the trainer zeroes with ``set_to_none``);
* ``optimizer``: AdamW's two float32 moments for student and fake score;
* ``ema``: the float32 power-EMA shadow of the student;
* ``activations``: what autograd saves in the one grad-enabled forward of a step (the sCM/DMD
  student pass, or the fake-score pass), all blocks; with gradient checkpointing (``checkpointing_policy``
  ``full``) the block inputs plus one block's recomputed activations; with ``selective`` (Wan;
  ``rcm_diffusers.distill.activation_checkpointing``) also every block's matrix-product and attention outputs, the
  recompute working set of one block then being the rest of that block (``checkpoint_held`` gives what is held
  between the forward and the backward);
* ``backward`` / ``forward`` / ``nograd``: working sets on top of what a phase holds (``WORKING_SETS``,
  measured): a block's backward beyond its recompute, a grad-enabled block forward beyond what it saves, a no-grad
  forward (teacher, fake score);
* ``jvp``: the no-grad ``torch.func.jvp`` pass (fd_type 0/1; ``jvp_bytes``): primal and tangent of one block's
  feed-forward (``JVP_COEFFS``, nothing saved across blocks) or the condition embedder's weight copies, whichever is
  larger, and on CPU the chunked attention's score matrices (``JVP_CPU_ATTENTION``);
* ``cp_exchange``: Ulysses context parallelism (``context_parallel`` P > 1): the send and receive buffers of one
  all-to-all (the exchanges run one tensor at a time and free their buffers before the next);
* ``step_peak``: the largest phase of a step on top of the grads: ``activations + backward`` (a grad-enabled
  forward and its backward), the held part of the activations + ``nograd`` (the DMD term's no-grad calls while the
  student's DMD forward is saved), or ``jvp + cp_exchange`` (the JVP pass runs before the sCM term's grad-enabled
  forward, so the two do not add up);
* ``overhead``: runtime (CUDA context or the CPU process with torch + diffusers imported).

Context parallelism divides the video tokens of a sample over ``P`` ranks: every per-token term above (the saved
activations, the checkpointed block inputs, the JVP working set) counts ``tokens / P``; attention after the
all-to-all holds all tokens of ``H / P`` heads, the same bytes. The text tokens (cross-attention keys/values) and the
per-block modulation stay whole on every rank (counted per rank on a CP group of 2 gloo processes:
tests/test_memory_model.py, docs/benchmarks.md). Gradient accumulation (``gradient_accumulation_steps``) keeps one
micro-batch of ``batch`` samples in flight: activations are those of ``batch``; gradients accumulate in place.
``per_rank`` gives the bytes per process with the frozen base sharded over the processes (FSDP2).

Activation coefficients (bytes saved per token per block, in units of the model width ``D`` and
the feed-forward width ``F``) were counted with ``torch.autograd.graph.saved_tensors_hooks`` on the
real diffusers Wan / Flux / Qwen-Image / FLUX.2 / HunyuanVideo-1.5 blocks at small sizes
(``saved_activation_bytes``); tests validate them on held-out sizes, and ``benchmarks/real_arch.py`` against peak
RSS at the real width.
Parameter counts are exact (the architecture built on the meta device, adapters added by peft).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time

import torch

__all__ = [
    "TrainSetup",
    "predict_training",
    "per_rank",
    "saved_activation_bytes",
    "checkpoint_held",
    "checkpoint_held_bytes",
    "held_bytes",
    "working_set",
    "allocation_trace",
    "AllocationTrace",
    "WORKING_SETS",
    "DEVICES",
    "fits",
    "ACT_COEFFS",
    "SELECTIVE_COEFFS",
    "JVP_COEFFS",
    "JVP_CPU_ATTENTION",
    "jvp_bytes",
    "weight_parts",
    "linear_weight_bytes",
    "host_activation_bytes",
    "CARDS",
    "LINKS",
    "PASS_COST",
    "passes_per_iteration",
    "block_flops",
    "step_time",
    "with_lora_rank",
    "setting_text",
    "cheapest_fitting",
]

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

#: bytes autograd saves per block, per image/video token ``per_D D + per_F F + per_head H + per_r r + per_tok`` (H
#: heads, r the LoRA rank), per text token ``txt_D D + txt_r r + txt`` (Wan cross-attention K/V), per block
#: ``layer_D D + r (layer_rD D + layer_rF F)``, and for attention masks ``(per_L2 + per_head_L2 H) L^2`` (L the tokens
#: of the block's attention). Keyed by weight dtype; bfloat16 means bf16 weights under bf16 autocast
#: (``mixed_precision: bf16``, as the shipped configs) with float32 LoRA adapters.
ACT_COEFFS = {
    # Wan block, counted with ``saved_activation_bytes`` (diffusers 0.42, peft 0.21, torch 2.13, the JVP attention
    # processors; norms, modulation and RoPE in float32 as from_pretrained keeps them) at D 512 / 1536 / 3072 / 5120,
    # F 1024 / 8960 / 13824, r 4 / 32 / 64, as differences of 1- and 2-block models and of token and text counts; the
    # terms are exact there. per_head: the float32 log-sum-exp of both attentions; layer_D: the float32 modulation;
    # bf16 layer_r*: autocast's bf16 copies of the float32 LoRA weights, saved for the backward
    "wan": {
        "float32": {
            "per_D": 60.0,
            "per_F": 8.0,
            "per_head": 8.0,
            "per_r": 32.0,
            "per_tok": 36.0,
            "txt_D": 12.0,
            "txt_r": 8.0,
            "txt": 4.0,
            "layer_D": 32.0,
        },
        "bfloat16": {
            "per_D": 50.0,
            "per_F": 4.0,
            "per_head": 8.0,
            "per_r": 16.0,
            "per_tok": 36.0,
            "txt_D": 12.0,
            "txt_r": 4.0,
            "txt": 4.0,
            "layer_D": 32.0,
            "layer_rD": 32.0,
            "layer_rF": 4.0,
        },
    },
    # Flux double block (both streams, per token of either) and single block (concatenated tokens), F = 4 D in per_D;
    # counted the same way at D 512 / 1536 / 3072 (image and text tokens save the same), LoRA r32 (per_tok holds its
    # rank terms); the per-block constants are not counted
    "flux_double": {
        "float32": {"per_D": 72.0, "per_head": 12.0, "per_tok": 784.0},
        "bfloat16": {"per_D": 46.0, "per_head": 12.0, "per_tok": 392.0},
    },
    "flux_single": {
        "float32": {"per_D": 68.0, "per_head": 12.0, "per_tok": 648.0},
        "bfloat16": {"per_D": 44.0, "per_head": 12.0, "per_tok": 324.0},
    },
    # Qwen-Image, FLUX.2 [dev] and HunyuanVideo-1.5 blocks, counted with ``saved_activation_bytes`` as FLUX.1's
    # (diffusers 0.42, peft 0.21, torch 2.13, stock attention processors, float32-kept modules as from_pretrained keeps
    # them, student and fake LoRA, bf16 under bf16 autocast) at D 128 / 256 / 512 (2 or 4 heads of 64 or 128),
    # r 4 / 32, as differences of 1- and 2-block models and of image (video) and text token counts; every term is exact
    # there and at the held-out D 384, r 8 (``benchmarks/activation_terms.py --family qwen|flux2|hunyuan15``; the whole
    # tiny models within 1 %: tests/test_memory_model.py). Per token of either stream (image and text tokens save the
    # same); the feed-forward is in per_D: 4 D GELU (Qwen-Image, HunyuanVideo-1.5), FLUX.2's SwiGLU 3 D wide (a 6 D
    # up-projection); per_r: the LoRA down-projections; per_head: the attention's float32 per-head terms; layer_D: the
    # modulation each block saves; bf16 layer_rD: autocast's bf16 copies of the float32 LoRA weights
    "qwen_double": {
        "float32": {"per_D": 72.0, "per_head": 12.0, "per_r": 24.0, "per_tok": 16.0, "layer_D": 64.0},
        "bfloat16": {"per_D": 50.0, "per_head": 12.0, "per_r": 12.0, "per_tok": 8.0, "layer_D": 32.0, "layer_rD": 72.0},
    },
    # FLUX.2: the modulation is shared by all blocks (computed once outside them), so a block saves little of it
    "flux2_double": {
        "float32": {"per_D": 88.0, "per_head": 12.0, "per_r": 24.0, "per_tok": 16.0, "layer_D": 16.0},
        "bfloat16": {"per_D": 54.0, "per_head": 12.0, "per_r": 12.0, "per_tok": 8.0, "layer_D": 8.0, "layer_rD": 76.0},
    },
    "flux2_single": {
        "float32": {"per_D": 84.0, "per_head": 12.0, "per_r": 8.0, "per_tok": 8.0, "layer_D": 4.0},
        "bfloat16": {"per_D": 50.0, "per_head": 12.0, "per_r": 4.0, "per_tok": 4.0, "layer_D": 2.0, "layer_rD": 30.0},
    },
    # HunyuanVideo-1.5 double-stream block as the trainer runs it (``rcm_diffusers.attention.hunyuan15``: the context's
    # padding mask as a key mask [B, 1, 1, L]): Qwen-Image's terms plus the additive key mask attention saves, b bytes
    # per token of the block's attention (video + context tokens L) in per_tok
    "hunyuan15_double": {
        "float32": {"per_D": 72.0, "per_head": 12.0, "per_r": 24.0, "per_tok": 20.0, "layer_D": 64.0},
        "bfloat16": {
            "per_D": 50.0,
            "per_head": 12.0,
            "per_r": 12.0,
            "per_tok": 10.0,
            "layer_D": 32.0,
            "layer_rD": 72.0,
        },
    },
    # HunyuanVideo-1.5 token refiner block (the Qwen2.5-VL prompt tokens T only: 4 D MLP, self-attention with the
    # prompt's key mask [B, 1, 1, T], saved additive: b bytes per token in per_tok); not checkpointed
    "hunyuan15_refiner": {
        "float32": {"per_D": 64.0, "per_head": 4.0, "per_r": 24.0, "per_tok": 20.0, "layer_D": 8.0},
        "bfloat16": {"per_D": 38.0, "per_head": 4.0, "per_r": 12.0, "per_tok": 10.0, "layer_D": 4.0, "layer_rD": 36.0},
    },
    # the same blocks with diffusers' stock processors (``TrainSetup.dense_attention_mask``), which pass attention a
    # dense mask: the double-stream block's [B, 1, L, L] is saved as an additive mask in the activation dtype (per_L2:
    # 4 bytes float32, 2 bf16), the refiner's repeated over the heads, [B, H, T, T] (per_head_L2); neither saves the
    # key mask's b bytes per token
    "hunyuan15_double_dense_mask": {
        "float32": {"per_D": 72.0, "per_head": 12.0, "per_r": 24.0, "per_tok": 16.0, "layer_D": 64.0, "per_L2": 4.0},
        "bfloat16": {
            "per_D": 50.0,
            "per_head": 12.0,
            "per_r": 12.0,
            "per_tok": 8.0,
            "layer_D": 32.0,
            "layer_rD": 72.0,
            "per_L2": 2.0,
        },
    },
    "hunyuan15_refiner_dense_mask": {
        "float32": {"per_D": 64.0, "per_head": 4.0, "per_r": 24.0, "per_tok": 16.0, "layer_D": 8.0, "per_head_L2": 4.0},
        "bfloat16": {
            "per_D": 38.0,
            "per_head": 4.0,
            "per_r": 12.0,
            "per_tok": 8.0,
            "layer_D": 4.0,
            "layer_rD": 36.0,
            "per_head_L2": 2.0,
        },
    },
}

#: bytes the ``selective`` checkpointing policy keeps per Wan block
#: (``rcm_diffusers.distill.activation_checkpointing``), by activation bytes ``b`` (4 float32, 2 bf16 weights or bf16
#: autocast): per video token ``(9 D + F) b`` (q, k, v of self-attention, both attention outputs, both out-projections,
#: the cross-attention query, the feed-forward up (F) and down projections), ``8 r b`` (the ``lora_A`` outputs of the 8
#: adapted token projections, rank r) and 4 bytes per head and attention for the float32 log-sum-exp; per text token
#: ``2 D b + 2 r b`` (cross-attention K, V and their ``lora_A``). Counted from the ops the policy keeps; checked against
#: the cached tensors (``checkpoint_held_bytes``) in tests/test_memory_model.py.
SELECTIVE_COEFFS = {"per_D": 9, "per_F": 1, "per_r": 8, "txt_D": 2, "txt_r": 2, "lse_per_head": 2 * 4}

#: working sets on top of what a phase holds, bytes per video token (Flux: per token of either stream) in units of
#: the activation bytes ``b`` (4 float32, 2 under bf16 autocast) times ``per_F * F + per_D * D``: a no-grad forward
#: (teacher, fake score) and a block's backward beyond its recompute. Fitted on peaks traced with
#: ``allocation_trace`` (``benchmarks/memory_peaks.py``) at the Wan2.1-1.3B width (2 blocks, 1600 video tokens) and the
#: 14B width (1 block, 576 tokens) in float32, the bf16 no-grad set scaled by the one bf16 point (1.3B width, 784
#: tokens: bf16 autocast keeps norms and modulation in float32); checked on other token counts (docs/benchmarks.md).
WORKING_SETS = {
    "float32": {
        "nograd": {"per_F": 2.93, "per_D": 5.19},
        "backward": {"per_F": 1.98, "per_D": 0.23},
        "forward": {"per_F": 0.0, "per_D": 0.0},
    },
    "bfloat16": {
        "nograd": {"per_F": 4.07, "per_D": 7.21},
        "backward": {"per_F": 1.98, "per_D": 0.23},
        "forward": {"per_F": 3.01, "per_D": 5.34},
    },
}

#: what HunyuanVideo-1.5's joint attention masks add to the working sets, bytes per squared token count L^2 of a
#: block's attention (video + context tokens) and sample. The trainer's key-padding masks ([B, 1, 1, L],
#: ``rcm_diffusers.attention.hunyuan15``) add nothing quadratic. With diffusers' stock processors
#: (``TrainSetup.dense_attention_mask``) each block's attention builds two [B, 1, L, L] bool masks (the context mask
#: repeated over the rows, and it and its transpose), alive through the attention of every forward (2 bytes), and SDPA
#: converts them into an additive mask in the activation dtype (``b`` bytes), which a grad-enabled forward saves
#: (``ACT_COEFFS["hunyuan15_double_dense_mask"]["per_L2"]``) and a no-grad forward frees after the block. Traced with
#: ``allocation_trace`` on 1-block tiny models (L 4357 / 8453, CPU): a grad-enabled forward's transient 1.77 / 1.92 L^2
#: beyond what it saves (float32 / bf16), its backward nothing quadratic, a no-grad forward 6.3 / 4.2 L^2 (L 5089 /
#: 9185)
HUNYUAN15_MASK_WORKING_SETS = {"nograd": 0.0, "forward": 0.0, "backward": 0.0}
HUNYUAN15_DENSE_MASK_WORKING_SETS = {"nograd": 2.0, "forward": 2.0, "backward": 0.0}

#: the JVP pass (fd_type 0/1), which holds no activations across blocks: its token-bound peak is a block's primal and
#: tangent feed-forward, ``b (per_F F + per_D D)`` per video token (Flux: per token of either stream) plus ``txt_D D b``
#: per Wan text token, fitted in float32 on traces at the 1.3B, 5B and 14B widths (F 8960 / 14336 / 13824, D 1536 /
#: 3072 / 5120, 784-2304 tokens: within 0.5 % of each; fitted on the first two widths only, 0.98 at the 14B width) with
#: the CPU attention chunk small enough that no score matrix enters. Under bf16 autocast the same tensors take 2 bytes
#: (the slope halves exactly at the 1.3B width) and the peak holds ``per_FD F D b`` more, bytes that scale with the
#: feed-forward's weight (3.05 / 3.23 F D bytes at the 1.3B / 5B widths, fitted, not traced to an op). The pass also
#: holds at least the weight copies of the condition embedder (``_jvp_weight_copies``); the larger of the two counts.
JVP_COEFFS = {
    "float32": {"per_F": 7.17, "per_D": 7.68, "txt_D": 1.12, "per_FD": 0.0},
    "bfloat16": {"per_F": 7.17, "per_D": 7.68, "txt_D": 1.12, "per_FD": 1.57},
}
#: the CPU attention JVP (``attention/torch_backend.py``, chunks of ``TrainSetup.cpu_attention_chunk`` query rows) holds
#: ``scores`` score-sized matrices ``[heads, min(chunk, L), L]`` at once (S, P, tS, P tS and a temporary) beside
#: ``per_D D b`` per token of inputs, tangents and outputs; a GPU flash kernel holds no such matrix, so only
#: ``device="cpu"`` counts it. Fitted on the 1.3B width (1156 / 1600 tokens, chunks 1024 / 2048; within 1.4 %).
JVP_CPU_ATTENTION = {"per_D": 13.97, "scores": 4.83}

#: device name -> usable bytes
DEVICES = {
    "H200 (141 GB)": 141e9,
    "80 GB (A100/H100)": 80e9,
    "48 GB (L40S / RTX 6000 Ada)": 48e9,
    "24 GB (RTX 4090)": 24e9,
}
POLICIES = ("full", "selective")


@dataclasses.dataclass
class TrainSetup:
    """One training configuration (per process, before any sharding)."""

    family: str  # "wan" | "flux" | "qwen" (Qwen-Image) | "flux2" (FLUX.2) | "hunyuan15" (HunyuanVideo-1.5)
    dim: int  # model width D = heads * head_dim
    ffn_dim: int
    num_layers: int  # Wan blocks / double-stream blocks
    num_single_layers: int  # Flux / FLUX.2 single blocks (0 for the others)
    params: int  # frozen base parameters
    lora_params_student: int
    lora_params_fake: int
    tokens: int  # image/video tokens per sample
    text_tokens: int
    batch: int = 1
    weight_dtype: str = "bfloat16"
    gradient_checkpointing: bool = True
    fd_type: int = 0
    mode: str = "shared"  # "shared" (LoRA on one frozen base) | "full" (three networks)
    ema: bool = True
    experts: int = 1  # networks resident at once: Wan2.2 A14B with both experts in one run (docs/math.md §6.1) holds 2
    #                   bases and 2 sets of adapters/optimizer/EMA; a batch is split between them, so activations do
    #                   not grow
    context_parallel: int = 1  # Ulysses group size P: each rank holds tokens / P of every sample
    gradient_accumulation_steps: int = 1  # micro-batches of `batch` per optimizer step: no extra memory (see above)
    checkpointing_policy: str = "full"  # with gradient_checkpointing: "full" | "selective" (Wan)
    lora_rank: int = 64  # LoRA rank (the selective policy keeps the lora_A outputs, rank wide)
    head_dim: int = 128  # attention head dimension (selective: the log-sum-exp per head; Wan RoPE tables)
    text_dim: int = 4096  # width of the text encoder states the condition embedder projects (Wan: umT5)
    cpu_attention_chunk: int = 1024  # query rows per chunk of the CPU attention JVP (counted with device="cpu" only)
    # training on one card (rcm_diffusers.distill.lowmem): the format of the frozen block Linear weights, the blocks
    # per network whose frozen Linear weights live on the host, the checkpointed block inputs on the host
    base_dtype: str = "weight_dtype"  # "weight_dtype" | "fp8" | "int8"
    blocks_to_swap: int = 0
    activation_offload: bool = False
    block_linears: tuple = ()  # per block, the (out, in) of its frozen Linears (from_config fills it; the weight terms)
    # the schedule of an iteration (the time model, ``step_time``): student every this many iterations, backward
    # simulation of 1..max_simulation_steps student steps, the DMD term and the fake score on or off
    student_update_freq: int = 5
    max_simulation_steps: int = 4
    use_dmd: bool = True
    # HunyuanVideo-1.5's token refiner: its blocks and the prompt tokens they run on (not checkpointed)
    refiner_layers: int = 0
    refiner_tokens: int = 0
    # HunyuanVideo-1.5 with diffusers' stock attention processors (dense [B, 1, L, L] masks); the trainer runs
    # key-padding masks (rcm_diffusers.attention.hunyuan15), the default
    dense_attention_mask: bool = False

    @classmethod
    def from_config(
        cls,
        config: dict,
        class_name: str,
        *,
        tokens: int,
        text_tokens: int,
        batch: int = 1,
        lora_rank: int = 64,
        weight_dtype: str = "bfloat16",
        gradient_checkpointing: bool = True,
        fd_type: int = 0,
        mode: str = "shared",
        ema: bool = True,
        experts: int = 1,
        context_parallel: int = 1,
        gradient_accumulation_steps: int = 1,
        checkpointing_policy: str = "full",
        **one_card,
    ) -> "TrainSetup":
        """From a diffusers transformer config (``rcm_diffusers.arch.arch_config``); parameter counts exact.
        ``one_card``: ``base_dtype``, ``blocks_to_swap``, ``activation_offload`` and the schedule fields."""
        family = {
            "QwenImageTransformer2DModel": "qwen",
            "Flux2Transformer2DModel": "flux2",
            "HunyuanVideo15Transformer3DModel": "hunyuan15",
        }.get(class_name, "flux" if class_name.startswith("Flux") else "wan")
        refiner = {}
        if family == "hunyuan15":  # the token refiner runs on the Qwen2.5-VL prompt tokens alone
            from ..models import HUNYUAN15_CONTEXT_EXTRA

            refiner = dict(
                refiner_layers=config.get("num_refiner_layers", 0),
                refiner_tokens=max(text_tokens - HUNYUAN15_CONTEXT_EXTRA, 0),
            )
        items = tuple(sorted((k, _hashable(v)) for k, v in config.items()))
        counts = _counts(class_name, items, lora_rank)
        one_card.setdefault("block_linears", _block_linears(class_name, items))
        D = config["num_attention_heads"] * config["attention_head_dim"]
        return cls(
            family=family,
            dim=D,
            ffn_dim=config["ffn_dim"] if family == "wan" else 4 * D,  # FLUX.2 (SwiGLU, 3 D): 4 D in the working sets
            num_layers=config["num_layers"],
            num_single_layers=config.get("num_single_layers", 0) if family in ("flux", "flux2") else 0,
            params=counts[0],
            lora_params_student=counts[1],
            lora_params_fake=counts[2],
            tokens=tokens,
            text_tokens=text_tokens,
            batch=batch,
            weight_dtype=weight_dtype,
            gradient_checkpointing=gradient_checkpointing,
            fd_type=fd_type,
            mode=mode,
            ema=ema,
            experts=experts,
            context_parallel=context_parallel,
            gradient_accumulation_steps=gradient_accumulation_steps,
            checkpointing_policy=checkpointing_policy,
            lora_rank=lora_rank if mode == "shared" else 0,
            head_dim=config["attention_head_dim"],
            text_dim=config.get("text_dim", config.get("joint_attention_dim", config.get("text_embed_dim", 4096))),
            **refiner,
            **one_card,
        )

    @classmethod
    def from_arch(cls, name: str, **kw) -> "TrainSetup":
        """``from_config`` of a shipped architecture (``rcm_diffusers/arch_configs``)."""
        from ..arch import arch_config, arch_meta

        return cls.from_config(arch_config(name), arch_meta(name)["class_name"], **kw)


def _hashable(v):
    return tuple(v) if isinstance(v, list) else v


@functools.lru_cache(maxsize=64)
def _counts(class_name: str, items: tuple, lora_rank: int) -> tuple[int, int, int]:
    import diffusers

    from .adapters import default_lora_targets

    cfg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in items}
    with torch.device("meta"):
        m = getattr(diffusers, class_name)(**cfg)
    base = sum(p.numel() for p in m.parameters())
    # what peft adds per targeted nn.Linear (lora_A: r x in, lora_B: out x r), matched as add_rcm_adapters does;
    # counted here instead of calling peft, which would allocate the adapters for real (GBs for 14B)
    targets = default_lora_targets(m)
    lora = sum(
        lora_rank * (mod.in_features + mod.out_features)
        for name, mod in m.named_modules()
        if isinstance(mod, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets)
    )
    return base, lora, lora


@functools.lru_cache(maxsize=64)
def _block_linears(class_name: str, items: tuple) -> tuple:
    """Per transformer block, the ``(out, in)`` of its ``nn.Linear`` layers (the meta-device build)."""
    import diffusers

    from ..models import transformer_blocks

    cfg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in items}
    with torch.device("meta"):
        m = getattr(diffusers, class_name)(**cfg)
    return tuple(
        tuple((mod.out_features, mod.in_features) for mod in b.modules() if type(mod) is torch.nn.Linear)
        for b in transformer_blocks(m)
    )


def _block_bytes(coeffs: dict, s: TrainSetup, tokens: int, text_tokens: int) -> float:
    """``ACT_COEFFS`` of one block: what autograd saves for ``tokens`` video/image and ``text_tokens`` text tokens."""
    c = coeffs[_dtype_key(s)]
    g = lambda k: c.get(k, 0.0)  # noqa: E731
    D, F, r, H = s.dim, s.ffn_dim, s.lora_rank, s.dim // s.head_dim
    per_token = g("per_D") * D + g("per_F") * F + g("per_head") * H + g("per_r") * r + g("per_tok")
    per_text = g("txt_D") * D + g("txt_r") * r + g("txt")
    masks = (g("per_L2") + g("per_head_L2") * H) * tokens**2  # attention masks [B, 1 or H, L, L]
    return s.batch * (
        tokens * per_token
        + text_tokens * per_text
        + masks
        + g("layer_D") * D
        + r * (g("layer_rD") * D + g("layer_rF") * F)
    )


def _dtype_key(s: TrainSetup) -> str:
    """Which coefficient table applies: ``float32``, or ``bfloat16`` for 16-bit weights under autocast."""
    return "float32" if s.weight_dtype == "float32" else "bfloat16"


def _stream_tokens(s: TrainSetup) -> int:
    """Tokens one rank's blocks carry: its video tokens (Wan), or image and text tokens (Flux's joint stream)."""
    return _rank_tokens(s) + (s.text_tokens if s.family != "wan" else 0)


def _rank_tokens(s: TrainSetup) -> int:
    """Video/image tokens one rank holds: ``tokens / context_parallel`` (rounded up)."""
    return -(-s.tokens // s.context_parallel)


def _selective_block_bytes(s: TrainSetup) -> float:
    """Bytes the ``selective`` policy keeps for one Wan block (``SELECTIVE_COEFFS``)."""
    c, b = SELECTIVE_COEFFS, DTYPE_BYTES[s.weight_dtype]
    heads = s.dim // s.head_dim
    return s.batch * (
        _rank_tokens(s)
        * (b * (c["per_D"] * s.dim + c["per_F"] * s.ffn_dim + c["per_r"] * s.lora_rank) + c["lse_per_head"] * heads)
        + s.text_tokens * b * (c["txt_D"] * s.dim + c["txt_r"] * s.lora_rank)
    )


def _head_bytes(s: TrainSetup) -> float:
    """What the output head (final norm and projection, outside the blocks) saves: the float32 copy of the last hidden
    states its layer norm keeps, ``4 D`` bytes per token in either dtype (Wan's ``norm_out`` is an ``FP32LayerNorm``;
    autocast runs Flux's layer norm in float32); its projection's weight is frozen, so its input is not saved."""
    return float(s.batch * _stream_tokens(s) * s.dim * 4)


def checkpoint_held(s: TrainSetup) -> float:
    """Bytes the checkpointed blocks hold between the grad-enabled forward and its backward (gradient checkpointing
    on): every block's input hidden states, the block arguments shared by all blocks (Wan: text states, float32 RoPE
    tables and modulation), and with ``selective`` every block's kept outputs (``SELECTIVE_COEFFS``)."""
    if s.checkpointing_policy not in POLICIES:
        raise ValueError(f"checkpointing_policy must be one of {POLICIES}, got {s.checkpointing_policy!r}")
    if s.checkpointing_policy == "selective" and s.family != "wan":
        raise ValueError("the selective checkpointing policy is modelled for Wan only")
    blocks = s.num_layers + s.num_single_layers
    held = 0.0 if s.activation_offload else _checkpoint_inputs(s)  # activation_offload: on the host instead
    if s.family == "wan":  # RoPE cos / sin (float32, per token and head dim): a non-tensor block argument, kept as is
        held += 2 * _rank_tokens(s) * s.head_dim * 4
    if s.checkpointing_policy == "selective":
        held += blocks * _selective_block_bytes(s)
    return float(held)


def _checkpoint_inputs(s: TrainSetup, blocks: int | None = None) -> float:
    """The tensor inputs the checkpointed blocks keep: each block's input hidden states and (Wan) the text states and
    the float32 modulation input (6 D) that every block shares; ``blocks`` of them (default all)."""
    mb = DTYPE_BYTES[s.weight_dtype]
    n = s.num_layers + s.num_single_layers if blocks is None else blocks
    held = n * s.batch * _stream_tokens(s) * s.dim * mb
    if s.family == "wan":
        held += s.batch * (s.text_tokens * s.dim * mb + 6 * s.dim * 4)
    return float(held)


def host_activation_bytes(s: TrainSetup) -> float:
    """Bytes ``activation_offload`` keeps on the host per grad-enabled forward (0 without it): every block's input
    hidden states, the shared text states and modulation input once (one copy per distinct tensor), and the output
    head's saved input (``rcm_diffusers.distill.lowmem.HostActivations``)."""
    return _checkpoint_inputs(s) + _head_bytes(s) if s.activation_offload else 0.0


def activation_bytes(s: TrainSetup) -> tuple[float, float]:
    """``(saved, one_block)``: bytes autograd saves in one grad-enabled forward, and the largest
    single block's share (the recompute working set under gradient checkpointing)."""
    if s.context_parallel > 1 and s.family != "wan":
        raise ValueError("context parallelism is implemented for Wan only")
    if s.family == "wan":
        blocks = [(ACT_COEFFS["wan"], _rank_tokens(s), s.text_tokens)] * s.num_layers
    else:
        n = s.tokens + s.text_tokens  # both streams (double) / concatenated (single)
        dense = "_dense_mask" if s.dense_attention_mask else ""
        double, single = {"qwen": ("qwen_double", None), "hunyuan15": ("hunyuan15_double" + dense, None)}.get(
            s.family, (s.family + "_double", s.family + "_single")
        )
        blocks = [(ACT_COEFFS[double], n, 0)] * s.num_layers
        if single:
            blocks += [(ACT_COEFFS[single], n, 0)] * s.num_single_layers
    sizes = [_block_bytes(c, s, t, tt) for c, t, tt in blocks]
    one = max(sizes) if sizes else 0.0
    if not s.gradient_checkpointing:  # Wan: the float32 RoPE cos / sin tables, once for all blocks; the head's saved
        # copy of the last hidden states is the last block's share (each block's coefficients count the copy of its
        # output that its consumer saves: outside the blocks, a Wan forward saves the RoPE tables alone)
        rope = 2 * s.batch * _rank_tokens(s) * s.head_dim * 4 if s.family == "wan" else 0
        return float(sum(sizes) + rope + _unchecked_bytes(s)), one
    held = held_bytes(s)
    if s.activation_offload:  # the block the backward recomputes has its inputs back on the device
        held += _checkpoint_inputs(s, 1)
    if s.checkpointing_policy == "selective":  # the recompute re-uses the kept outputs of the block it runs
        return held + max(one - _selective_block_bytes(s), 0.0), one
    return held + one, one


def working_set(s: TrainSetup, name: str) -> float:
    """``WORKING_SETS[name]`` of setup ``s``: ``tokens b (per_F F + per_D D)`` with the rank's tokens (Flux: image and
    text tokens) and the activation bytes ``b``; HunyuanVideo-1.5 also its attention masks
    (``HUNYUAN15_MASK_WORKING_SETS``; with ``dense_attention_mask`` ``HUNYUAN15_DENSE_MASK_WORKING_SETS``)."""
    c, b = WORKING_SETS[_dtype_key(s)][name], DTYPE_BYTES[s.weight_dtype]
    masks = 0.0
    if s.family == "hunyuan15":  # the attention masks of one block
        per_L2 = HUNYUAN15_MASK_WORKING_SETS[name]
        if s.dense_attention_mask:  # the bool masks, and the additive one a no-grad forward frees after the block
            per_L2 = HUNYUAN15_DENSE_MASK_WORKING_SETS[name] + (b if name == "nograd" else 0)
        masks = per_L2 * _stream_tokens(s) ** 2
    return float(s.batch * (_stream_tokens(s) * b * (c["per_F"] * s.ffn_dim + c["per_D"] * s.dim) + masks))


def held_bytes(s: TrainSetup) -> float:
    """Bytes a grad-enabled forward leaves for its backward: all saved activations without checkpointing; with it,
    ``checkpoint_held`` and the output head's saved input (the recompute comes in the backward)."""
    if not s.gradient_checkpointing:
        if s.activation_offload:
            raise ValueError(
                "activation_offload keeps the checkpointed block inputs on the host: it needs gradient checkpointing"
            )
        return activation_bytes(s)[0]
    return checkpoint_held(s) + (0.0 if s.activation_offload else _head_bytes(s)) + _unchecked_bytes(s)


def _unchecked_bytes(s: TrainSetup) -> float:
    """What a forward saves outside the checkpointed blocks, kept until the backward with or without checkpointing:
    HunyuanVideo-1.5's token refiner (``hunyuan15_refiner``, run before the blocks) and Qwen-Image's complex64 RoPE
    table (4096 positions x head_dim / 2, of which the text tokens' rotary embedding is a view); 0 otherwise."""
    if s.family == "qwen":
        return float(4096 * (s.head_dim // 2) * 8)
    if s.family == "hunyuan15" and s.refiner_layers:
        key = "hunyuan15_refiner_dense_mask" if s.dense_attention_mask else "hunyuan15_refiner"
        return s.refiner_layers * _block_bytes(ACT_COEFFS[key], s, s.refiner_tokens, 0)
    return 0.0


def predict_training(s: TrainSetup, device: str = "cuda") -> dict:
    """Bytes per process of one rCM training step of setup ``s`` (see the module docstring for the
    parts); ``total_gib`` is their sum. ``device`` picks the runtime overhead (``cuda`` | ``cpu``)."""
    wb = DTYPE_BYTES[s.weight_dtype]
    parts = weight_parts(s)
    out = {"weights": parts["device"], "dequant": parts["dequant"]}
    if s.mode == "shared":
        stu, fake = s.lora_params_student * s.experts, s.lora_params_fake * s.experts
    elif s.mode == "full":
        stu = fake = s.params * s.experts
    else:
        raise ValueError(f"mode must be 'shared' or 'full', got {s.mode!r}")
    out["trainable"] = 4 * (stu + fake)
    out["grads"] = 4 * max(stu, fake)
    out["optimizer"] = 8 * (stu + fake)
    out["ema"] = 4 * stu if s.ema else 0
    saved, one = activation_bytes(s)
    out["activations"] = saved
    out["backward"] = working_set(s, "backward")
    out["forward"] = working_set(s, "forward")
    out["nograd"] = working_set(s, "nograd")
    out["jvp"] = jvp_bytes(s, device)
    # one all-to-all's send and receive buffers (a rank's q, k, v, attention output or tangent, one at a time: each
    # call frees its buffers before the next, attention/ulysses.py), at the activation dtype
    exchange = 2 * s.batch * _rank_tokens(s) * s.dim * wb if s.context_parallel > 1 else 0.0
    out["cp_exchange"] = exchange
    out["overhead"] = 0.6 * GiB if device == "cpu" else 1.0 * GiB
    held = held_bytes(s)
    # the phases of a step, each on top of the grads: a grad-enabled forward's saved tensors and its backward (or the
    # forward's own transient, whichever is larger); a no-grad forward while a grad-enabled one is saved (the DMD
    # term's fake-score and teacher calls, fd_type 2's second student call); the JVP pass, which runs before the sCM
    # term's grad-enabled forward (losses.scm_loss)
    out["step_peak"] = max(
        saved + max(out["backward"], out["forward"]) + exchange, held + out["nograd"] + exchange, out["jvp"] + exchange
    )
    out["prefetch"] = parts["prefetch"]  # part of "weights"
    out["host"] = parts["host"] + host_activation_bytes(s)  # host memory (pinned on CUDA), not in the total
    return _with_total(out)


def jvp_bytes(s: TrainSetup, device: str = "cuda") -> float:
    """Working set of the JVP pass (fd_type 0/1; 0 otherwise): ``max(weight copies, token-bound feed-forward peak[,
    CPU attention peak])`` with ``JVP_COEFFS`` and, on ``device="cpu"``, ``JVP_CPU_ATTENTION`` (under context
    parallelism the attention holds all ``L`` tokens of ``heads / P`` heads)."""
    if s.fd_type not in (0, 1):
        return 0.0
    b, c, D = DTYPE_BYTES[s.weight_dtype], JVP_COEFFS[_dtype_key(s)], s.dim
    text = s.text_tokens if s.family == "wan" else 0
    parts = [
        _jvp_weight_copies(s),
        b
        * (
            s.batch * (_stream_tokens(s) * (c["per_F"] * s.ffn_dim + c["per_D"] * D) + text * c["txt_D"] * D)
            + c["per_FD"] * s.ffn_dim * D
        ),
    ]
    if device == "cpu":
        a, L = JVP_CPU_ATTENTION, s.tokens + (s.text_tokens if s.family != "wan" else 0)
        heads = (D // s.head_dim) // s.context_parallel
        parts.append(
            s.batch * b * (a["per_D"] * _stream_tokens(s) * D + a["scores"] * heads * min(s.cpu_attention_chunk, L) * L)
        )
    return float(max(parts))


def _jvp_weight_copies(s: TrainSetup) -> float:
    """Weight copies forward-mode AD makes in the JVP pass, which dominate it at few tokens: the clone of the time
    projection's ``6 D x D`` weight (float32, ``4 * 6 D^2``). Under bf16 autocast (Wan) the time and text
    embeddings run in float32, so the forward-mode rule of each bf16 condition-embedder linear first upcasts its
    weight, then clones it: ``2 * 4 * 6 D^2`` for the time projection plus ``4 (text_dim + D) D`` for the text
    embedder's (traced at the 14B width, docs/benchmarks.md)."""
    D = s.dim
    if _dtype_key(s) == "float32":
        return 4.0 * 6 * D * D
    if s.family == "wan":
        return 2 * 4.0 * 6 * D * D + 4.0 * (s.text_dim + D) * D
    return 6.0 * D * D * DTYPE_BYTES[s.weight_dtype]  # Flux under bf16: not traced


def _with_total(out: dict) -> dict:
    """``out`` plus ``total`` (static parts + grads + the largest phase + overhead) and ``total_gib``."""
    res = {k: float(v) for k, v in out.items() if k not in ("total", "total_gib")}
    res["total"] = sum(
        res.get(k, 0.0)
        for k in ("weights", "dequant", "trainable", "grads", "optimizer", "ema", "step_peak", "overhead")
    )
    res["total_gib"] = res["total"] / GiB
    return res


def per_rank(s: TrainSetup, world: int, device: str = "cuda") -> dict:
    """``predict_training`` per process when the frozen base is sharded over ``world`` processes (FSDP2, as
    ``training/rcm.py`` shards it; adapters, optimizer and EMA replicated): the base counts ``1 / world``, plus the
    FSDP2 working set of two unsharded blocks (the one running and the one prefetched). ``s.context_parallel``
    must divide ``world``."""
    if world % s.context_parallel:
        raise ValueError(f"context_parallel {s.context_parallel} does not divide {world} processes")
    if world > 1 and (s.base_dtype != "weight_dtype" or s.blocks_to_swap or s.activation_offload):
        raise ValueError(
            "base_dtype, blocks_to_swap and activation_offload are for one card: FSDP2 shards the base instead"
        )
    out = predict_training(s, device)
    blocks = s.num_layers + s.num_single_layers
    full = out["weights"]
    out["weights"] = full / world + (2 * full / (blocks * s.experts) if world > 1 else 0.0)  # one expert runs at a time
    return _with_total(out)


# ----------------------------------------------------------------------------- training on one card


#: inputs per scale of the fp8 base (``rcm_diffusers.distill.lowmem.FP8_BLOCK``) and swapped blocks on the device at
#: once (``lowmem.PREFETCH_BLOCKS``)
FP8_BLOCK, PREFETCH_BLOCKS = 128, 2
BASE_DTYPES = ("weight_dtype", "fp8", "int8")


def linear_weight_bytes(out: int, k: int, base_dtype: str, weight_dtype: str) -> int:
    """Bytes of one frozen Linear weight ``[out, k]`` as stored (``lowmem.quantize_weight``): ``weight_dtype``; ``fp8``
    1 byte per element of the input dimension padded to whole blocks and a float32 scale per row and block; ``int8``
    1 byte per element and a float32 scale per row."""
    if base_dtype == "weight_dtype":
        return out * k * DTYPE_BYTES[weight_dtype]
    if base_dtype == "fp8":
        nb = -(-k // FP8_BLOCK)
        return out * nb * FP8_BLOCK + 4 * out * nb
    if base_dtype == "int8":
        return out * k + 4 * out
    raise ValueError(f"base_dtype must be one of {BASE_DTYPES}, got {base_dtype!r}")


def weight_parts(s: TrainSetup) -> dict:
    """The frozen base's bytes: ``device`` (everything outside the block Linears in ``weight_dtype``, the resident
    blocks' Linear weights in ``base_dtype``, and the prefetch buffer: up to ``PREFETCH_BLOCKS`` swapped blocks),
    ``host`` (the swapped blocks), ``prefetch`` and ``dequant`` (a quantized base: the largest Linear dequantized in
    ``weight_dtype``, while one Linear runs). Per network, times ``experts``.
    Without ``block_linears`` (a hand-made setup) the whole base counts as ``weight_dtype``."""
    wb = DTYPE_BYTES[s.weight_dtype]
    if not s.block_linears:
        if s.base_dtype != "weight_dtype" or s.blocks_to_swap:
            raise ValueError("base_dtype / blocks_to_swap need the block shapes: build the setup with from_config")
        return {"device": float(s.params * wb * s.experts), "host": 0.0, "prefetch": 0.0, "dequant": 0.0}
    L, N = len(s.block_linears), s.blocks_to_swap
    if not 0 <= N <= L:
        raise ValueError(f"blocks_to_swap {N}: the model has {L} blocks")
    linear_numel = sum(o * k for b in s.block_linears for o, k in b)
    blocks = [sum(linear_weight_bytes(o, k, s.base_dtype, s.weight_dtype) for o, k in b) for b in s.block_linears]
    rest = (s.params - linear_numel) * wb
    resident, swapped = sum(blocks[: L - N]), blocks[L - N :]
    prefetch = float(min(N * s.experts, PREFETCH_BLOCKS) * max(swapped)) if N else 0.0
    biggest = max((o * k for b in s.block_linears for o, k in b), default=0)
    dequant = float(biggest * wb) if s.base_dtype != "weight_dtype" else 0.0
    return {
        "device": float(s.experts * (rest + resident) + prefetch),
        "host": float(s.experts * sum(swapped)),
        "prefetch": prefetch,
        "dequant": dequant,
    }


#: cards of the one-card tables: usable bytes (as ``DEVICES``), an achieved dense bf16 matrix rate (FLOP/s: about 60 %
#: of the data sheet's dense rate with float32 accumulation) and memory bandwidth (bytes/s, data sheet)
CARDS = {
    "24 GB (RTX 4090)": {"memory": 24e9, "flops": 100e12, "hbm": 1.0e12},
    "48 GB (L40S / RTX 6000 Ada)": {"memory": 48e9, "flops": 200e12, "hbm": 0.86e12},
}
#: host links, bytes/s of pinned host -> device copies (about 80 % of the line rate)
LINKS = {"PCIe 3.0 x16": 12.5e9, "PCIe 4.0 x16": 25e9, "PCIe 5.0 x16": 50e9}
#: cost of a pass through the network in forward-pass units: no-grad, the JVP pass (primal and tangent), a
#: grad-enabled pass with checkpointing (forward, recompute, backward to the inputs: the base has no weight gradient)
PASS_COST = {"nograd": 1.0, "jvp": 2.0, "grad": 3.5, "grad_no_checkpointing": 2.5}
#: device-memory bytes moved per weight element by a dequantization, beyond ``weight_dtype`` bytes ``b``: the 1-byte
#: value read, the cast written, read and the product written back (``1 + 3 b``; the matrix product's own read is in
#: its FLOPs)
DEQUANT_BYTES = {"float32": 13, "bfloat16": 7, "float16": 7}


def passes_per_iteration(s: TrainSetup) -> dict:
    """Mean network passes of one iteration in the three kinds the time model prices, ``{"nograd", "jvp", "grad"}``
    (a grad pass = forward with grad + its backward): ``cost.student_passes`` / ``cost.fake_passes`` summed over the
    roles, ``n`` uniform in 1..``max_simulation_steps``, student iterations a ``1 / student_update_freq`` share,
    the teacher guided with CFG (2 calls per evaluation), no regression or boundary term."""
    from .cost import Recipe, fake_passes, student_passes

    r = Recipe(fd_type=s.fd_type, use_dmd=s.use_dmd, dmd_weight=1.0, cfg_calls=2)
    sims = range(1, s.max_simulation_steps + 1)

    def mean_kinds(counts: list[dict]) -> dict:
        tot = {"nograd": 0.0, "jvp": 0.0, "grad": 0.0}
        for c in counts:
            for kinds in c.values():
                tot["nograd"] += kinds.get("forward", 0)
                tot["jvp"] += kinds.get("jvp", 0)
                tot["grad"] += kinds.get("forward_grad", 0)
        return {k: v / len(counts) for k, v in tot.items()}

    student = mean_kinds([student_passes(r, n) for n in sims])
    if not s.use_dmd:
        return student
    fake = mean_kinds([fake_passes(r, n) for n in sims])
    f = 1.0 / s.student_update_freq
    return {k: f * student[k] + (1 - f) * fake[k] for k in student}


def block_flops(s: TrainSetup) -> float:
    """FLOPs of one block's forward on one sample (Wan: the linears on video and text tokens, self- and
    cross-attention; Flux: every token through the linears and the joint attention)."""
    T, Tt, D = _rank_tokens(s), s.text_tokens, s.dim
    if s.family == "wan":
        linear = 2 * T * (6 * D * D + 2 * D * s.ffn_dim) + 2 * Tt * 2 * D * D
        attn = 4 * T * s.tokens * D + 4 * T * Tt * D  # each rank's queries against all keys
    else:
        n = T + Tt
        linear = 2 * n * (4 * D * D + 2 * D * s.ffn_dim)
        attn = 4 * n * (s.tokens + Tt) * D
    return float(s.batch * (linear + attn))


def step_time(s: TrainSetup, card: str = "24 GB (RTX 4090)", link: str = "PCIe 4.0 x16") -> dict:
    """Predicted seconds of an average iteration on ``card`` over ``link`` (names in ``CARDS`` / ``LINKS``, or a dict
    with ``flops`` and ``hbm`` and a bandwidth in bytes/s): ``compute`` (the
    blocks' FLOPs of ``passes_per_iteration`` at the card's rate), ``transfer`` (the part of the swapped blocks'
    copies the previous block's compute does not hide: each swapped block is copied once per pass and once more in
    the backward of a grad pass), ``dequant`` (device-memory traffic of dequantizing the resident and swapped
    Linears at every use: once per pass, three times in a grad pass), ``offload`` (``activation_offload``'s copies
    out and back, not overlapped), ``total``, ``slowdown`` = total / compute, and ``h2d_bytes`` per iteration."""
    c = CARDS[card] if isinstance(card, str) else card  # or {"flops": ..., "hbm": ...} of a measured card
    bw = LINKS[link] if isinstance(link, str) else float(link)  # or bytes/s
    p = passes_per_iteration(s)
    L = len(s.block_linears) or (s.num_layers + s.num_single_layers)
    c1 = block_flops(s) / c["flops"]  # one block, one forward
    grad_cost = PASS_COST["grad"] if s.gradient_checkpointing else PASS_COST["grad_no_checkpointing"]
    compute = L * c1 * (p["nograd"] * PASS_COST["nograd"] + p["jvp"] * PASS_COST["jvp"] + p["grad"] * grad_cost)
    parts = weight_parts(s) if s.block_linears else {"prefetch": 0.0}
    N = s.blocks_to_swap
    block = parts["prefetch"] / min(N * s.experts, PREFETCH_BLOCKS) if N else 0.0
    x = block / bw  # one swapped block's copy
    exposed = lambda hide: max(0.0, x - hide)  # noqa: E731
    transfer = N * (
        p["nograd"] * exposed(c1)
        + p["jvp"] * exposed(PASS_COST["jvp"] * c1)
        + p["grad"] * (exposed(c1) + exposed((grad_cost - 1) * c1))
    )
    loads = N * (p["nograd"] + p["jvp"] + 2 * p["grad"])
    dequant = 0.0
    if s.base_dtype != "weight_dtype":
        numel = sum(o * k for b in s.block_linears for o, k in b)
        uses = p["nograd"] + p["jvp"] + (3 if s.gradient_checkpointing else 2) * p["grad"]
        dequant = uses * numel * DEQUANT_BYTES[s.weight_dtype] / c["hbm"]
    offload = 2 * p["grad"] * host_activation_bytes(s) / bw
    total = compute + transfer + dequant + offload
    return {
        "compute": compute,
        "transfer": transfer,
        "dequant": dequant,
        "offload": offload,
        "total": total,
        "slowdown": total / compute,
        "h2d_bytes": loads * block + p["grad"] * host_activation_bytes(s),
    }


def with_lora_rank(s: TrainSetup, rank: int) -> TrainSetup:
    """``s`` with LoRA rank ``rank`` (adapter parameters scale with the rank)."""
    f = rank / s.lora_rank
    return dataclasses.replace(
        s,
        lora_rank=rank,
        lora_params_student=int(round(s.lora_params_student * f)),
        lora_params_fake=int(round(s.lora_params_fake * f)),
    )


def setting_text(s: TrainSetup) -> str:
    """The one-card options of ``s`` as the trainer's command line spells them."""
    return (
        f"--base_dtype {s.base_dtype} --blocks_to_swap {s.blocks_to_swap} "
        f"--activation_offload {str(s.activation_offload).lower()} --lora_rank {s.lora_rank}"
    )


def cheapest_fitting(
    s: TrainSetup,
    capacity: float,
    card: str = "24 GB (RTX 4090)",
    link: str = "PCIe 4.0 x16",
    margin: float = 0.9,
    formats=None,
    ranks=None,
):
    """The setting that fits ``margin x capacity`` bytes at the least predicted slowdown (``step_time``), or
    ``None``: over base formats (``formats``, default ``s.base_dtype`` and ``fp8``), activation offload (with
    checkpointing), 0..all blocks swapped, and LoRA ranks (``ranks``, default ``s.lora_rank``; lower ranks only when
    nothing fits at it). Ties (slowdown within 0.01) go to fewer host bytes (pinned memory is the host's too),
    then to the higher-precision format.
    Returns ``(setup, predict_training(setup), step_time(setup))``."""
    formats = list(dict.fromkeys(formats or [s.base_dtype, "fp8"]))
    ranks = list(ranks or [s.lora_rank])
    L = len(s.block_linears)
    for r in ranks:
        base = with_lora_rank(s, r) if r != s.lora_rank else s
        best = None
        for fmt in formats:
            for off in [False, True] if s.gradient_checkpointing else [False]:
                for n in range(L + 1):
                    c = dataclasses.replace(base, base_dtype=fmt, blocks_to_swap=n, activation_offload=off)
                    pred = predict_training(c)
                    if pred["total"] > margin * capacity:
                        continue
                    t = step_time(c, card, link)
                    key = (round(t["slowdown"] / 0.01), round(pred["host"] / 2**28), BASE_DTYPES.index(fmt))
                    if best is None or key < best[0]:
                        best = (key, c, pred, t)
                    break  # more blocks swapped only costs more
        if best is not None:
            return best[1:]
    return None


def fits(total_bytes: float, margin: float = 0.9) -> dict[str, bool]:
    """Whether ``total_bytes`` fits in ``margin`` x each device of ``DEVICES`` (allocator slack)."""
    return {name: total_bytes <= margin * cap for name, cap in DEVICES.items()}


def saved_activation_bytes(fn, exclude=()) -> int:
    """Bytes of the distinct storages autograd saves while running ``fn()`` (parameters in
    ``exclude`` not counted): the measurement the activation coefficients come from."""
    skip = {p.untyped_storage().data_ptr() for p in exclude}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return int(sum(seen.values()))


def checkpoint_held_bytes(fn, exclude=()) -> int:
    """Bytes of the distinct storages the checkpointed block calls (``rcm_diffusers.distill.activation_checkpointing``)
    made while running ``fn()`` hold for the backward: their inputs and the outputs the selective policy cached
    (parameters in ``exclude`` not counted): the measurement ``checkpoint_held`` is checked against."""
    from torch.utils._pytree import tree_leaves

    from .activation_checkpointing import recording

    with recording() as rec:
        fn()
    skip = {p.untyped_storage().data_ptr() for p in exclude}
    seen = {}
    for args, ctx in rec:
        leaves = list(tree_leaves(args))
        if ctx is not None:  # torch's SAC cache: {op: {index: pytree of wrappers holding the kept tensor in .val}}
            for per_op in ctx.storage.values():
                for entry in per_op.values():
                    leaves += [getattr(w, "val", w) for w in tree_leaves(entry, is_leaf=lambda x: hasattr(x, "val"))]
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in skip:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return int(sum(seen.values()))


class AllocationTrace:
    """Every allocation and free of torch's allocator inside an ``allocation_trace()`` block, in time order
    (``events``: ``(time_ns, bytes)``, negative for a free), and named instants (``mark``), both on
    ``time.time_ns()``'s clock. ``live(t)`` = bytes allocated in the block and still live at ``t``."""

    def __init__(self):
        self.events: list[tuple[int, int]] = []
        self.marks: dict[str, int] = {}

    def mark(self, name: str) -> None:
        """Record the instant ``name`` (``time.time_ns()``)."""
        self.marks[name] = time.time_ns()

    def live(self, start: str, end: str) -> int:
        """Bytes allocated between the marks ``start`` and ``end`` and still live at ``end``."""
        t0, t1 = self.marks[start], self.marks[end]
        return int(sum(b for t, b in self.events if t0 <= t <= t1))

    def peak(self, start: str | None = None, end: str | None = None) -> int:
        """Highest live bytes between the marks ``start`` and ``end`` (the whole block by default), counted from the
        live bytes at ``start``: the peak a phase adds on top of what was allocated when it began."""
        t0 = self.marks[start] if start else -1
        t1 = self.marks[end] if end else 1 << 62
        live = base = top = 0
        for t, b in self.events:
            if t > t1:
                break
            live += b
            if t < t0:
                base = top = live
            else:
                top = max(top, live)
        return int(top - base)


@contextlib.contextmanager
def allocation_trace():
    """Trace torch's allocator inside the block (``torch.profiler`` with ``profile_memory``, whose ``[memory]``
    events carry each allocation's size and time; the CPU allocator has no peak counter such as
    ``torch.cuda.max_memory_allocated``, and process RSS counts the C allocator's slack). Yields an
    ``AllocationTrace``, filled when the block ends. Allocations outside torch (e.g. gloo's own buffers) are not
    seen."""
    from torch.profiler import ProfilerActivity, profile

    trace = AllocationTrace()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield trace
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    trace.events = sorted((e.start_ns(), e.nbytes()) for e in events)
