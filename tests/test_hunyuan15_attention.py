"""HunyuanVideo-1.5 attention with key-padding masks (rcm_diffusers.attention.hunyuan15), on the tiny random model of
tests/test_train_hunyuan15.py (CPU): the transformer's output, its gradients (input and LoRA) and its JVP equal those
of diffusers' stock processors with padded prompts; a block's saved activations grow linearly in the attention's token
count L where the stock dense mask adds b L^2 bytes; the rCM trainer installs it; other models and processors are
refused."""

import pytest
import torch
from test_train_hunyuan15 import (
    CONFIG,
    SHAPE,
    TEXT_2_DIM,
    TEXT_DIM,
    C,
    make_hunyuan15_dataset,
    make_tiny_hunyuan15,
    tiny_hunyuan15_transformer,
)

from rcm_diffusers.attention.hunyuan15 import (
    HunyuanVideo15KeyPaddingAttnProcessor,
    HunyuanVideo15RefinerKeyPaddingAttnProcessor,
    disable_key_padding_mask,
    enable_key_padding_mask,
)
from rcm_diffusers.distill.adapters import Networks
from rcm_diffusers.distill.memory import ACT_COEFFS, TrainSetup, _block_bytes, saved_activation_bytes

OURS = (HunyuanVideo15KeyPaddingAttnProcessor, HunyuanVideo15RefinerKeyPaddingAttnProcessor)
U32, U64 = 2.0**-24, 2.0**-53


@pytest.fixture(autouse=True)
def few_image_tokens(monkeypatch):
    """9 (masked) image tokens instead of the pipeline's 729: more padded keys than valid context ones, short passes."""
    monkeypatch.setattr("rcm_diffusers.models.HUNYUAN15_IMAGE_TOKENS", 9)


def _student(dtype, seed=0):
    """The tiny transformer with the trainer's LoRA student (random adapters, so the student is not the base)."""
    tr = tiny_hunyuan15_transformer(seed, dtype=dtype).eval()
    nets, _ = Networks.build(tr, "shared", with_fake=False, lora_rank=4)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in nets.trainable_parameters("student").values():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    return tr, nets


def _inputs(dtype, seed=3):
    """Latents [2, C, 2, 2, 2] and padded prompts as data.model_inputs gives them: Qwen2.5-VL tokens 3 of 6 and 5 of
    6 valid, ByT5 2 of 3 and none (a prompt without glyph text); RF times of both halves of the schedule."""
    g = torch.Generator().manual_seed(seed)
    m1 = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]], dtype=dtype)
    m2 = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=dtype)
    cond = {
        "encoder_hidden_states": torch.randn(2, 6, TEXT_DIM, generator=g, dtype=dtype) * m1[..., None],
        "encoder_attention_mask": m1,
        "encoder_hidden_states_2": torch.randn(2, 3, TEXT_2_DIM, generator=g, dtype=dtype) * m2[..., None],
        "encoder_attention_mask_2": m2,
    }
    x = torch.randn(2, C, 2, 2, 2, generator=g, dtype=dtype)
    return x, torch.tensor([0.4, 1.1], dtype=dtype), cond


def _processors(tr):
    return {type(p).__name__ for p in tr.attn_processors.values()}


def _forward_backward(nets, x, t, cond):
    """The student's F and the gradients of a fixed projection of it w.r.t. x and every LoRA parameter."""
    params = nets.trainable_parameters("student")
    x = x.clone().requires_grad_(True)
    out = nets.F("student", x, t, cond)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    grads = torch.autograd.grad((out * w).sum(), [x, *params.values()], allow_unused=True)
    return out.detach(), {k: g for k, g in zip(["x", *params], grads) if g is not None}


# float64: both processors sum the same products in the same order up to the masked keys' exact zeros; bound at 64 u of
# the output scale. float32: 64 u32.
BOUND = {torch.float64: 64 * U64, torch.float32: 64 * U32}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_output_and_gradients_equal_the_stock_processors(dtype):
    """The student's F (LoRA on every attention Linear of blocks and refiner) with padded prompts, and the gradients
    w.r.t. the input and all LoRA parameters: key-padding masks give what diffusers' dense masks give, to 64 u of each
    tensor's scale (measured: 0, bit for bit, in both dtypes). The prompt masks matter here: all-ones masks change F
    by more than 1e-3 of its scale."""
    tr, nets = _student(dtype)
    x, t, cond = _inputs(dtype)
    assert _processors(tr) == {"HunyuanVideo15AttnProcessor2_0", "AttnProcessor2_0"}
    want, want_g = _forward_backward(nets, x, t, cond)
    enable_key_padding_mask(tr)
    assert _processors(tr) == {c.__name__ for c in OURS}
    got, got_g = _forward_backward(nets, x, t, cond)
    scale = want.abs().max()
    diffs = {"F": float((got - want).abs().max() / scale)}
    assert diffs["F"] <= BOUND[dtype], diffs
    assert want_g.keys() == got_g.keys() and len(want_g) > 40
    # the last block's context queries reach only context outputs, which the model drops: zero gradients (its
    # context out-projection and feed-forward are not in the graph at all)
    zero = [k for k in want_g if not want_g[k].any()]
    assert zero == [f"transformer_blocks.1.attn.add_q_proj.lora_{ab}.student.weight" for ab in "AB"], zero
    for k in want_g:
        if k in zero:
            assert not got_g[k].any(), k
            continue
        diffs[k] = float((got_g[k] - want_g[k]).abs().max() / want_g[k].abs().max())
        assert diffs[k] <= BOUND[dtype], (k, diffs[k])
    print(dtype, "max relative difference", max(diffs.values()))
    unmasked = {**cond, "encoder_attention_mask": torch.ones_like(cond["encoder_attention_mask"])}
    with torch.no_grad():
        assert (nets.F("student", x, t, unmasked) - got).abs().max() > 1e-3 * scale  # the masks are not vacuous


def test_jvp_equals_the_stock_processors_and_central_differences(monkeypatch):
    """fd_type 0's JVP of the student's F in float64 through ``enable_jvp_attention`` (the fused kernel, reached by
    our processors' SDPA calls with only [B, 1, 1, L] key masks, never an L x L one): equal to the stock processors'
    JVP through the same kernel and to stock forward AD on the math SDPA backend to 1e-10, and to central differences
    in x within the round-off bound of tests/test_train_hunyuan15.py."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import rcm_diffusers.attention.sdpa as sdpa
    from rcm_diffusers.attention import disable_jvp_attention, enable_jvp_attention
    from rcm_diffusers.attention.linear_jvp import enable_linear_jvp

    dt = torch.float64
    tr, nets = _student(dt)
    x, t, cond = _inputs(dt)
    g = torch.Generator().manual_seed(4)
    dx, dtt = torch.randn(x.shape, generator=g, dtype=dt), torch.tensor([0.3, -0.7], dtype=dt)

    def F(x, t):
        return nets.F("student", x, t, cond)

    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        _, math = torch.func.jvp(F, (x, t), (dx, dtt))  # stock processors, PyTorch's forward AD
    masks = []
    kernel = sdpa.sdpa_jvp

    def recording(*args, **kw):
        m = kw.get("attn_mask", args[3] if len(args) > 3 else None)
        masks.append(None if m is None else tuple(m.shape))
        return kernel(*args, **kw)

    monkeypatch.setattr(sdpa, "sdpa_jvp", recording)
    enable_jvp_attention(tr)
    enable_linear_jvp(tr)
    with torch.no_grad():
        _, stock = torch.func.jvp(F, (x, t), (dx, dtt))
    # the two blocks' attention (the refiner's, on the prompt alone, carries no tangent): dense [B, 1, L, L] masks
    assert len(masks) == 2 and all(m[-2] == m[-1] for m in masks), masks
    masks.clear()
    enable_key_padding_mask(tr)
    with torch.no_grad():
        _, ours = torch.func.jvp(F, (x, t), (dx, dtt))
        assert len(masks) == 2 and all(m[-2] == 1 for m in masks), masks  # key masks [B, 1, 1, L]
        scale = math.abs().max()
        assert (ours - stock).abs().max() <= 1e-10 * scale
        assert (ours - math).abs().max() <= 1e-10 * scale
        print(
            "jvp: ours - stock kernel",
            float((ours - stock).abs().max()),
            "ours - math",
            float((ours - math).abs().max()),
        )
        h, rtol = 1e-3, 1e-4
        _, ty = torch.func.jvp(F, (x, t), (dx, torch.zeros_like(dtt)))
        fd = (F(x + h * dx, t) - F(x - h * dx, t)) / (2 * h)
        out_scale = F(x, t).abs().max()
        assert ty.abs().max() > 1e-3 * out_scale
        assert (ty - fd).abs().max() <= rtol * ty.abs().max() + 8 * U32 * out_scale / h
    disable_jvp_attention(tr)


def _block_inputs(tr, frames, dtype, context=12, valid=7):
    """One double-stream block's arguments for a 1 x frames x 8 x 8 latent (64 frames video tokens after the patch
    embedding) and ``context`` context tokens of which ``valid`` are valid."""
    g = torch.Generator().manual_seed(0)
    D = tr.config.num_attention_heads * tr.config.attention_head_dim
    freqs = tr.rope(torch.zeros(1, 1, frames, 8, 8))
    h = torch.randn(1, 64 * frames, D, generator=g, dtype=dtype, requires_grad=True)
    e = torch.randn(1, context, D, generator=g, dtype=dtype, requires_grad=True)
    temb = torch.randn(1, D, generator=g, dtype=dtype)
    return (h, e, temb, (torch.arange(context) < valid)[None], freqs), 64 * frames + context


def _setup(dtype):
    return TrainSetup(
        family="hunyuan15",
        dim=32,
        ffn_dim=128,
        num_layers=1,
        num_single_layers=0,
        params=0,
        lora_params_student=0,
        lora_params_fake=0,
        tokens=0,
        text_tokens=0,
        weight_dtype="float32" if dtype == torch.float32 else "bfloat16",
        lora_rank=4,
        head_dim=16,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_bytes_of_a_block_grow_linearly_in_tokens(dtype):
    """What one double-stream block (LoRA student, bf16 under autocast) saves for its backward, at L = 76 / 140 / 268
    attention tokens: with key-padding masks an affine function of L (equal steps per token); the stock processors save
    ``b (L^2 - L)`` bytes more (the additive [1, 1, L, L] mask instead of the [1, 1, 1, L] one; b = 4 float32, 2 bf16),
    as the memory model's two coefficient sets say. The token refiner likewise, with ``b (H T^2 - T)``."""
    tr = tiny_hunyuan15_transformer()
    Networks.build(tr, "shared", with_fake=False, lora_rank=4)
    block, refiner = tr.transformer_blocks[0], tr.context_embedder.token_refiner
    b, H, s = (4 if dtype == torch.float32 else 2), tr.config.num_attention_heads, _setup(dtype)

    def saved(fn):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            return saved_activation_bytes(fn, exclude=tr.parameters())

    def block_bytes():
        out = {}
        for frames in (1, 2, 4):
            args, L = _block_inputs(tr, frames, torch.float32)
            out[L] = saved(lambda: block(*args))
        return out

    def refiner_bytes():
        out = {}
        for T in (16, 32, 64):
            g = torch.Generator().manual_seed(0)
            h = torch.randn(1, T, 32, generator=g, requires_grad=True)
            out[T] = saved(lambda: refiner(h, torch.randn(1, 32, generator=g), (torch.arange(T) < T - 3)[None]))
        return out

    stock, stock_ref = block_bytes(), refiner_bytes()
    enable_key_padding_mask(tr)
    ours, ours_ref = block_bytes(), refiner_bytes()
    print("block saved bytes (L: stock, key-padding)", {L: (stock[L], ours[L]) for L in ours})
    print("refiner saved bytes (T: stock, key-padding)", {T: (stock_ref[T], ours_ref[T]) for T in ours_ref})
    for got in (ours, ours_ref):
        (n0, b0), (n1, b1), (n2, b2) = sorted(got.items())
        assert (b1 - b0) * (n2 - n1) == (b2 - b1) * (n1 - n0), got  # affine in the token count
    for L in ours:
        assert stock[L] - ours[L] == b * (L * L - L), (L, stock[L], ours[L])
        model = _block_bytes(ACT_COEFFS["hunyuan15_double_dense_mask"], s, L, 0) - _block_bytes(
            ACT_COEFFS["hunyuan15_double"], s, L, 0
        )
        assert model == stock[L] - ours[L]
    for T in ours_ref:
        assert stock_ref[T] - ours_ref[T] == b * (H * T * T - T), (T, stock_ref[T], ours_ref[T])
        model = _block_bytes(ACT_COEFFS["hunyuan15_refiner_dense_mask"], s, T, 0) - _block_bytes(
            ACT_COEFFS["hunyuan15_refiner"], s, T, 0
        )
        assert model == stock_ref[T] - ours_ref[T]


def test_install_refusals_and_undo():
    """Installed on the peft-wrapped model too; a second call keeps our processors; ``disable_key_padding_mask`` puts
    the stock ones back; another model class or a processor it does not know is refused in one line."""
    from diffusers.models.attention_processor import AttnProcessor

    tr, nets = _student(torch.float32)
    stock = {k: type(p) for k, p in tr.attn_processors.items()}
    enable_key_padding_mask(nets.modules["student"])  # the model with the LoRA layers in it
    first = dict(tr.attn_processors)
    enable_key_padding_mask(tr)
    assert all(tr.attn_processors[k] is p for k, p in first.items())
    assert all(isinstance(p, OURS) for p in first.values())
    disable_key_padding_mask(tr)
    assert {k: type(p) for k, p in tr.attn_processors.items()} == stock
    with pytest.raises(ValueError, match="implemented for HunyuanVideo15Transformer3DModel, not Linear") as e:
        enable_key_padding_mask(torch.nn.Linear(2, 2))
    assert "\n" not in str(e.value)
    tr.transformer_blocks[1].attn.set_processor(AttnProcessor())
    with pytest.raises(
        ValueError, match="AttnProcessor at transformer_blocks.1.attn.processor is not diffusers' stock"
    ):
        enable_key_padding_mask(tr)
    assert not any(isinstance(p, OURS) for p in tr.attn_processors.values())  # nothing half-installed


def test_rcm_trainer_builds_hunyuan15_with_key_padding_masks(tmp_path):
    """The trainer's networks for a HunyuanVideo15Pipeline teacher run key-padding masks in every attention (JVP
    attention on top), and its teacher's velocity on dataset rows with padded prompts equals the stock transformer's
    (HunyuanVideo15Pipeline's call) to float32 round-off (measured: bit for bit)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    from rcm_diffusers.distill import RCMConfig, RCMTrainer
    from rcm_diffusers.distill.data import LatentDataset, model_inputs
    from rcm_diffusers.models import velocity_fn

    pipe, data = make_tiny_hunyuan15(str(tmp_path / "pipe")), make_hunyuan15_dataset(str(tmp_path / "data"))
    cfg = RCMConfig.from_yaml(CONFIG, pretrained=pipe, data_dir=data, output_dir=str(tmp_path / "out"))
    trainer = RCMTrainer(cfg)
    nets, _ = trainer._networks(torch.device("cpu"), lambda *a: None)
    model = trainer.transformer
    assert all(isinstance(p, OURS) for p in model.attn_processors.values()) and len(model.attn_processors) == 3
    assert "_rcm_jvp" in model.__dict__  # fd_type 0: JVP attention as well
    stock = HunyuanVideo15Transformer3DModel.from_pretrained(pipe, subfolder="transformer")
    assert not any(isinstance(p, OURS) for p in stock.attn_processors.values())
    batch = LatentDataset(data).get([0, 1])
    assert not batch["prompt_embeds_mask"].all() and batch["prompt_embeds_mask_2"][1].sum() == 0
    noise = torch.randn(2, *SHAPE, generator=torch.Generator().manual_seed(1))
    x, cond, _ = model_inputs("hunyuan15", {**batch, "latents": noise}, "cpu", torch.float32)
    x, r = x.float(), torch.tensor(0.6, dtype=torch.float64)  # the latents as the pipeline passes them
    with torch.no_grad(), nets.role("teacher"):
        got = velocity_fn(model)(x, r, **cond)
        want = velocity_fn(stock)(x, r, **cond)
    assert (got - want).abs().max() <= 16 * U32 * want.abs().max()
