"""Training on one card (rcm_diffusers/distill/lowmem.py): a quantized frozen base computes exactly what a base holding
its dequantized weights computes, block swap and activation offload change no number, the swap loads every swapped
block in every pass and keeps at most two on the device, the memory model's new terms match the tensors counted on
CPU, and bad settings end with one line, exit status 2 and nothing written."""

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import REPO, TEXT_DIM, make_dataset, make_tiny_wan, make_tiny_wan2

from rcm_diffusers.distill import losses as L
from rcm_diffusers.distill import lowmem as LM
from rcm_diffusers.distill.activation_checkpointing import enable_checkpointing
from rcm_diffusers.distill.adapters import Networks
from rcm_diffusers.distill.config import RCMConfig
from rcm_diffusers.distill.memory import (
    TrainSetup,
    host_activation_bytes,
    linear_weight_bytes,
    predict_training,
    weight_parts,
)
from rcm_diffusers.models import velocity_fn
from rcm_diffusers.quant.formats import QTensor, dequantize
from rcm_diffusers.trigflow import TrigFlowDenoiser

CONFIG = os.path.join(REPO, "training", "configs", "tiny-wan-test.yaml")


def _wan(layers: int = 2, seed: int = 0):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=TEXT_DIM,
        freq_dim=32,
        ffn_dim=32,
        num_layers=layers,
        rope_max_seq_len=32,
    )


def _dequantize_base(model, fmt):
    """The reference: every block Linear's weight replaced by its dequantized value."""
    model.requires_grad_(False)
    with torch.no_grad():
        for block in LM.transformer_blocks(model):
            for _, _, _, lin in LM.frozen_linears(block):
                lin.weight.copy_(LM.dequantized_weight(lin.weight, fmt))


def test_formats_store_one_byte_and_dequantize_as_quant_formats():
    """fp8: float8 values, one float32 scale per row and 128 inputs; int8: int8 values, one scale per row; the
    dequantized weight is quant.formats' ``values * scale``, within the format's rounding of the original."""
    w = 0.02 * torch.randn(40, 300, generator=torch.Generator().manual_seed(0))
    v, s = LM.quantize_weight(w, "fp8")
    assert v.dtype == torch.float8_e4m3fn and v.shape == (40, 384) and s.shape == (40, 3, 1)
    blocks = torch.nn.functional.pad(v.float(), (0, 0)).view(40, 3, 128)
    want = dequantize(QTensor("fp8_e4m3", (40, 3, 128), blocks, s)).reshape(40, 384)[:, :300]
    assert torch.equal(LM.dequantized_weight(w, "fp8"), want)
    assert float((want - w).abs().max() / w.abs().max()) <= 2.0**-4  # E4M3: 3 mantissa bits, 1/16 relative
    v, s = LM.quantize_weight(w, "int8")
    assert v.dtype == torch.int8 and s.shape == (40, 1)
    assert float(((LM.dequantized_weight(w, "int8") - w).abs() / s).max()) <= 0.5 + 1e-6  # half a step
    n = sum(t.numel() * t.element_size() for t in LM.quantize_weight(w, "fp8"))
    assert n == linear_weight_bytes(40, 300, "fp8", "float32") == 40 * 384 + 4 * 40 * 3
    with pytest.raises(ValueError, match="base_dtype fp8: this device \\(mps\\) has no float8 kernels"):
        LM.check_base_dtype("fp8", "mps")


def _build(fmt, *, reference=False, swap=0, acts=False, layers=2, window=LM.PREFETCH_BLOCKS, experts=False):
    """Tiny Wan (or two experts) with student / fake adapters (lora_B drawn), full checkpointing, JVP attention."""
    from rcm_diffusers.attention import enable_jvp_attention
    from rcm_diffusers.distill.experts import WanExpertSwitch

    m = WanExpertSwitch(_wan(layers, 1), _wan(layers, 2), 0.875) if experts else _wan(layers)
    if reference:
        for net in LM.base_networks(m):
            _dequantize_base(net, fmt)
    nets, _ = Networks.build(m, "shared", with_fake=True, lora_rank=4)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    enable_checkpointing(m, "full", 4)
    enable_jvp_attention(m)
    low = (
        None
        if reference
        else LM.apply_low_memory(
            m, base_dtype=fmt, blocks_to_swap=swap, activation_offload=acts, device="cpu", swap_window=window
        )
    )
    return m, nets, low


def _scm_dmd_grads(m, nets):
    """Student gradients of the sCM loss (exact JVP) and of the DMD term's student pass, fake-score gradients of its
    flow-matching loss: the three kinds of pass a step makes."""
    g = torch.Generator().manual_seed(0)
    x_t = torch.randn(2, 4, 2, 4, 8, generator=g, dtype=torch.float64)
    F_T = torch.randn(2, 4, 2, 4, 8, generator=g, dtype=torch.float64)
    cond = {"encoder_hidden_states": torch.randn(2, 5, TEXT_DIM, generator=g)}
    t = torch.tensor([0.4, 1.45], dtype=torch.float64)
    den = TrigFlowDenoiser(velocity_fn(m, "float"), torch.float32)
    with nets.role("student"):
        loss, _ = L.scm_loss(lambda x, tt: den.F(x, tt, **cond), x_t, t, F_T, step=0, tangent_warmup=0, fd_type=0)
    loss.sum().backward()
    x0 = nets.x0("student", x_t, t, cond)
    with torch.no_grad():
        x_fake, x_teach = nets.x0("fake", x_t, t, cond), nets.x0("teacher", x_t, t, cond)
    (x0 * (x_fake - x_teach)).sum().backward()
    loss_f, _ = L.fake_score_loss(nets.F_fn("fake", cond), x0.detach(), t, F_T)
    loss_f.sum().backward()
    return {n: p.grad.clone() for r in ("student", "fake") for n, p in nets.trainable_parameters(r).items()}


@pytest.mark.parametrize("fmt,swap,acts,experts", [("weight_dtype", 1, True, False), ("fp8", 2, True, True)])
def test_gradients_equal_the_dequantized_base_bit_for_bit(fmt, swap, acts, experts):
    """sCM with the exact JVP, the DMD student pass and the fake score, one network or two experts: the gradients on
    a quantized / swapped / offloaded base equal those on a plain base holding the dequantized weights, bit for bit."""
    ref = _scm_dmd_grads(*_build(fmt, reference=True, experts=experts)[:2])
    m, nets, low = _build(fmt, swap=swap, acts=acts, experts=experts)
    got = _scm_dmd_grads(m, nets)
    assert ref.keys() == got.keys() and len(ref) > 0
    assert all(torch.equal(ref[k], got[k]) for k in ref), [k for k in ref if not torch.equal(ref[k], got[k])][:3]
    assert all(float(v.abs().max()) > 0 for v in got.values())
    if swap:
        assert low.swap.h2d_copies > 0 and low.swap.max_resident <= LM.PREFETCH_BLOCKS
    if acts:
        assert low.activations.host_bytes > 0 and low.activations.h2d_bytes > 0


def test_swap_loads_every_swapped_block_in_every_pass_host_to_device_only():
    """4 blocks, the last 3 swapped, window 2: a no-grad pass, the JVP pass, and a grad pass (forward, and the
    recompute in its backward) each load each swapped block once, in order, with at most 2 swapped blocks on the
    device at any block and none after the pass; the host copies are never written, the LoRA weights never move."""
    m, nets, low = _build("fp8", swap=3, layers=4)
    sw = low.swap
    host = {
        k: [(h, h._version, h.clone()) for s in stores for h in s.host if h is not None]
        for k, stores in sw.stores.items()
    }
    lora = {n: (p.data_ptr(), p.device) for n, p in m.named_parameters() if p.requires_grad}
    assert not any(
        h.untyped_storage().data_ptr() in {p for p, _ in lora.values()} for hs in host.values() for h, _, _ in hs
    )
    per_block = {k: sum(h.numel() * h.element_size() for h, _, _ in hs) for k, hs in host.items()}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 2, 4, 8, generator=g)
    cond = {"encoder_hidden_states": torch.randn(1, 5, TEXT_DIM, generator=g)}
    den = TrigFlowDenoiser(velocity_fn(m, "float"), torch.float32)
    t = torch.tensor([0.9], dtype=torch.float64)

    def passes():
        with torch.no_grad(), nets.role("teacher"):
            yield "nograd", lambda: den.F(x, t, **cond)
        with torch.no_grad(), nets.role("student"):
            yield (
                "jvp",
                lambda: torch.func.jvp(lambda a: den.F(a, t, **cond), (x.double(),), (torch.ones_like(x).double(),)),
            )
        with nets.role("student"):
            yield "grad", lambda: den.F(x, t, **cond).square().sum().backward()

    seen = {}
    for name, run in passes():
        sw.trace, before = [], sw.h2d_bytes
        run()
        runs = [k for k, _ in sw.trace]
        loaded = sw.h2d_bytes - before
        seen[name] = (runs, loaded)
        assert all(k in res for k, res in sw.trace if k in sw.stores), name  # a swapped block runs loaded
        assert max(len(res) for _, res in sw.trace) <= 2 and len(sw.resident) <= (2 if name == "grad" else 0), name
    order = [(0, i) for i in range(4)]
    assert seen["nograd"][0] == order and seen["jvp"][0] == order
    assert seen["grad"][0] == order + order[::-1]  # forward, then the checkpoint recomputes in reverse
    one = sum(per_block.values())
    assert [seen[p][1] for p in ("nograd", "jvp", "grad")] == [one, one, 2 * one]
    assert sw.max_resident == 2
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
    opt.step()
    assert all(h._version == v and torch.equal(h, c) for hs in host.values() for h, v, c in hs)
    assert {n: (p.data_ptr(), p.device) for n, p in m.named_parameters() if p.requires_grad} == lora


def test_memory_terms_match_the_tensors_counted_on_cpu():
    """At 4 blocks of width 512: resident weights, host weights, the prefetch buffer and the host-held checkpoints
    of the memory model against the tensors counted (0.95-1.05)."""
    from rcm_diffusers.arch import arch_config, build_transformer

    over = dict(num_layers=4, num_attention_heads=4, ffn_dim=1024)
    m = build_transformer("wan2.1-t2v-1.3b", dtype=torch.float32, **over)
    nets, _ = Networks.build(m, "shared", with_fake=True, lora_rank=4)
    enable_checkpointing(m, "full", 4)
    frames, hw, text = 2, 16, 20
    low = LM.apply_low_memory(m, base_dtype="fp8", blocks_to_swap=3, activation_offload=True, device="cpu")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, frames, hw, hw, generator=g)
    cond = {"encoder_hidden_states": torch.randn(1, text, m.config.text_dim, generator=g)}
    low.swap.trace = []
    with nets.role("student"):
        out = velocity_fn(m, "float")(x, torch.tensor([0.5]), **cond)
    host_acts = low.activations.last_host_bytes
    out.sum().backward()
    prefetch = max(sum(low.swap.block_bytes(k) for k in res) for _, res in low.swap.trace)
    lora = {id(p) for r in ("student", "fake") for p in nets.trainable_parameters(r).values()}
    resident = (
        sum(p.numel() * p.element_size() for p in m.parameters() if id(p) not in lora) + low.device_weight_bytes()
    )
    s = TrainSetup.from_config(
        arch_config("wan2.1-t2v-1.3b", **over),
        "WanTransformer3DModel",
        tokens=frames * hw * hw // 4,
        text_tokens=text,
        lora_rank=4,
        weight_dtype="float32",
        base_dtype="fp8",
        blocks_to_swap=3,
        activation_offload=True,
    )
    parts = weight_parts(s)
    ratios = {
        "resident": (parts["device"] - parts["prefetch"]) / resident,
        "host": parts["host"] / low.swap.host_bytes(),
        "prefetch": parts["prefetch"] / prefetch,
        "host_activations": host_activation_bytes(s) / host_acts,
    }
    assert all(0.95 <= r <= 1.05 for r in ratios.values()), ratios
    pred = predict_training(s)
    assert pred["host"] == parts["host"] + host_activation_bytes(s) and pred["dequant"] == 1024 * 512 * 4


# ----------------------------------------------------------------------------- the trainer


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """A tiny Wan, a tiny two-expert Wan, their data, and copies whose block Linears hold the dequantized weights."""
    from diffusers import WanTransformer3DModel

    root = tmp_path_factory.mktemp("lowmem")
    pipes = {"one": make_tiny_wan(str(root / "wan")), "two": make_tiny_wan2(str(root / "wan2"))}
    for kind, fmt in (("one", "fp8"), ("two", "int8")):
        ref = str(root / f"{kind}-{fmt}")
        shutil.copytree(pipes[kind], ref)
        for sub in ("transformer", "transformer_2") if kind == "two" else ("transformer",):
            t = WanTransformer3DModel.from_pretrained(ref, subfolder=sub)
            _dequantize_base(t, fmt)
            t.save_pretrained(os.path.join(ref, sub))
        pipes[f"{kind}-{fmt}"] = ref
    return pipes, make_dataset(str(root / "data"), "wan"), root


def _train(teachers, pipe, name, **kw):
    from rcm_diffusers.distill import RCMTrainer

    pipes, data, root = teachers
    out = str(root / name)
    cfg = RCMConfig.from_yaml(
        CONFIG,
        pretrained=pipes[pipe],
        data_dir=data,
        output_dir=out,
        max_steps=2,
        tangent_warmup=0,
        student_update_freq=2,
        checkpoint_every=0,
        fd_type=0,
        gradient_checkpointing=True,
        progress=False,
        **kw,
    )
    trainer = RCMTrainer(cfg)
    trainer.train()
    return out, trainer


def _loras(out):
    files = [os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs if f == "pytorch_lora_weights.safetensors"]
    return {os.path.relpath(f, out): load_file(f) for f in files}


@pytest.mark.parametrize(
    "pipe,kw",
    [
        ("one-fp8", dict(cm_type="scm", base_dtype="fp8", blocks_to_swap=1, activation_offload=True)),
        ("two-int8", dict(cm_type="dcm", base_dtype="int8", blocks_to_swap=2, activation_offload=True)),
    ],
    ids=["scm-fp8-swap1-offload", "two-experts-dcm-int8-swap2-offload"],
)
def test_training_on_one_card_equals_the_dequantized_base(teachers, pipe, kw):
    """A student iteration (sCM with the exact JVP, or dCM; DMD) and a fake-score iteration on the quantized, swapped,
    offloaded base export the LoRA and its EMA of the plain run on the base holding the dequantized weights, bit for
    bit; for two experts both experts' files."""
    ref, _ = _train(teachers, pipe, f"{pipe}-ref", cm_type=kw["cm_type"])
    low, trainer = _train(teachers, pipe.split("-")[0], f"{pipe}-low", **kw)
    a, b = _loras(ref), _loras(low)
    assert len(a) == (4 if pipe.startswith("two") else 2) and a.keys() == b.keys()
    for f in a:
        assert a[f].keys() == b[f].keys() and all(torch.equal(a[f][k], b[f][k]) for k in a[f]), f
    sw = trainer.lowmem.swap
    assert sw.max_resident <= LM.PREFETCH_BLOCKS and sw.h2d_copies > 0 and trainer.lowmem.activations.host_bytes > 0


def _refused(capsys, teachers, name, monkeypatch=None, **kw):
    pipes, data, root = teachers
    out = root / name
    with pytest.raises(SystemExit) as e:
        _train(teachers, "one", name, **kw)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), (e.value.code, err)
    assert not out.exists()
    return err[0]


def test_bad_settings_one_line_exit_2_nothing_written(teachers, capsys, monkeypatch):
    """blocks_to_swap beyond the blocks, an unknown format, fp8 on a device without float8 kernels, the one-card options
    with context parallelism or FSDP2, and a setting the card cannot hold (whose message names one that fits, and that
    one does fit)."""
    from rcm_diffusers.distill.rcm_trainer import main

    assert "has 2 transformer blocks" in _refused(capsys, teachers, "swap3", blocks_to_swap=3)
    with pytest.raises(SystemExit) as e:
        main(
            [
                "--config",
                CONFIG,
                "--pretrained",
                teachers[0]["one"],
                "--data_dir",
                teachers[1],
                "--output_dir",
                str(teachers[2] / "fp4"),
                "--base_dtype",
                "fp4",
            ]
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == ["error: config option base_dtype = 'fp4': use 'weight_dtype', 'fp8' or 'int8'"]
    monkeypatch.setattr(LM, "_card", lambda: ("mps", None, "mps"))
    assert "no float8 kernels" in _refused(capsys, teachers, "mps", base_dtype="fp8")
    monkeypatch.undo()
    monkeypatch.setenv("WORLD_SIZE", "2")  # as the launcher of 2 processes sets it (only read before any process group)
    assert "context_parallel_size > 1" in _refused(capsys, teachers, "cp", blocks_to_swap=1, context_parallel_size=2)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert "FSDP2 shards the frozen base" in _refused(capsys, teachers, "fsdp", base_dtype="int8")
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    # a budget between the plain setting's predicted peak and the all-swapped one's
    from rcm_diffusers.distill.memory import GiB

    s = LM.train_setup(
        RCMConfig.from_yaml(
            CONFIG,
            pretrained="p",
            data_dir="d",
            fd_type=0,
            gradient_checkpointing=True,
            student_update_freq=2,
            tangent_warmup=0,
        ),
        {k: v for k, v in _wan().config.items() if not k.startswith("_")},
        "WanTransformer3DModel",
        (4, 1, 4, 4),
        4,
        1,
    )
    plain = predict_training(s)["total"]
    import dataclasses

    smaller = predict_training(dataclasses.replace(s, base_dtype="int8"))["total"]  # fp8 pads 24 inputs to 128
    assert smaller < plain
    budget = (plain + smaller) / 2 / 0.9
    line = _refused(capsys, teachers, "small", device_memory_gb=budget / 1e9)
    assert f"predicted peak {plain / GiB:.1f} GiB does not fit" in line
    assert "the cheapest setting that fits: --base_dtype" in line
    words = line.split("fits: ")[1].split()
    named = dataclasses.replace(
        s, base_dtype=words[1], blocks_to_swap=int(words[3]), activation_offload=words[5] == "true"
    )
    assert predict_training(named)["total"] <= 0.9 * budget


@pytest.mark.parametrize("name", ["Wan 2.1", "FLUX.1", "Qwen-Image", "FLUX.2", "HunyuanVideo-1.5"])
def test_every_trainer_family_runs_on_a_quantized_swapped_offloaded_base(name):
    """Each trainer family's transformer (tiny, at the inputs its stock pipeline gives it: tests/flow_models.py): the
    one-card options reach every block (each holds int8 Linears; one swapped block loaded host to device in a pass)
    and the output with its gradient equals the plain base holding the dequantized weights, bit for bit."""
    import copy

    from flow_models import case, record_inputs

    tr, args, kwargs = record_inputs(case(name))
    orig, ref = copy.deepcopy(tr), copy.deepcopy(tr)
    _dequantize_base(ref, "int8")
    blocks = LM.transformer_blocks(tr)
    c = tr.config
    assert len(blocks) == c.num_layers + c.get("num_single_layers", 0) > 0, f"{type(tr).__name__}: {len(blocks)}"
    tr.requires_grad_(False)
    low = LM.apply_low_memory(tr, base_dtype="int8", blocks_to_swap=1, activation_offload=True, device="cpu")
    assert all(any(isinstance(m, LM.FrozenLinear) for m in b.modules()) for b in blocks)
    x_key = "hidden_states" if "hidden_states" in kwargs else None

    def run(model):
        kw = dict(kwargs)
        x = (kw[x_key] if x_key else args[0]).detach().clone().requires_grad_(True)
        if x_key:
            kw[x_key] = x
            out = model(*args, **kw)
        else:
            out = model(x, *args[1:], **kw)
        y = out[0] if isinstance(out, (tuple, list)) else out.sample
        (y.float() ** 2).sum().backward()
        return y.detach(), x.grad

    y_ref, g_ref = run(ref)
    y, g = run(tr)
    assert torch.equal(y, y_ref) and torch.equal(g, g_ref)
    assert not torch.equal(y, run(orig)[0])  # int8 rounding reached the output: the base is quantized
    assert low.swap.h2d_copies > 0 and low.activations.host_bytes > 0
