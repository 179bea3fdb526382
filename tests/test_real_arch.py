"""What only shows at real sizes, at the smallest size that shows it: the shipped real
architecture configs, head dim 128 (Wan RoPE split 44/42/42) with the bf16/float32 dtype mix that
``from_pretrained(torch_dtype=bfloat16)`` produces, 512 text tokens (the Wan I2V text/image split
and the prompt padding), and the CPU smoke mode of ``benchmarks/real_arch.py``."""

import inspect
import os
import subprocess
import sys

import pytest
import torch

from rcm_diffusers.arch import arch_config, arch_meta, arch_names, build_transformer, count_parameters

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: parameter counts of the diffusers transformers built from the shipped configs (meta device); the
#: published sizes are 1.3B, 14B, 14B + 14B (two experts), 5B, 14B (I2V: + image branch), 12B, 20B, 32B, 8.3B
PARAMS = {
    "wan2.1-t2v-1.3b": 1_418_996_800,
    "wan2.1-t2v-14b": 14_288_491_584,
    "wan2.1-i2v-14b-480p": 16_394_878_784,
    "wan2.2-i2v-a14b": 14_288_901_184,
    "wan2.2-ti2v-5b": 4_999_787_712,
    "flux.1-dev": 11_901_408_320,
    "qwen-image": 20_430_401_088,
    "flux.2-dev": 32_223_281_152,
    "hunyuanvideo-1.5-t2v-480p": 8_326_608_160,  # published: 8.3B
}


def test_arch_configs_build_with_published_sizes():
    assert sorted(PARAMS) == arch_names()
    for name, n in PARAMS.items():
        assert count_parameters(name) == n, name
        m = arch_meta(name)
        assert (
            m["class_name"]
            in (
                "WanTransformer3DModel",
                "FluxTransformer2DModel",
                "QwenImageTransformer2DModel",
                "Flux2Transformer2DModel",
                "HunyuanVideo15Transformer3DModel",
            )
            and m["hub_id"]
        )
    assert arch_meta("wan2.2-i2v-a14b")["experts"] == 2
    assert arch_config("wan2.1-t2v-1.3b", num_layers=2)["num_layers"] == 2
    with pytest.raises(ValueError, match="no config keys"):
        arch_config("wan2.1-t2v-1.3b", num_blocks=2)
    with pytest.raises(ValueError, match="unknown architecture"):
        arch_config("wan9")


def _real_head_wan(tmp_path, dtype, **kw):
    """Wan2.1 block geometry cut to 1 head of dim 128 and 1 layer, saved and reloaded with
    ``torch_dtype`` so diffusers keeps its float32 modules (norms, time embedder) as in real runs."""
    from diffusers import WanTransformer3DModel

    m = build_transformer(
        "wan2.1-t2v-1.3b", num_layers=1, num_attention_heads=1, ffn_dim=64, text_dim=32, freq_dim=32, **kw
    )
    m.save_pretrained(str(tmp_path / "t"))
    return WanTransformer3DModel.from_pretrained(str(tmp_path / "t"), torch_dtype=dtype).eval()


def test_wan_jvp_at_head_dim_128_bf16_mixed_dtypes(tmp_path):
    """JVP through our processors on a bf16 Wan whose norms and time embedder stay float32 (the dtype mix
    of a real bf16 load), head dim 128 (RoPE split over 44/42/42 channels), a 3x4x4 token grid and
    512 text tokens: tangent vs the float64 model (stock processors, math SDPA, torch.func.jvp).
    Tolerance: bf16 round-off (2^-8) accumulated over one block, 5e-2 relative to the max."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from rcm_diffusers.attention import enable_jvp_attention

    bf = _real_head_wan(tmp_path, torch.bfloat16)
    dtypes = {p.dtype for p in bf.parameters()}
    assert dtypes == {torch.bfloat16, torch.float32}  # the mix the trainer sees at real sizes
    ref = _real_head_wan(tmp_path, torch.float32).double()
    g = torch.Generator().manual_seed(0)
    x, dx = torch.randn(1, 16, 3, 8, 8, generator=g), torch.randn(1, 16, 3, 8, 8, generator=g)
    ctx = torch.randn(1, 512, 32, generator=g)
    t, dt = torch.tensor([400.0]), torch.tensor([300.0])

    def call(m, dtype):
        return lambda a, b: m(
            hidden_states=a.to(dtype), timestep=b, encoder_hidden_states=ctx.to(dtype), return_dict=False
        )[0]

    with sdpa_kernel(SDPBackend.MATH):
        y_r, ty_r = torch.func.jvp(call(ref, torch.float64), (x.double(), t.double()), (dx.double(), dt.double()))
    enable_jvp_attention(bf)
    y, ty = torch.func.jvp(call(bf, torch.bfloat16), (x, t), (dx, dt))
    assert y.dtype == torch.bfloat16 and torch.isfinite(ty.float()).all()
    err = float((ty.double() - ty_r).abs().max() / ty_r.abs().max())
    assert err < 5e-2 and float(ty_r.abs().max()) > 1e-2
    assert float((y.double() - y_r).abs().max() / y_r.abs().max()) < 5e-2


def test_wan_i2v_context_shorter_than_512_text_tokens_is_refused():
    """diffusers' Wan I2V attention takes the last 512 context tokens as text. With prompts padded to
    226 (the old prepare default) + 257 CLIP tokens it would silently treat text as image tokens;
    our processor refuses with what to do (smallest case: 1 layer, 4 image + 6 text tokens)."""
    from diffusers import WanTransformer3DModel

    from rcm_diffusers.attention import enable_jvp_attention

    torch.manual_seed(0)
    m = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=16,
        ffn_dim=16,
        num_layers=1,
        image_dim=8,
        added_kv_proj_dim=16,
    )
    enable_jvp_attention(m)
    x = torch.randn(1, 4, 1, 4, 4)
    with pytest.raises(ValueError, match="max_sequence_length=512"):
        m(
            hidden_states=x,
            timestep=torch.tensor([500.0]),
            encoder_hidden_states=torch.randn(1, 6, 16),
            encoder_hidden_states_image=torch.randn(1, 4, 8),
            return_dict=False,
        )
    out = m(
        hidden_states=x,
        timestep=torch.tensor([500.0]),
        encoder_hidden_states=torch.randn(1, 512, 16),
        encoder_hidden_states_image=torch.randn(1, 4, 8),
        return_dict=False,
    )[0]
    assert out.shape == x.shape


def test_wan_i2v_dataset_text_length_checked():
    from rcm_diffusers.distill.data import model_inputs

    batch = {
        "latents": torch.zeros(1, 4, 1, 4, 4),
        "prompt_embeds": torch.zeros(1, 226, 16),
        "condition": torch.zeros(1, 8, 1, 4, 4),
        "image_embeds": torch.zeros(1, 257, 8),
    }
    with pytest.raises(ValueError, match="--max_sequence_length 512"):
        model_inputs("wan_i2v", batch, "cpu", torch.float32)
    batch["prompt_embeds"] = torch.zeros(1, 512, 16)
    assert model_inputs("wan_i2v", batch, "cpu", torch.float32)[1]["encoder_hidden_states"].shape[1] == 512


def test_prepare_pads_prompts_like_the_pipeline_samples():
    """Training embeddings must be padded as ``WanPipeline.__call__`` pads them (512), not to
    ``encode_prompt``'s own default (226): zero padding tokens go through the text projection and
    change the cross-attention output, so 226-padded training is another input than 512-padded sampling."""
    from diffusers import WanPipeline
    from tiny import tiny_wan_pipeline, tiny_wan_transformer

    from rcm_diffusers.distill.prepare import PipelineEncoder

    assert inspect.signature(WanPipeline.__call__).parameters["max_sequence_length"].default == 512
    enc = PipelineEncoder(tiny_wan_pipeline(), 32, 32, num_frames=5)
    assert enc.max_sequence_length == 512
    # the padding length matters (why the default must match): same 6 prompt tokens, padded to 226 vs 512
    m = tiny_wan_transformer()
    e = torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(0))
    x = torch.randn(1, 4, 1, 4, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        outs = [
            m(x, torch.tensor([500.0]), torch.cat([e, e.new_zeros(1, n - 6, 32)], 1), return_dict=False)[0]
            for n in (226, 512)
        ]
    assert float((outs[0] - outs[1]).abs().max() / outs[1].abs().max()) > 1e-3


@pytest.mark.slow
def test_real_arch_benchmark_smoke(tmp_path):
    """``benchmarks/real_arch.py --smoke``: 1 block of the real Wan2.1-1.3B width (2 heads), the stock
    pipeline with RCMScheduler and ``training/rcm.py`` (fd_type 0 with checkpointing, fd_type 2) end to end."""
    import json

    out = tmp_path / "res.json"
    env = {**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "benchmarks", "real_arch.py"),
            "--smoke",
            "--work",
            str(tmp_path / "w"),
            "--out",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.load(open(out))
    assert set(res["runs"]) == {"pipeline", "fd0-gc", "fd2"}
    assert res["runs"]["pipeline"]["out_finite"] and len(res["runs"]["pipeline"]["step_s"]) == 4
    for k in ("fd0-gc", "fd2"):
        r = res["runs"][k]
        assert r["rc"] == 0 and r["final"] and r["losses_finite"] and r["steps"][0]["loss_scm"] is not None
        assert r["peak_rss_gib"] > 0 and r["predicted"]["total_gib"] > 0


def test_bf16_base_trains_float32_adapters():
    """A real run loads the base in bf16; diffusers' ``add_adapter`` then makes bf16 LoRA weights, whose
    AdamW updates at lr 1e-5 round away once a weight is ~1e-2 (bf16 spacing there: 6.1e-5). The
    adapters must be float32 (peft's autocast_adapter_dtype) while the base and the output stay bf16."""
    from tiny import tiny_wan_transformer

    from rcm_diffusers.distill.adapters import Networks

    m = tiny_wan_transformer().to(torch.bfloat16)
    nets, _ = Networks.build(m, "shared", with_fake=True, lora_rank=4)
    stu = nets.trainable_parameters("student")
    assert stu and all(p.dtype == torch.float32 for p in stu.values())
    assert all(p.dtype == torch.bfloat16 for n, p in m.named_parameters() if "lora_" not in n)
    b = next(p for n, p in stu.items() if "lora_B" in n)
    with torch.no_grad():
        b.fill_(1e-2)
    opt = torch.optim.AdamW([b], lr=1e-5, weight_decay=0.0)
    b.grad = torch.ones_like(b)
    opt.step()
    assert float((b - 1e-2).abs().max()) > 5e-6  # the update survived
    x = torch.randn(1, 4, 1, 4, 4).to(torch.bfloat16)
    ctx = torch.randn(1, 6, 32).to(torch.bfloat16)
    with nets.role("student"):
        y = m(x, torch.tensor([500.0]), ctx, return_dict=False)[0]
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert b.grad is not None and b.grad.dtype == torch.float32


@pytest.mark.slow
def test_gpu_check_smoke(tmp_path):
    """``benchmarks/gpu_check.sh --smoke``: the GPU check's code (JVP attention rows, rCM iterations through
    training/rcm.py, memory-model prediction, one-rank context parallelism, both checkpointing policies, JSON) at tiny
    sizes on CPU, as CI runs it."""
    import json
    import shutil

    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = REPO
    p = subprocess.run(
        ["bash", os.path.join(REPO, "benchmarks", "gpu_check.sh"), "--smoke"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.load(open(tmp_path / "out" / "gpu_check.json"))
    assert res["smoke"] and res["jvp_attention"] and all(r["err"] < 1e-4 for r in res["jvp_attention"])
    tr = res["train"]
    assert tr["rc"] == 0 and [s["net"] for s in tr["steps"]] == ["student", "fake"]
    assert tr["predicted"]["total_gib"] > 0 and (tmp_path / "out" / "gpu_check.log").exists()
    cp = res["context_parallel_1"]  # the Ulysses hooks and collectives with a one-rank group change nothing
    assert cp["ok"] and cp["exchanges"] > 0 and all(e <= cp["tol"] for e in cp["err"].values()), cp
    for policy in ("full", "selective"):  # the checkpointing-policy section trains under each policy
        ck = res["checkpointing"][policy]
        assert (
            ck["rc"] == 0
            and ck["checkpointing_policy"] == policy
            and [s["net"] for s in ck["steps"]] == ["student", "fake"]
        )
        assert ck["predicted"]["total_gib"] > 0
