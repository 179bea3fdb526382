"""What a distillation costs in compute (docs/benchmarks.md, "What a distillation costs"): the network passes of
one iteration, their FLOPs at a real architecture, and from them the time of an iteration and the GPU-hours of a run.

* **Passes** (``student_passes``, ``fake_passes``, ``qad_passes``): per role (teacher, student, fake score) the
  passes of each kind of ``passes.KINDS`` one iteration of a recipe makes, written from the loss terms
  (``distill.terms``, ``distill.qad``). tests/test_passes.py checks them against ``passes.PassCounter`` on the
  trainer's own code, recipe by recipe, so a term that adds or drops a pass fails there.
* **FLOPs per pass** (``pass_flops``): the matrix products of the real transformer (``Arch`` from
  ``rcm_diffusers/arch_configs`` or a model's config) at the real token counts, 2 FLOPs per multiply-add: every
  ``nn.Linear`` on the tokens it sees (video or image tokens, text tokens for the cross-attention keys and values),
  the attention products ``4 L_q L_k D``, and the LoRA adapters (``2 n r (in + out)``). A backward computes the
  input gradient of every product whose input carries one (the frozen base trains no weight; ``full`` mode adds the
  weight gradients), the LoRA gradients, and attention backward at 2.5x its forward (a flash kernel recomputes the
  scores); the JVP doubles every product whose input carries a tangent (the text keys / values do not) and runs
  attention at 3x its forward (2x for cross-attention, whose keys and values carry no tangent); a ``full``
  checkpointing recompute repeats the blocks' forward, a ``selective`` one only the LoRA up-projections. The 2.5x
  and 3x are the factors the official JVP kernel's benchmark uses (NVlabs/rcm
  ``rcm/utils/flash_attention_jvp_triton.py``).
  Norms, RoPE, modulation and the float64 loss arithmetic carry no FLOPs here: they are what the utilisation absorbs.
* **Time** (``run_cost``, ``hours``): an iteration's FLOPs over ``peak x utilisation``; a run sums the iterations of
  its schedule (``alternation.plan_step``: tangent warm-up, student / fake alternation, the backward-simulation
  length of each iteration). ``GPUS`` holds the dense bf16 tensor-core peaks of the vendors' datasheets;
  ``DEFAULT_UTILISATION`` is an assumption until ``benchmarks/gpu_check.sh`` measures it on a card.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, defaultdict

__all__ = [
    "GPUS",
    "DEFAULT_UTILISATION",
    "RESOLUTIONS",
    "Recipe",
    "student_passes",
    "fake_passes",
    "qad_passes",
    "Arch",
    "pass_flops",
    "iteration_flops",
    "iteration_passes",
    "run_pass_flops",
    "run_cost",
    "hours",
    "gpu_peak",
    "startup_report",
    "wan_tokens",
    "PUBLISHED_FORWARDS",
    "TEXT_TOKENS",
]

#: dense bf16 tensor-core peak (FLOP/s, no sparsity) of the cards the tables speak of, from the vendors' datasheets
GPUS = {
    "H100 SXM (80 GB)": 989e12,
    "H200 SXM (141 GB)": 989e12,
    "L40S / RTX 6000 Ada (48 GB)": 362e12,
    "RTX 4090 (24 GB)": 165e12,
}
#: the model-FLOP utilisation the predictions assume: what this FLOP model makes of the published FlashAttention-2
#: denoising times of Wan2.1 on one H200 (FastVideo, hao-ai-lab.github.io/blogs/fastvideo_post_training, Table 1:
#: 50 steps with CFG = 100 forwards; 1.3B 480p 95.21 s -> 30 %, 14B 720p 1746.5 s -> 38 %), the lower of the two;
#: ``benchmarks/gpu_check.sh`` measures it for the training iterations when a GPU is lent
DEFAULT_UTILISATION = 0.30
#: (architecture, latent frames x height x width, seconds of 100 forwards) behind DEFAULT_UTILISATION
PUBLISHED_FORWARDS = {"wan2.1-t2v-1.3b": ((21, 60, 104), 95.21), "wan2.1-t2v-14b": ((21, 90, 160), 1746.5)}
#: Wan latent sizes (frames, height, width) of 81 frames at 480p (480 x 832) and 720p (720 x 1280)
RESOLUTIONS = {"480p": (21, 60, 104), "720p": (21, 90, 160)}
#: text tokens of a Wan prompt (umT5, padded as WanPipeline pads) and image tokens of Wan 2.1 I2V (CLIP)
TEXT_TOKENS, IMAGE_TOKENS = 512, 257
#: name fragment of torch.cuda.get_device_name() -> dense bf16 peak (FLOP/s), most specific first
_DEVICE_PEAKS = [
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("RTX 6000 Ada", 364e12),
    ("L40", 181e12),
    ("4090", 165e12),
    ("A6000", 155e12),
]


def wan_tokens(frames: int, height: int, width: int, patch=(1, 2, 2)) -> int:
    """Video tokens of a Wan latent ``[C, frames, height, width]``."""
    return (frames // patch[0]) * (height // patch[1]) * (width // patch[2])


# ----------------------------------------------------------------------------- passes of an iteration


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What decides the passes of an rCM iteration (the options of ``RCMConfig`` that do, and the run's setting)."""

    scm_weight: float = 1.0
    cm_type: str = "scm"
    fd_type: int = 0
    use_dmd: bool = True
    dmd_weight: float = 0.01
    regression: bool = False  # the ODE-pair term runs (regression_weight > 0, pairs given)
    boundary: bool = False  # two experts with boundary_weight > 0
    cfg_calls: int = 2  # teacher calls per guided teacher evaluation: 2 with CFG and a negative prompt, else 1
    dcm_skip: int = 1
    gradient_checkpointing: bool = False
    checkpointing_policy: str = "full"

    @classmethod
    def from_config(cls, cfg, experts: int = 1, negatives: bool = True) -> "Recipe":
        """The recipe of an ``RCMConfig`` (``experts``: networks of the run; ``negatives``: the data has negative
        prompts, as ``training/prepare_data.py`` writes for Wan)."""
        return cls(
            scm_weight=cfg.scm_weight,
            cm_type=getattr(cfg, "cm_type", "scm"),
            fd_type=cfg.fd_type,
            use_dmd=cfg.use_dmd,
            dmd_weight=cfg.dmd_weight,
            regression=cfg.regression_weight > 0,
            boundary=experts > 1 and getattr(cfg, "boundary_weight", 0.0) > 0,
            cfg_calls=2 if negatives and cfg.guidance_scale != 1.0 else 1,
            dcm_skip=getattr(cfg, "dcm_skipping_interval_steps", 1),
            gradient_checkpointing=cfg.gradient_checkpointing,
            checkpointing_policy=cfg.checkpointing_policy,
        )


def _counts():
    return defaultdict(lambda: defaultdict(float))


def _finish(c, recipe: Recipe | None) -> dict:
    if recipe is not None and recipe.gradient_checkpointing:  # each backward recomputes the checkpointed blocks
        for role in list(c):
            if c[role].get("backward"):
                c[role]["recompute"] = c[role]["backward"]
    from .passes import KINDS

    roles = [r for r in ("teacher", "student", "fake") if r in c]
    return {role: {k: c[role][k] for k in KINDS if c[role].get(k)} for role in roles}


def student_passes(r: Recipe, n_sim: int = 1, dmd: bool = True) -> dict:
    """``{role: {kind: passes}}`` of one student iteration (``distill.terms.run_student_terms``): ``n_sim`` backward-
    simulation steps, ``dmd`` = the DMD term is on (after the tangent warm-up)."""
    c, teacher_evals = _counts(), 0
    s = c["student"]
    if r.regression:  # one grad-enabled one-step student call
        s["forward_grad"] += 1
        s["backward"] += 1
    if dmd and r.use_dmd and r.dmd_weight > 0:  # backward simulation (grad on the last call), fake score, teacher
        s["forward"] += n_sim - 1
        s["forward_grad"] += 1
        s["backward"] += 1
        c["fake"]["forward"] += 1
        teacher_evals += 1
    if r.scm_weight > 0:
        if r.cm_type == "dcm":  # skip guided teacher Euler steps, the no-grad target, the grad-enabled prediction
            teacher_evals += r.dcm_skip
            s["forward"] += 1
        else:  # the guided teacher velocity, the tangent, the grad-enabled F_theta
            teacher_evals += 1
            if r.fd_type in (0, 1):
                s["jvp"] += 1
                s["forward"] += 1 if r.fd_type == 1 else 0  # fd_type 1: F(x_t, t - h)
            else:
                s["forward"] += 1  # F(x_t - h F_T, t - h); F(x_t, t) is the grad-enabled call's
        s["forward_grad"] += 1
        s["backward"] += 1
    if r.boundary:  # low-noise expert at the switch (no grad), high-noise expert (grad)
        s["forward"] += 1
        s["forward_grad"] += 1
        s["backward"] += 1
    if teacher_evals:
        c["teacher"]["forward"] += teacher_evals * r.cfg_calls
    return _finish(c, r)


def fake_passes(r: Recipe, n_sim: int = 1) -> dict:
    """``{role: {kind: passes}}`` of one fake-score iteration (``distill.terms.fake_step``): a no-grad backward
    simulation of ``n_sim`` student calls, then the fake score's flow-matching forward and backward."""
    c = _counts()
    c["student"]["forward"] += n_sim
    c["fake"]["forward_grad"] += 1
    c["fake"]["backward"] += 1
    return _finish(c, r)


def qad_passes(alpha: float, guided: bool) -> dict:
    """``{role: {kind: passes}}`` of one QAD iteration (``distill.qad.qad_loss``): the quantized student's forward and
    backward, and the teacher's conditional (and, when ``guided``, unconditional) call unless ``alpha`` is 1."""
    c = _counts()
    c["student"]["forward_grad"] += 1
    c["student"]["backward"] += 1
    if alpha < 1:
        c["teacher"]["forward"] += 2 if guided else 1
    return _finish(c, None)


# ----------------------------------------------------------------------------- FLOPs of a pass


@dataclasses.dataclass(frozen=True)
class Arch:
    """The shapes of a Wan, Flux or Qwen-Image transformer that its matrix products depend on."""

    family: str  # "wan" | "flux" | "qwen" | "flux2"
    dim: int
    ffn_dim: int
    layers: int  # Wan blocks / Flux double blocks / Qwen-Image blocks (double-stream)
    single_layers: int  # Flux single blocks
    patch_in: int  # features per token into the patch embedding
    patch_out: int  # features per token out of the output projection
    text_dim: int
    image_kv: bool = False  # Wan 2.1 I2V: cross-attention to CLIP image tokens too
    per_sample: tuple = ()  # (in, out) of the linears that run once per sample (time embedding, modulation)

    @classmethod
    def from_config(cls, config: dict, class_name: str = "WanTransformer3DModel") -> "Arch":
        D = config["num_attention_heads"] * config["attention_head_dim"]
        if class_name == "QwenImageTransformer2DModel":
            c, nd, p = config["in_channels"], config["num_layers"], config.get("patch_size", 2)
            # time embedder, the blocks' image and text modulations, output norm; feed-forwards 4 D (FeedForward)
            per = [(256, D), (D, D)] + [(D, 6 * D)] * 2 * nd + [(D, 2 * D)]
            out = p * p * (config.get("out_channels") or c)
            return cls("qwen", D, 4 * D, nd, 0, c, out, config.get("joint_attention_dim", 3584), per_sample=tuple(per))
        if class_name == "HunyuanVideo15Transformer3DModel":  # Qwen-Image's double-stream block, video patches
            nd, p, pt = config["num_layers"], config.get("patch_size", 1), config.get("patch_size_t", 1)
            # time embedder, the blocks' video and text modulations, output norm (the text token refiner and the
            # ByT5 / image projections run on the context only: left out); feed-forwards 4 D
            per = [(256, D), (D, D)] + [(D, 6 * D)] * 2 * nd + [(D, 2 * D)]
            c_in, c_out = config["in_channels"] * p * p * pt, config["out_channels"] * p * p * pt
            return cls("qwen", D, 4 * D, nd, 0, c_in, c_out, config.get("text_embed_dim", 3584), per_sample=tuple(per))
        if class_name == "Flux2Transformer2DModel":
            c, nd, ns = config["in_channels"], config["num_layers"], config["num_single_layers"]
            F, g = int(D * config.get("mlp_ratio", 3.0)), config.get("timestep_guidance_channels", 256)
            # time (and guidance) embedders, the three shared modulations (image, text, single), output norm; no
            # pooled text; SwiGLU feed-forwards F = mlp_ratio D wide
            per = [(g, D), (D, D)] * (2 if config.get("guidance_embeds", True) else 1)
            per += [(D, 6 * D), (D, 6 * D), (D, 3 * D), (D, 2 * D)]
            out = config.get("out_channels") or c
            text = config.get("joint_attention_dim", 15360)
            return cls("flux2", D, F, nd, ns, c, out, text, per_sample=tuple(per))
        if class_name.startswith("Flux"):
            c, nd, ns = config["in_channels"], config["num_layers"], config["num_single_layers"]
            # time (and guidance) embedders, pooled text embedder, block modulations, output norm
            per = [(256, D), (D, D)] * (2 if config.get("guidance_embeds") else 1)
            per += [(config.get("pooled_projection_dim", 768), D), (D, D)] + [(D, 6 * D)] * 2 * nd + [(D, 3 * D)] * ns
            return cls(
                "flux",
                D,
                4 * D,
                nd,
                ns,
                c,
                config.get("out_channels") or c,
                config.get("joint_attention_dim", 4096),
                per_sample=tuple(per + [(D, 2 * D)]),
            )
        p = math.prod(config["patch_size"])
        freq = config.get("freq_dim", 256)  # time embedding and its projection to the blocks' modulation
        return cls(
            "wan",
            D,
            config["ffn_dim"],
            config["num_layers"],
            0,
            config["in_channels"] * p,
            (config.get("out_channels") or config["in_channels"]) * p,
            config.get("text_dim", 4096),
            bool(config.get("added_kv_proj_dim")),
            per_sample=((freq, D), (D, D), (D, 6 * D)),
        )

    @classmethod
    def from_arch(cls, name: str, **overrides) -> "Arch":
        """A shipped architecture (``rcm_diffusers/arch_configs``), e.g. with ``num_layers=2``."""
        from ..arch import arch_config, arch_meta

        return cls.from_config(arch_config(name, **overrides), arch_meta(name)["class_name"])


@dataclasses.dataclass(frozen=True)
class _Lin:
    fin: int
    fout: int
    n: int  # tokens it sees
    lora: bool  # a LoRA target
    grad_in: bool  # its input carries a gradient in a backward (LoRA on a frozen base)
    tangent: bool  # its input carries a tangent in a JVP
    block: bool = True  # inside a checkpointed block
    data_in: bool = False  # it reads the data (patch or text embedding): no input gradient in any mode


@dataclasses.dataclass(frozen=True)
class _Att:
    lq: int
    lk: int
    dim: int
    kv_tangent: bool


def _graph(a: Arch, L: int, T: int, I: int) -> tuple[list[_Lin], list[_Att]]:
    """The matrix products of one pass over one sample: ``L`` video / image tokens, ``T`` text tokens, ``I`` image
    tokens (Wan 2.1 I2V)."""
    D, F = a.dim, a.ffn_dim
    lins = [_Lin(i, o, 1, False, False, True, False, True) for i, o in a.per_sample]
    atts = []
    if a.family == "wan":
        for k in range(a.layers):
            # self-attention q, k, v (block 0: their input, the patch embedding, carries no gradient), out
            lins += [_Lin(D, D, L, True, k > 0, True)] * 3 + [_Lin(D, D, L, True, True, True)]
            lins += [_Lin(D, D, L, True, True, True)] * 2  # cross-attention q, out
            lins += [_Lin(D, D, T, True, False, False)] * 2  # cross-attention k, v of the text
            if a.image_kv:
                lins += [_Lin(D, D, I, True, False, False)] * 2
                atts.append(_Att(L, I, D, False))
            lins += [_Lin(D, F, L, True, True, True), _Lin(F, D, L, True, True, True)]  # feed-forward
            atts += [_Att(L, L, D, True), _Att(L, T, D, False)]
        lins += [
            _Lin(a.patch_in, D, L, False, False, True, False, True),  # patch embedding
            _Lin(D, a.patch_out, L, False, True, True, False),  # output projection
            _Lin(a.text_dim, D, T, False, False, False, False, True),
            _Lin(D, D, T, False, False, False, False),
        ]
        return lins, atts
    N = L + T  # Flux, Qwen-Image: the image and text streams attend jointly; Flux's single blocks carry both
    if a.family == "flux2":  # SwiGLU feed-forwards (D -> 2F, F -> D); single blocks: fused q, k, v + MLP in, out
        for k in range(a.layers):
            for n in (L, T):
                lins += [_Lin(D, D, n, True, k > 0, True)] * 3 + [_Lin(D, D, n, True, True, True)]
                lins += [_Lin(D, 2 * F, n, True, True, True), _Lin(F, D, n, True, True, True)]
            atts.append(_Att(N, N, D, True))
        for _ in range(a.single_layers):
            lins += [_Lin(D, 3 * D + 2 * F, N, True, True, True), _Lin(D + F, D, N, True, True, True)]
            atts.append(_Att(N, N, D, True))
        lins += [
            _Lin(a.patch_in, D, L, False, False, True, False, True),
            _Lin(D, a.patch_out, L, False, True, True, False),
            _Lin(a.text_dim, D, T, False, False, False, False, True),
        ]
        return lins, atts
    for k in range(a.layers):
        for n in (L, T):  # q, k, v (block 0: no input gradient), out and the feed-forward of each stream
            lins += [_Lin(D, D, n, True, k > 0, True)] * 3 + [_Lin(D, D, n, True, True, True)]
            lins += [_Lin(D, F, n, True, True, True), _Lin(F, D, n, True, True, True)]
        atts.append(_Att(N, N, D, True))
    for _ in range(a.single_layers):
        lins += [_Lin(D, D, N, True, True, True)] * 3  # q, k, v
        lins += [_Lin(D, 4 * D, N, True, True, True), _Lin(5 * D, D, N, True, True, True)]  # MLP in, joint output
        atts.append(_Att(N, N, D, True))
    lins += [
        _Lin(a.patch_in, D, L, False, False, True, False, True),
        _Lin(D, a.patch_out, L, a.family == "flux", True, True, False),  # Flux's LoRA targets "proj_out" too
        _Lin(a.text_dim, D, T, False, False, False, False, True),
    ]
    return lins, atts


def pass_flops(
    arch: Arch,
    tokens: int,
    text_tokens: int = TEXT_TOKENS,
    *,
    batch: int = 1,
    lora_rank: int = 64,
    fake_lora_rank: int | None = None,
    mode: str = "shared",
    checkpointing_policy: str = "full",
    image_tokens: int = IMAGE_TOKENS,
    attention_backward: float = 2.5,
) -> dict:
    """FLOPs of one pass of each kind per role, ``{role: {kind: flops}}`` with kinds ``passes.KINDS`` and the parts
    ``{role: {kind + "/attention": flops}}`` that are attention products (the rest are linear layers). The teacher
    runs without adapters; ``mode`` ``full`` trains every weight (no adapters, weight gradients in the backward).
    ``attention_backward``: attention backward over forward (2.5 a flash kernel, 2.0 the math path)."""
    lins, atts = _graph(arch, tokens, text_tokens, image_tokens)
    full = mode == "full"
    out = {}
    for role, rank in (
        ("teacher", 0),
        ("student", 0 if full else lora_rank),
        ("fake", 0 if full else (fake_lora_rank or lora_rank)),
    ):
        fwd = jvp = bwd = rec_full = rec_sel = 0.0
        for m in lins:
            base = 2.0 * m.n * m.fin * m.fout
            lora = 2.0 * m.n * rank * (m.fin + m.fout) if m.lora and rank else 0.0
            fwd += base + lora
            jvp += (2 if m.tangent else 1) * (base + lora)
            trains = role != "teacher"
            # full mode: every input but the data carries a gradient, every weight of a trained role gets one
            grad_in = (full and trains and not m.data_in) or (m.grad_in and not full)
            # LoRA x A^T B^T: grads of B and A through dY B, and the input's through A when it carries one
            lora_bwd = 2.0 * m.n * rank * (2 * m.fout + m.fin + (m.fin if grad_in else 0)) if lora else 0.0
            bwd += (base if grad_in else 0.0) + (base if full and trains else 0.0) + lora_bwd
            if m.block:
                rec_full += base + lora
                rec_sel += 2.0 * m.n * rank * m.fout if lora else 0.0  # the LoRA up-projection (reduction dim r)
        a_fwd = sum(4.0 * t.lq * t.lk * t.dim for t in atts)
        a_jvp = sum(4.0 * t.lq * t.lk * t.dim * (3.0 if t.kv_tangent else 2.0) for t in atts)
        kinds = {
            "forward": fwd + a_fwd,
            "forward_grad": fwd + a_fwd,
            "jvp": jvp + a_jvp,
            "backward": bwd + attention_backward * a_fwd,
            "recompute": rec_full + a_fwd if checkpointing_policy == "full" else rec_sel,
        }
        parts = {
            "forward/attention": a_fwd,
            "forward_grad/attention": a_fwd,
            "jvp/attention": a_jvp,
            "backward/attention": attention_backward * a_fwd,
            "recompute/attention": a_fwd if checkpointing_policy == "full" else 0.0,
        }
        out[role] = {k: batch * v for k, v in {**kinds, **parts}.items()}
    return out


def iteration_flops(passes: dict, flops: dict) -> float:
    """FLOPs of an iteration: ``sum passes[role][kind] x flops[role][kind]``."""
    return sum(n * flops[role][kind] for role, kinds in passes.items() for kind, n in kinds.items())


# ----------------------------------------------------------------------------- a run


def _plan_key(cfg, i: int) -> tuple[str, int, bool]:
    from .alternation import plan_of

    p = plan_of(cfg, i, cfg.use_dmd)
    if p.regression_only:
        return "regression", 1, False
    if p.student:
        return "student", p.n_sim, p.dmd
    return "fake", p.fake_eff % cfg.max_simulation_steps + 1, True


def _passes_of(key: tuple[str, int, bool], recipe: Recipe) -> dict:
    role, n, dmd = key
    if role == "regression":  # the regression warm-up: the ODE-pair term alone
        return student_passes(dataclasses.replace(recipe, scm_weight=0.0, boundary=False), n, False)
    return student_passes(recipe, n, dmd) if role == "student" else fake_passes(recipe, n)


def iteration_passes(cfg, i: int, recipe: Recipe) -> tuple[str, dict]:
    """``(role, passes)`` of iteration ``i`` of a run of ``cfg`` (``alternation.plan_step``: warm-up, alternation,
    the backward-simulation length of that iteration)."""
    key = _plan_key(cfg, i)
    return key[0], _passes_of(key, recipe)


def run_pass_flops(cfg, arch: Arch, tokens: int, text_tokens: int = TEXT_TOKENS) -> dict:
    """``pass_flops`` of one sample for the setup of ``RCMConfig`` ``cfg``."""
    return pass_flops(
        arch,
        tokens,
        text_tokens,
        batch=1,
        lora_rank=cfg.lora_rank,
        fake_lora_rank=getattr(cfg, "fake_lora_rank", 0) or None,
        mode=cfg.mode,
        checkpointing_policy=cfg.checkpointing_policy if cfg.gradient_checkpointing else "full",
    )


def run_cost(
    cfg,
    arch: Arch,
    tokens: int,
    text_tokens: int = TEXT_TOKENS,
    *,
    experts: int = 1,
    negatives: bool = True,
    max_steps: int | None = None,
) -> dict:
    """FLOPs of a run of ``RCMConfig`` ``cfg`` per process: every iteration of its schedule (``iteration_passes``)
    times ``batch_size x gradient_accumulation_steps`` samples, over ``context_parallel_size`` ranks of a group.
    Returns ``{"iterations": {"student", "fake"[, "regression"]}, "flops": total, "student_flops" / "fake_flops"[ /
    "regression_flops"]: mean per iteration of each, "pass_flops", "recipe"}`` ("regression": the iterations of the
    regression warm-up, when it has any)."""
    recipe = Recipe.from_config(cfg, experts, negatives)
    pf = run_pass_flops(cfg, arch, tokens, text_tokens)
    samples = cfg.batch_size * cfg.gradient_accumulation_steps / max(1, getattr(cfg, "context_parallel_size", 1))
    steps = cfg.max_steps if max_steps is None else max_steps
    kinds = Counter(_plan_key(cfg, i) for i in range(steps))  # iterations of each (role, n_sim, dmd)
    tot = {"student": [0, 0.0], "fake": [0, 0.0]}
    for key, count in kinds.items():
        tot.setdefault(key[0], [0, 0.0])  # "regression": the regression warm-up's iterations, when there are any
        tot[key[0]][0] += count
        tot[key[0]][1] += count * iteration_flops(_passes_of(key, recipe), pf) * samples
    total = sum(flops for _, flops in tot.values())
    return {
        "iterations": {r: tot[r][0] for r in tot},
        "flops": total,
        "pass_flops": pf,
        "recipe": recipe,
        **{f"{r}_flops": tot[r][1] / tot[r][0] if tot[r][0] else 0.0 for r in tot},
    }


def hours(flops: float, peak: float, utilisation: float = DEFAULT_UTILISATION) -> float:
    """Hours of ``flops`` on one card of dense peak ``peak`` FLOP/s at ``utilisation``."""
    return flops / (peak * utilisation) / 3600.0


def gpu_peak(name: str) -> float | None:
    """Dense bf16 peak (FLOP/s) of a CUDA device by its name (``torch.cuda.get_device_name()``), or ``None``."""
    for frag, peak in _DEVICE_PEAKS:
        if frag.lower() in name.lower():
            return peak
    return None


# ----------------------------------------------------------------------------- the trainer's start-up line


def _device() -> tuple[str, float]:
    """The CUDA device this process sees and its dense bf16 peak, else the H100 the tables use as reference."""
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        if gpu_peak(name):
            return name, gpu_peak(name)
    return "an H100 SXM", GPUS["H100 SXM (80 GB)"]


def startup_report(cfg, world: int | None = None) -> str:
    """The line the rCM trainer prints at start-up, after the memory model's: the predicted compute of an iteration
    and of the run of ``cfg`` (its teacher's config and its data's first sample, read from disk) and their time on
    this process's CUDA device (an H100 when there is none or its peak is unknown) at ``DEFAULT_UTILISATION``,
    per process and in GPU-hours over ``world`` processes (default ``WORLD_SIZE``). A setup the model does not cover
    (a hub id not on disk, another architecture) says so instead."""
    import json
    import os

    from ..models import HUNYUAN15_IMAGE_TOKENS
    from .data import LatentDataset
    from .experts import HIGH, index_boundary_ratio

    world = world or int(os.environ.get("WORLD_SIZE", "1"))
    try:
        with open(os.path.join(os.path.expanduser(cfg.pretrained), "model_index.json")) as f:
            index = json.load(f)
        two = cfg.experts == "both" or (cfg.experts == "auto" and index_boundary_ratio(index) is not None)
        sub = HIGH if two else cfg.transformer_subfolder
        with open(os.path.join(os.path.expanduser(cfg.pretrained), sub, "config.json")) as f:
            config = json.load(f)
        class_name = config.get("_class_name") or index[sub][1]
        config = {k: v for k, v in config.items() if not k.startswith("_")}
        row = LatentDataset(cfg.data_dir).get([0])
        packed = class_name.startswith("Flux") or class_name == "QwenImageTransformer2DModel"
        lat = tuple(row["latents"].shape[1:])
        if class_name == "HunyuanVideo15Transformer3DModel":  # [C, F, H, W] in (patch_size_t, p, p) patches
            p, pt = config.get("patch_size", 1), config.get("patch_size_t", 1)
            tokens = (lat[-3] // pt) * (lat[-2] // p) * (lat[-1] // p)
        elif class_name == "Flux2Transformer2DModel":  # patchified latents: one token per latent pixel
            tokens = lat[-2] * lat[-1]
        elif packed:
            tokens = (lat[-2] // 2) * (lat[-1] // 2)
        else:
            tokens = wan_tokens(*lat[-3:], patch=config["patch_size"])
        text = int(row["prompt_embeds"].shape[-2])
        if class_name == "HunyuanVideo15Transformer3DModel":  # + ByT5 and the (masked) image tokens in the attention
            text += int(row["prompt_embeds_2"].shape[-2]) + HUNYUAN15_IMAGE_TOKENS
        run = run_cost(
            cfg,
            Arch.from_config(config, class_name),
            tokens,
            text,
            experts=2 if two else 1,
            negatives=row.get("negative_prompt_embeds") is not None,
        )
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        return f"compute: no prediction ({e})"
    name, peak = _device()
    u = DEFAULT_UTILISATION
    it = run["iterations"]
    per = {r: run[f"{r}_flops"] / (peak * u) for r in ("student", "fake")}
    run_h = hours(run["flops"], peak, u)
    warm = f" after {it['regression']} regression warm-up iterations" if it.get("regression") else ""
    return (
        f"compute: predicted {run['student_flops'] / 1e12:.3g} TFLOP per student iteration, "
        f"{run['fake_flops'] / 1e12:.3g} per fake-score iteration ({tokens} tokens, {it['student']} + {it['fake']} "
        f"iterations{warm}); on {name} at {u:.0%} utilisation {per['student']:.3g} s / {per['fake']:.3g} s per "
        "iteration, "
        f"{run_h:.3g} h for the run, {run_h * world:.3g} GPU-hours over {world} process(es)"
    )
