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
  ``rcm_diffusers.distill.activation_checkpointing``) also every block's matrix-product and attention outputs, the recompute
  working set of one block then being the rest of that block (``checkpoint_held`` gives what is held between the
  forward and the backward);
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
real diffusers Wan / Flux blocks at small sizes (``saved_activation_bytes``); tests validate them on
held-out sizes, and ``benchmarks/real_arch.py`` against peak RSS at the real width.
Parameter counts are exact (the architecture built on the meta device, adapters added by peft).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time

import torch

__all__ = ["TrainSetup", "predict_training", "per_rank", "saved_activation_bytes", "checkpoint_held", "checkpoint_held_bytes",
           "held_bytes", "working_set", "allocation_trace", "AllocationTrace", "WORKING_SETS", "DEVICES", "fits", "ACT_COEFFS", "SELECTIVE_COEFFS",
           "JVP_COEFFS", "JVP_CPU_ATTENTION", "jvp_bytes"]

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

#: bytes autograd saves per block, per image/video token ``per_D D + per_F F + per_head H + per_r r + per_tok`` (H
#: heads, r the LoRA rank), per text token ``txt_D D + txt_r r + txt`` (Wan cross-attention K/V), and per block
#: ``layer_D D + r (layer_rD D + layer_rF F)``. Keyed by weight dtype; bfloat16 means bf16 weights under bf16 autocast
#: (``mixed_precision: bf16``, as the shipped configs) with float32 LoRA adapters.
ACT_COEFFS = {
    # Wan block, counted with ``saved_activation_bytes`` (diffusers 0.42, peft 0.21, torch 2.13, the JVP attention
    # processors; norms, modulation and RoPE in float32 as from_pretrained keeps them) at D 512 / 1536 / 3072 / 5120,
    # F 1024 / 8960 / 13824, r 4 / 32 / 64, as differences of 1- and 2-block models and of token and text counts; the
    # terms are exact there. per_head: the float32 log-sum-exp of both attentions; layer_D: the float32 modulation;
    # bf16 layer_r*: autocast's bf16 copies of the float32 LoRA weights, saved for the backward
    "wan": {"float32": {"per_D": 60.0, "per_F": 8.0, "per_head": 8.0, "per_r": 32.0, "per_tok": 36.0,
                        "txt_D": 12.0, "txt_r": 8.0, "txt": 4.0, "layer_D": 32.0},
            "bfloat16": {"per_D": 50.0, "per_F": 4.0, "per_head": 8.0, "per_r": 16.0, "per_tok": 36.0,
                         "txt_D": 12.0, "txt_r": 4.0, "txt": 4.0, "layer_D": 32.0, "layer_rD": 32.0, "layer_rF": 4.0}},
    # Flux double block (both streams, per token of either) and single block (concatenated tokens), F = 4 D in per_D;
    # counted the same way at D 512 / 1536 / 3072 (image and text tokens save the same), LoRA r32 (per_tok holds its
    # rank terms); the per-block constants are not counted
    "flux_double": {"float32": {"per_D": 72.0, "per_head": 12.0, "per_tok": 784.0},
                    "bfloat16": {"per_D": 46.0, "per_head": 12.0, "per_tok": 392.0}},
    "flux_single": {"float32": {"per_D": 68.0, "per_head": 12.0, "per_tok": 648.0},
                    "bfloat16": {"per_D": 44.0, "per_head": 12.0, "per_tok": 324.0}},
}

#: bytes the ``selective`` checkpointing policy keeps per Wan block (``rcm_diffusers.distill.activation_checkpointing``), by
#: activation bytes ``b`` (4 float32, 2 bf16 weights or bf16 autocast): per video token ``(9 D + F) b`` (q, k, v of
#: self-attention, both attention outputs, both out-projections, the cross-attention query, the feed-forward up (F)
#: and down projections), ``8 r b`` (the ``lora_A`` outputs of the 8 adapted token projections, rank r) and 4 bytes
#: per head and attention for the float32 log-sum-exp; per text token ``2 D b + 2 r b`` (cross-attention K, V and
#: their ``lora_A``). Counted from the ops the policy keeps; checked against the cached tensors
#: (``checkpoint_held_bytes``) in tests/test_memory_model.py.
SELECTIVE_COEFFS = {"per_D": 9, "per_F": 1, "per_r": 8, "txt_D": 2, "txt_r": 2, "lse_per_head": 2 * 4}

#: working sets on top of what a phase holds, bytes per video token (Flux: per token of either stream) in units of
#: the activation bytes ``b`` (4 float32, 2 under bf16 autocast) times ``per_F * F + per_D * D``: a no-grad forward
#: (teacher, fake score) and a block's backward beyond its recompute. Fitted on peaks traced with
#: ``allocation_trace`` (``benchmarks/memory_peaks.py``) at the Wan2.1-1.3B width (2 blocks, 1600 video tokens) and the
#: 14B width (1 block, 576 tokens) in float32, the bf16 no-grad set scaled by the one bf16 point (1.3B width, 784
#: tokens: bf16 autocast keeps norms and modulation in float32); checked on other token counts (docs/benchmarks.md).
WORKING_SETS = {"float32": {"nograd": {"per_F": 2.93, "per_D": 5.19}, "backward": {"per_F": 1.98, "per_D": 0.23},
                            "forward": {"per_F": 0.0, "per_D": 0.0}},
                "bfloat16": {"nograd": {"per_F": 4.07, "per_D": 7.21}, "backward": {"per_F": 1.98, "per_D": 0.23},
                             "forward": {"per_F": 3.01, "per_D": 5.34}}}

#: the JVP pass (fd_type 0/1), which holds no activations across blocks: its token-bound peak is a block's primal and
#: tangent feed-forward, ``b (per_F F + per_D D)`` per video token (Flux: per token of either stream) plus ``txt_D D b``
#: per Wan text token, fitted in float32 on traces at the 1.3B, 5B and 14B widths (F 8960 / 14336 / 13824, D 1536 /
#: 3072 / 5120, 784-2304 tokens: within 0.5 % of each; fitted on the first two widths only, 0.98 at the 14B width) with
#: the CPU attention chunk small enough that no score matrix enters. Under bf16 autocast the same tensors take 2 bytes
#: (the slope halves exactly at the 1.3B width) and the peak holds ``per_FD F D b`` more, bytes that scale with the
#: feed-forward's weight (3.05 / 3.23 F D bytes at the 1.3B / 5B widths, fitted, not traced to an op). The pass also holds at
#: least the weight copies of the condition embedder (``_jvp_weight_copies``); the larger of the two counts.
JVP_COEFFS = {"float32": {"per_F": 7.17, "per_D": 7.68, "txt_D": 1.12, "per_FD": 0.0},
              "bfloat16": {"per_F": 7.17, "per_D": 7.68, "txt_D": 1.12, "per_FD": 1.57}}
#: the CPU attention JVP (``attention/torch_backend.py``, chunks of ``TrainSetup.cpu_attention_chunk`` query rows) holds ``scores`` score-sized
#: matrices ``[heads, min(chunk, L), L]`` at once (S, P, tS, P tS and a temporary) beside ``per_D D b`` per token of
#: inputs, tangents and outputs; a GPU flash kernel holds no such matrix, so only ``device="cpu"`` counts it. Fitted on
#: the 1.3B width (1156 / 1600 tokens, chunks 1024 / 2048; within 1.4 %).
JVP_CPU_ATTENTION = {"per_D": 13.97, "scores": 4.83}

#: device name -> usable bytes
DEVICES = {"H200 (141 GB)": 141e9, "80 GB (A100/H100)": 80e9, "48 GB (L40S / RTX 6000 Ada)": 48e9, "24 GB (RTX 4090)": 24e9}
POLICIES = ("full", "selective")


@dataclasses.dataclass
class TrainSetup:
    """One training configuration (per process, before any sharding)."""

    family: str  # "wan" | "flux"
    dim: int  # model width D = heads * head_dim
    ffn_dim: int
    num_layers: int  # Wan blocks / Flux double blocks
    num_single_layers: int  # Flux single blocks (0 for Wan)
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
    #                   bases and 2 sets of adapters/optimizer/EMA; a batch is split between them, so activations do not grow
    context_parallel: int = 1  # Ulysses group size P: each rank holds tokens / P of every sample
    gradient_accumulation_steps: int = 1  # micro-batches of `batch` per optimizer step: no extra memory (see above)
    checkpointing_policy: str = "full"  # with gradient_checkpointing: "full" | "selective" (Wan)
    lora_rank: int = 64  # LoRA rank (the selective policy keeps the lora_A outputs, rank wide)
    head_dim: int = 128  # attention head dimension (selective: the log-sum-exp per head; Wan RoPE tables)
    text_dim: int = 4096  # width of the text encoder states the condition embedder projects (Wan: umT5)
    cpu_attention_chunk: int = 1024  # query rows per chunk of the CPU attention JVP (counted with device="cpu" only)

    @classmethod
    def from_config(cls, config: dict, class_name: str, *, tokens: int, text_tokens: int, batch: int = 1, lora_rank: int = 64,
                    weight_dtype: str = "bfloat16", gradient_checkpointing: bool = True, fd_type: int = 0, mode: str = "shared",
                    ema: bool = True, experts: int = 1, context_parallel: int = 1,
                    gradient_accumulation_steps: int = 1, checkpointing_policy: str = "full") -> "TrainSetup":
        """From a diffusers transformer config (``rcm_diffusers.arch.arch_config``); parameter counts exact."""
        flux = class_name.startswith("Flux")
        counts = _counts(class_name, tuple(sorted((k, _hashable(v)) for k, v in config.items())), lora_rank)
        D = config["num_attention_heads"] * config["attention_head_dim"]
        return cls(family="flux" if flux else "wan", dim=D, ffn_dim=4 * D if flux else config["ffn_dim"],
                   num_layers=config["num_layers"], num_single_layers=config.get("num_single_layers", 0) if flux else 0,
                   params=counts[0], lora_params_student=counts[1], lora_params_fake=counts[2], tokens=tokens,
                   text_tokens=text_tokens, batch=batch, weight_dtype=weight_dtype, gradient_checkpointing=gradient_checkpointing,
                   fd_type=fd_type, mode=mode, ema=ema, experts=experts, context_parallel=context_parallel,
                   gradient_accumulation_steps=gradient_accumulation_steps, checkpointing_policy=checkpointing_policy,
                   lora_rank=lora_rank if mode == "shared" else 0, head_dim=config["attention_head_dim"],
                   text_dim=config.get("text_dim", config.get("joint_attention_dim", 4096)))

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
    lora = sum(lora_rank * (mod.in_features + mod.out_features) for name, mod in m.named_modules()
               if isinstance(mod, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets))
    return base, lora, lora


def _block_bytes(coeffs: dict, s: TrainSetup, tokens: int, text_tokens: int) -> float:
    """``ACT_COEFFS`` of one block: what autograd saves for ``tokens`` video/image and ``text_tokens`` text tokens."""
    c = coeffs[_dtype_key(s)]
    g = lambda k: c.get(k, 0.0)  # noqa: E731
    D, F, r, H = s.dim, s.ffn_dim, s.lora_rank, s.dim // s.head_dim
    per_token = g("per_D") * D + g("per_F") * F + g("per_head") * H + g("per_r") * r + g("per_tok")
    per_text = g("txt_D") * D + g("txt_r") * r + g("txt")
    return s.batch * (tokens * per_token + text_tokens * per_text + g("layer_D") * D + r * (g("layer_rD") * D + g("layer_rF") * F))


def _dtype_key(s: TrainSetup) -> str:
    """Which coefficient table applies: ``float32``, or ``bfloat16`` for 16-bit weights under autocast."""
    return "float32" if s.weight_dtype == "float32" else "bfloat16"


def _stream_tokens(s: TrainSetup) -> int:
    """Tokens one rank's blocks carry: its video tokens (Wan), or image and text tokens (Flux's joint stream)."""
    return _rank_tokens(s) + (s.text_tokens if s.family == "flux" else 0)


def _rank_tokens(s: TrainSetup) -> int:
    """Video/image tokens one rank holds: ``tokens / context_parallel`` (rounded up)."""
    return -(-s.tokens // s.context_parallel)


def _selective_block_bytes(s: TrainSetup) -> float:
    """Bytes the ``selective`` policy keeps for one Wan block (``SELECTIVE_COEFFS``)."""
    c, b = SELECTIVE_COEFFS, DTYPE_BYTES[s.weight_dtype]
    heads = s.dim // s.head_dim
    return s.batch * (_rank_tokens(s) * (b * (c["per_D"] * s.dim + c["per_F"] * s.ffn_dim + c["per_r"] * s.lora_rank)
                                         + c["lse_per_head"] * heads)
                      + s.text_tokens * b * (c["txt_D"] * s.dim + c["txt_r"] * s.lora_rank))


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
    mb = DTYPE_BYTES[s.weight_dtype]
    n_tok = _stream_tokens(s)
    blocks = s.num_layers + s.num_single_layers
    held = blocks * s.batch * n_tok * s.dim * mb  # each block's input hidden states
    if s.family == "wan":  # text states, RoPE cos / sin (float32, per token and head dim), modulation (6 D, float32)
        held += s.batch * (s.text_tokens * s.dim * mb + 6 * s.dim * 4) + 2 * _rank_tokens(s) * s.head_dim * 4
    if s.checkpointing_policy == "selective":
        held += blocks * _selective_block_bytes(s)
    return float(held)


def activation_bytes(s: TrainSetup) -> tuple[float, float]:
    """``(saved, one_block)``: bytes autograd saves in one grad-enabled forward, and the largest
    single block's share (the recompute working set under gradient checkpointing)."""
    if s.context_parallel > 1 and s.family != "wan":
        raise ValueError("context parallelism is implemented for Wan only")
    if s.family == "wan":
        blocks = [(ACT_COEFFS["wan"], _rank_tokens(s), s.text_tokens)] * s.num_layers
    else:
        n = s.tokens + s.text_tokens  # both streams (double) / concatenated (single)
        blocks = [(ACT_COEFFS["flux_double"], n, 0)] * s.num_layers + [(ACT_COEFFS["flux_single"], n, 0)] * s.num_single_layers
    sizes = [_block_bytes(c, s, t, tt) for c, t, tt in blocks]
    one = max(sizes) if sizes else 0.0
    if not s.gradient_checkpointing:  # Wan: the float32 RoPE cos / sin tables, once for all blocks; the head's saved
        # copy of the last hidden states is the last block's share (each block's coefficients count the copy of its
        # output that its consumer saves: outside the blocks, a Wan forward saves the RoPE tables alone)
        rope = 2 * s.batch * _rank_tokens(s) * s.head_dim * 4 if s.family == "wan" else 0
        return float(sum(sizes) + rope), one
    held = checkpoint_held(s) + _head_bytes(s)
    if s.checkpointing_policy == "selective":  # the recompute re-uses the kept outputs of the block it runs
        return held + max(one - _selective_block_bytes(s), 0.0), one
    return held + one, one


def working_set(s: TrainSetup, name: str) -> float:
    """``WORKING_SETS[name]`` of setup ``s``: ``tokens b (per_F F + per_D D)`` with the rank's tokens (Flux: image and
    text tokens) and the activation bytes ``b``."""
    c, b = WORKING_SETS[_dtype_key(s)][name], DTYPE_BYTES[s.weight_dtype]
    return float(s.batch * _stream_tokens(s) * b * (c["per_F"] * s.ffn_dim + c["per_D"] * s.dim))


def held_bytes(s: TrainSetup) -> float:
    """Bytes a grad-enabled forward leaves for its backward: all saved activations without checkpointing; with it,
    ``checkpoint_held`` and the output head's saved input (the recompute comes in the backward)."""
    return checkpoint_held(s) + _head_bytes(s) if s.gradient_checkpointing else activation_bytes(s)[0]


def predict_training(s: TrainSetup, device: str = "cuda") -> dict:
    """Bytes per process of one rCM training step of setup ``s`` (see the module docstring for the
    parts); ``total_gib`` is their sum. ``device`` picks the runtime overhead (``cuda`` | ``cpu``)."""
    wb = DTYPE_BYTES[s.weight_dtype]
    out = {"weights": s.params * wb * s.experts}
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
    out["step_peak"] = max(saved + max(out["backward"], out["forward"]) + exchange, held + out["nograd"] + exchange,
                           out["jvp"] + exchange)
    return _with_total(out)


def jvp_bytes(s: TrainSetup, device: str = "cuda") -> float:
    """Working set of the JVP pass (fd_type 0/1; 0 otherwise): ``max(weight copies, token-bound feed-forward peak[,
    CPU attention peak])`` with ``JVP_COEFFS`` and, on ``device="cpu"``, ``JVP_CPU_ATTENTION`` (under context
    parallelism the attention holds all ``L`` tokens of ``heads / P`` heads)."""
    if s.fd_type not in (0, 1):
        return 0.0
    b, c, D = DTYPE_BYTES[s.weight_dtype], JVP_COEFFS[_dtype_key(s)], s.dim
    text = s.text_tokens if s.family == "wan" else 0
    parts = [_jvp_weight_copies(s), b * (s.batch * (_stream_tokens(s) * (c["per_F"] * s.ffn_dim + c["per_D"] * D)
                                                    + text * c["txt_D"] * D) + c["per_FD"] * s.ffn_dim * D)]
    if device == "cpu":
        a, L = JVP_CPU_ATTENTION, s.tokens + (s.text_tokens if s.family == "flux" else 0)
        heads = (D // s.head_dim) // s.context_parallel
        parts.append(s.batch * b * (a["per_D"] * _stream_tokens(s) * D + a["scores"] * heads * min(s.cpu_attention_chunk, L) * L))
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
    res["total"] = sum(res[k] for k in ("weights", "trainable", "grads", "optimizer", "ema", "step_peak", "overhead"))
    res["total_gib"] = res["total"] / GiB
    return res


def per_rank(s: TrainSetup, world: int, device: str = "cuda") -> dict:
    """``predict_training`` per process when the frozen base is sharded over ``world`` processes (FSDP2, as
    ``training/rcm.py`` shards it; adapters, optimizer and EMA replicated): the base counts ``1 / world``, plus the
    FSDP2 working set of two unsharded blocks (the one running and the one prefetched). ``s.context_parallel``
    must divide ``world``."""
    if world % s.context_parallel:
        raise ValueError(f"context_parallel {s.context_parallel} does not divide {world} processes")
    out = predict_training(s, device)
    blocks = s.num_layers + s.num_single_layers
    full = out["weights"]
    out["weights"] = full / world + (2 * full / (blocks * s.experts) if world > 1 else 0.0)  # one expert runs at a time
    return _with_total(out)


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
    """Bytes of the distinct storages the checkpointed block calls (``rcm_diffusers.distill.activation_checkpointing``) made
    while running ``fn()`` hold for the backward: their inputs and the outputs the selective policy cached
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
    ``AllocationTrace``, filled when the block ends. Allocations outside torch (e.g. gloo's own buffers) are not seen."""
    from torch.profiler import ProfilerActivity, profile

    trace = AllocationTrace()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield trace
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    trace.events = sorted((e.start_ns(), e.nbytes()) for e in events)
