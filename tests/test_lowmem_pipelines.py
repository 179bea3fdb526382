"""An rCM LoRA (``load_rcm_lora``) on the low-memory forms of a diffusers Wan transformer, sampled with the stock
``WanPipeline`` call and the ``RCMScheduler`` the LoRA folder names.

A setup that works must sample what a float32 Wan holding the same weight values (the format's dequantized / stored
values) with the LoRA fused samples. Both hold identical numbers, so the only difference left is float32 round-off
(fused ``W + BA`` against ``xW + (xA)B``, a dequantized matmul against torchao's scaled one): about 2^-24 per product
over dot products of 64 terms, on latents of size ~4, two blocks and two steps: ~6e-5, hence ``TOL = 1e-4``. That
those values are the format's rounding of the float weights is checked weight by weight against the format's bound
(which also catches a wrong GGUF key layout), and the LoRA must move the sample by more than ``1000 * TOL``. A setup
that cannot work is refused by ``load_rcm_lora`` in one line, with the pipeline left as it was.
"""

import gguf
import numpy as np
import pytest
import torch
from diffusers import UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import save_file
from tiny import TEXT_DIM, tiny_wan_vae, wan_scheduler_config

from rcm_diffusers import RCMScheduler, load_rcm_lora
from rcm_diffusers.lora.pipeline import WEIGHT_NAME

TOL = 1e-4
CPU = torch.device("cpu")
# every Linear has in_features 32 or 64: whole GGUF Q8_0 blocks (32 values) and torchao rows
WAN = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=4,
    out_channels=4,
    text_dim=TEXT_DIM,
    freq_dim=32,
    ffn_dim=64,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=32,
)


def _wan(weights: dict | None = None) -> WanTransformer3DModel:
    torch.manual_seed(0)
    tr = WanTransformer3DModel(**WAN).eval()
    if weights is not None:
        tr.load_state_dict(weights)
    return tr


def _pipe(transformer) -> WanPipeline:
    return WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=tiny_wan_vae(),
        transformer=transformer,
        scheduler=UniPCMultistepScheduler.from_config(wan_scheduler_config()),
    )


def _sample(pipe) -> torch.Tensor:
    emb = torch.randn(2, 6, TEXT_DIM, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = pipe(
            prompt_embeds=emb,
            height=64,
            width=64,
            num_frames=1,  # 8x8 latents
            num_inference_steps=2,
            guidance_scale=1.0,
            output_type="latent",
            generator=torch.Generator().manual_seed(0),
        )
    return out.frames.float()


@pytest.fixture(scope="module")
def lora(tmp_path_factory) -> str:
    """An rCM LoRA folder: rank-4 pairs on every block Linear and ``scheduler/`` (not the from_config defaults)."""
    out = tmp_path_factory.mktemp("rcm_lora")
    g = torch.Generator().manual_seed(1)
    sd = {}
    for name, m in _wan().named_modules():
        if name.startswith("blocks.") and isinstance(m, torch.nn.Linear):
            sd[f"transformer.{name}.lora_A.weight"] = torch.randn(4, m.in_features, generator=g) / m.in_features
            sd[f"transformer.{name}.lora_B.weight"] = torch.randn(m.out_features, 4, generator=g) / 2
    save_file(sd, str(out / WEIGHT_NAME))
    RCMScheduler(sigma_max=200.0, mid_t=[1.1]).save_pretrained(str(out / "scheduler"))
    return str(out)


def _check_sample(pipe, weights: dict, lora: str) -> None:
    """``pipe`` (LoRA loaded by load_rcm_lora) samples what a float32 Wan holding ``weights`` with the LoRA fused
    samples, within TOL, and far from the same Wan without the LoRA."""
    assert isinstance(pipe.scheduler, RCMScheduler) and pipe.scheduler.sigma_max == 200.0
    ref = _pipe(_wan(weights))
    load_rcm_lora(ref, lora)
    ref.fuse_lora()
    plain = _pipe(_wan(weights))
    plain.scheduler = ref.scheduler
    out = _sample(pipe)
    err, moved = (out - _sample(ref)).abs().max().item(), (out - _sample(plain)).abs().max().item()
    assert err <= TOL and moved > 1000 * TOL, (err, moved)


def _within(stored: dict, bound) -> None:
    """Every weight of the float Wan is within ``bound(w)`` of the value the low-memory form stores."""
    for k, w in _wan().state_dict().items():
        diff = (stored[k] - w).abs()
        assert (diff <= bound(k, w)).all(), (k, diff.max().item())


# ----------------------------------------------------------------------------------------------------------- GGUF

_TO_WAN = [  # diffusers name -> original Wan name (what GGUF files of Wan hold); diffusers' loader maps back
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("attn1", "self_attn"),
    ("attn2", "cross_attn"),
    (".to_out.0.", ".o."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
    ("norm2", "norm3"),  # the cross-attention norm
    ("proj_out", "head.head"),
]
Q8_0, BF16 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.BF16


def _gguf_type(key: str, w: torch.Tensor):
    """Q8_0 for the block and head Linears, BF16 for the condition embedder's, F32 (None) for the rest."""
    if w.ndim != 2:
        return None
    return BF16 if key.startswith("condition_embedder.") else Q8_0


def _gguf_bound(key: str, w: torch.Tensor) -> torch.Tensor:
    """Q8_0: per block of 32, d = max|w| / 127 stored in float16; |q d16 - w| <= d/2 + 127 |d16 - d| < 0.6 d.
    BF16: round to nearest, 7 mantissa bits: |err| <= 2^-8 |w|. F32: exact."""
    t = _gguf_type(key, w)
    if t == Q8_0:
        return (w.reshape(-1, 32).abs().amax(1, keepdim=True) / 127 * 0.6).expand(-1, 32).reshape(w.shape)
    return w.abs() * 2**-8 if t == BF16 else torch.zeros_like(w)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> tuple[str, str]:
    """``(file, config folder)``: the float Wan written as a GGUF file in the original Wan key layout."""
    d = tmp_path_factory.mktemp("gguf")
    src = _wan()
    src.save_config(str(d))
    writer = gguf.GGUFWriter(str(d / "wan.gguf"), arch="wan")
    for k, w in src.state_dict().items():
        name = k
        for a, b in _TO_WAN:
            name = name.replace(a, b)
        name = "head.modulation" if name == "scale_shift_table" else name.replace("scale_shift_table", "modulation")
        t = _gguf_type(k, w)
        if t is None:
            writer.add_tensor(name, w.numpy())
        else:
            writer.add_tensor(name, gguf.quants.quantize(w.numpy().astype(np.float32), t), raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(d / "wan.gguf"), str(d)


def test_gguf_transformer_samples_like_its_dequantized_float_copy(gguf_file, lora):
    """``from_single_file(GGUF, quantization_config=GGUFQuantizationConfig(compute_dtype=float32))``: the LoRA runs
    unfused next to the quantized layers (peft wraps diffusers' GGUFLinear). ``fuse_lora`` cannot merge into GGUF
    blocks and raises (a diffusers / peft limit, docs/sampling.md)."""
    from diffusers import GGUFQuantizationConfig
    from diffusers.quantizers.gguf.utils import GGUFLinear, dequantize_gguf_tensor

    path, config = gguf_file
    tr = WanTransformer3DModel.from_single_file(
        path, config=config, quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32)
    )
    assert isinstance(tr.blocks[0].attn1.to_q, GGUFLinear) and isinstance(tr.proj_out, GGUFLinear)
    weights = {k: dequantize_gguf_tensor(v).float() for k, v in tr.state_dict().items()}
    _within(weights, _gguf_bound)
    pipe = _pipe(tr)
    load_rcm_lora(pipe, lora)
    assert isinstance(pipe.transformer.blocks[0].attn1.to_q.base_layer, GGUFLinear)
    _check_sample(pipe, weights, lora)
    with pytest.raises(RuntimeError, match="size of tensor"):
        pipe.fuse_lora()


# -------------------------------------------------------------------------------------------------------- torchao


@pytest.mark.parametrize("fmt", ["int8", "float8"])
def test_torchao_weight_only_samples_like_its_dequantized_float_copy(fmt, lora, tmp_path):
    """``from_pretrained(..., quantization_config=TorchAoConfig(Int8WeightOnlyConfig() / Float8WeightOnlyConfig()))``:
    peft wraps the quantized Linears (its torchao LoRA layer), the LoRA runs unfused. torchao is not in the dev extra:
    importing it prints warnings on every ``import diffusers``, which the one-line error tests would count."""
    pytest.importorskip("torchao", minversion="0.16", reason="torchao not installed (pip install 'torchao>=0.16')")
    from diffusers import TorchAoConfig
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig
    from torchao.utils import TorchAOBaseTensor

    _wan().save_pretrained(str(tmp_path))
    qc = Int8WeightOnlyConfig() if fmt == "int8" else Float8WeightOnlyConfig()
    tr = WanTransformer3DModel.from_pretrained(
        str(tmp_path), quantization_config=TorchAoConfig(qc), torch_dtype=torch.float32
    )
    assert isinstance(tr.blocks[0].attn1.to_q.weight, TorchAOBaseTensor)
    stored = tr.state_dict()
    weights = {k: v.dequantize() if isinstance(v, TorchAOBaseTensor) else v for k, v in stored.items()}

    def bound(key, w):
        """Per-row scale s = max|w| / 127 (int8) or / 448 (float8 e4m3): int8 rounds to s/2; e4m3 to 2^-4 |w|
        (3 mantissa bits) or half its smallest subnormal step, 2^-10 s. Unquantized (time embedder): exact."""
        if not isinstance(stored[key], TorchAOBaseTensor):
            return torch.zeros_like(w)
        amax = w.abs().amax(1, keepdim=True)
        return amax / 254 * 1.01 if fmt == "int8" else (w.abs() / 16 + amax / 448 * 2**-10) * 1.001

    _within(weights, bound)
    pipe = _pipe(tr)
    load_rcm_lora(pipe, lora)
    _check_sample(pipe, weights, lora)


# ------------------------------------------------------------------------------------------- layerwise casting


def test_layerwise_casting_after_the_lora_samples_like_the_float8_values(lora):
    """``load_rcm_lora`` then ``enable_layerwise_casting(storage float8_e4m3fn, compute float32)``: diffusers casts
    the block Linears to float8 and keeps the LoRA layers in float32."""
    pipe = _pipe(_wan())
    load_rcm_lora(pipe, lora)
    pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    layer = pipe.transformer.blocks[0].attn1.to_q
    assert layer.base_layer.weight.dtype == torch.float8_e4m3fn and layer.lora_A["rcm"].weight.dtype == torch.float32
    sd = pipe.transformer.state_dict()
    weights = {k.replace("base_layer.", ""): v.float() for k, v in sd.items() if ".lora_" not in k}

    def bound(key, w):
        """e4m3 without scale: 2^-4 |w| (3 mantissa bits) or half the smallest subnormal step, 2^-10."""
        module, _, name = key.rpartition(".")
        cast = sd.get(f"{module}.base_layer.{name}", sd.get(key)).dtype == torch.float8_e4m3fn
        return w.abs() / 16 + 2**-10 if cast else torch.zeros_like(w)

    _within(weights, bound)
    _check_sample(pipe, weights, lora)
    with pytest.raises(RuntimeError, match="Float8"):
        pipe.fuse_lora()  # peft cannot merge into the float8 storage (docs/sampling.md)


def test_layerwise_casting_before_the_lora_is_refused_unchanged(lora):
    """Cast first: peft would create the LoRA in the float8 storage dtype (its weights rounded to 3 mantissa bits,
    and no float8 matmul on CPU), so ``load_rcm_lora`` refuses in one line before loading anything."""
    pipe = _pipe(_wan())
    pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    before, scheduler = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}, pipe.scheduler
    with pytest.raises(ValueError) as e:
        load_rcm_lora(pipe, lora)
    msg = str(e.value)
    assert "\n" not in msg and "layerwise casting" in msg and "call load_rcm_lora, then enable_layerwise_casting" in msg
    assert not any(isinstance(m, BaseTunerLayer) for m in pipe.transformer.modules())
    assert pipe.scheduler is scheduler and not getattr(pipe.transformer, "peft_config", None)
    after = pipe.transformer.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


# ------------------------------------------------------------------------------------------------------ offloading


@pytest.mark.parametrize("where", ["transformer", "pipe"])
def test_group_offload_block_level(where, lora):
    """``enable_group_offload(onload_device=cpu, offload_device=cpu, offload_type="block_level",
    num_blocks_per_group=1)`` on the transformer or the whole pipeline (CPU: no streams); diffusers takes the hooks
    off while loading the LoRA and puts them back."""
    from diffusers.hooks.group_offloading import _is_group_offload_enabled

    pipe = _pipe(_wan())
    target = pipe.transformer if where == "transformer" else pipe
    target.enable_group_offload(
        onload_device=CPU, offload_device=CPU, offload_type="block_level", num_blocks_per_group=1
    )
    load_rcm_lora(pipe, lora)
    assert _is_group_offload_enabled(pipe.transformer)
    _check_sample(pipe, _wan().state_dict(), lora)


def test_model_cpu_offload_is_put_back_on_its_device(lora):
    """``enable_model_cpu_offload(device="cpu")``: diffusers' load_lora_weights re-enables the offload with no device
    (the default accelerator; none on CPU); ``load_rcm_lora`` puts it back on the device it had."""
    from accelerate.hooks import CpuOffload

    pipe = _pipe(_wan())
    pipe.enable_model_cpu_offload(device="cpu")
    load_rcm_lora(pipe, lora)
    assert isinstance(pipe.transformer._hf_hook, CpuOffload) and pipe._offload_device.type == "cpu"
    _check_sample(pipe, _wan().state_dict(), lora)
