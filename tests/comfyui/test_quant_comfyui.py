"""Quantized exports inside a current ComfyUI, on the CPU: each loads through ``UNETLoader`` and its
forward equals our fake-quant model under the matching ``target`` (docs/math.md §7).

Runs only when COMFYUI_PATH points at a ComfyUI checkout and this Python has ComfyUI's requirements,
comfy-kitchen and diffusers (see docs/comfyui.md). Tested with ComfyUI 0.29.0 (upstream commit 4f874c5,
2026-07-29) and comfy-kitchen 0.2.24 (the version its requirements pin), torch 2.13.0+cpu. torchvision and
torchaudio have no wheels for a CPU torch 2.13 here: when they are missing, this file installs import-time
stand-ins for them (any use raises), which the Wan path never calls.

What runs where (read from ``comfy/ops.py`` ``pick_operations`` / ``mixed_precision_ops.Linear.forward``,
``comfy/quant_ops.py`` and comfy-kitchen's ``tensor/*.py`` and ``backends/eager/quantization.py``):

- **int8** (``int8_tensorwise``): W8A8 with dynamic per-row activations on every device; here ComfyUI's own
  ops run it end to end on the CPU (comfy-kitchen eager ``int8_linear``: ``quantize_int8_rowwise`` +
  ``torch._int_mm``).
- **nvfp4 / fp8**: ComfyUI quantizes activations only where ``supports_nvfp4_compute`` (SM >= 10.0) /
  ``supports_fp8_compute`` (SM >= 8.9) hold; elsewhere (CPU, older GPUs) the format is "disabled" and the
  layer runs weight-only. The GPU path is reproduced here by making those two checks return True: ComfyUI's
  own loader, layer dispatch and activation quantizer (``QuantizedTensor.from_float`` -> comfy-kitchen eager
  ``quantize_nvfp4`` / ``quantize_per_tensor_fp8``) then run on the CPU, and the low-precision GEMM (cuBLAS
  kernels, binary only) is replaced by ComfyUI's own dequantize fallback: the exactly representable products
  accumulated in float32, which is what the tensor-core GEMM computes up to summation order. The CUDA
  quantization kernels are binary only too; the eager backend is the reference they are tested against.
  Without the override the same exports run weight-only, which is checked against target ``fake``.

The diffusers and ComfyUI Wan implementations agree to ~1.2e-6 relative in float32 on this model, the floor of
every comparison below; a wrong arithmetic is 3e-3 (fp8) to 1e-2 (nvfp4) away.
"""

import asyncio
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

import pytest
import torch

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [
    pytest.mark.skipif(
        not COMFYUI_PATH or not os.path.isfile(os.path.join(COMFYUI_PATH or "", "nodes.py")),
        reason="set COMFYUI_PATH to a ComfyUI checkout (and run with a Python that has its requirements and "
        "comfy-kitchen) to run the ComfyUI quantization tests",
    ),
    # ComfyUI's quantized layers (comfy/quant_ops.py) run on comfy-kitchen; without it they fail inside ComfyUI
    # instead of telling what is missing
    pytest.mark.skipif(
        importlib.util.find_spec("comfy_kitchen") is None,
        reason="comfy-kitchen is not installed in this Python (pip install comfy-kitchen, the version ComfyUI's "
        "requirements.txt pins): ComfyUI's quantized layers need it",
    ),
]

TOL = 1e-5  # relative L2 of the whole forward; the two Wan implementations differ by ~1.2e-6
LAYER_TOL = 1e-6  # one quantized layer on the same input: float32 summation order only


class _Missing:
    """Attribute chain of a stand-in module; calling it raises."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *a, **k):
        raise RuntimeError(f"{self._name}: torchvision/torchaudio stand-in (not installed) was called")


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = set(roots)

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = types.ModuleType(spec.name)
        m.__path__ = []

        def getattr_(attr, _n=spec.name):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Missing(f"{_n}.{attr}")

        m.__getattr__ = getattr_
        return m

    def exec_module(self, module):
        pass


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    import diffusers  # noqa: F401  (decides torchvision availability before any stand-in exists)
    from diffusers import WanTransformer3DModel  # noqa: F401

    import rcm_diffusers.quant.export  # noqa: F401

    missing = [m for m in ("torchvision", "torchaudio") if importlib.util.find_spec(m) is None]
    finder = _StandIns(missing) if missing else None
    if finder:
        sys.meta_path.insert(0, finder)
    sys.path.insert(0, COMFYUI_PATH)
    from comfy.cli_args import args

    args.cpu = True
    import comfy.model_management as mm
    import comfyui_version
    import folder_paths
    import nodes

    root = tmp_path_factory.mktemp("comfy_quant")
    for name in ("diffusion_models", "custom_nodes"):
        (root / name).mkdir()
        folder_paths.add_model_folder_path(name, str(root / name), is_default=True)
    if "RCMSampler" not in nodes.NODE_CLASS_MAPPINGS:
        os.symlink(os.path.join(REPO, "comfy_nodes"), root / "custom_nodes" / "rcm_nodes")
        asyncio.run(nodes.init_extra_nodes(init_custom_nodes=True, init_api_nodes=False))
    from importlib.metadata import version

    print(
        f"\nComfyUI {comfyui_version.__version__}, comfy-kitchen {version('comfy-kitchen')}, "
        f"torch {torch.__version__}, "
        f"stand-ins: {missing or 'none'}"
    )
    yield root, nodes, mm
    if finder:
        sys.meta_path.remove(finder)


def tiny_wan():
    """Diffusers Wan 2.1 T2V that ComfyUI detects as such (dim 128 = one head of 128, text_dim 4096)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=1,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=4096,
        freq_dim=256,
        ffn_dim=256,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
    ).eval()


def inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 16, 2, 8, 8, generator=g), torch.tensor([600.0]), 0.5 * torch.randn(1, 8, 4096, generator=g)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def load_in_comfy(comfy, monkeypatch, name, native):
    """``UNETLoader`` on ``name``; ``native``: the GPU path (see the module docstring)."""
    _, nodes, mm = comfy
    import comfy.quant_ops as cq

    if native:
        monkeypatch.setattr(mm, "supports_nvfp4_compute", lambda *a, **k: True)
        monkeypatch.setattr(mm, "supports_fp8_compute", lambda *a, **k: True)
    calls = []
    orig = cq.QuantizedTensor.from_float.__func__

    def from_float(cls, tensor, layout, *a, **k):
        calls.append(layout)
        return orig(cls, tensor, layout, *a, **k)

    monkeypatch.setattr(cq.QuantizedTensor, "from_float", classmethod(from_float))
    cls = nodes.NODE_CLASS_MAPPINGS["UNETLoader"]
    (model,) = cls().load_unet(unet_name=name, weight_dtype="default")
    mm.load_models_gpu([model])
    assert type(model.model).__name__ == "WAN21" and model.model.get_dtype() == torch.float32
    return model.model.diffusion_model, calls


def export_and_load(comfy, monkeypatch, fmt, act_scale, native):
    """Our ``target comfyui`` model in ``fmt`` (calibrated when static), its export loaded by ``UNETLoader``:
    ``(ours, layers, dm, calls, ren)`` with ``ren``: ComfyUI module name -> our quantized layer's name."""
    from rcm_diffusers.quant.export import _rename_wan, export_quantized
    from rcm_diffusers.quant.modules import calibration, quantize_transformer

    root, nodes, _ = comfy
    assert {"RCMSampler", "RCMSigmas", "RCMLoraLoader"} <= set(nodes.NODE_CLASS_MAPPINGS)  # the pack loaded
    ours = tiny_wan()
    layers = quantize_transformer(ours, fmt, target="comfyui", act_scale=act_scale)
    if any(m.static_act for m in layers.values()):
        with calibration(ours):
            ours(*inputs(1))
    name = f"q_{fmt}_{act_scale}.safetensors"
    export_quantized(ours, root / "diffusion_models" / name, layout="comfyui")
    dm, calls = load_in_comfy(comfy, monkeypatch, name, native)
    ren = {
        v.removesuffix(".weight"): k.removesuffix(".weight")
        for k, v in _rename_wan([f"{n}.weight" for n in layers]).items()
    }
    return ours, layers, dm, calls, ren


def record_layers(modules):
    """Forward hooks keeping each module's first ``(input, output)`` in the returned dict (by the given key)."""
    seen = {}

    def keep(key):
        def hook(mod, args, y):
            seen.setdefault(key, (args[0].clone(), y.clone()))  # returns None: the output stays as it is

        return hook

    return seen, [m.register_forward_hook(keep(k)) for k, m in modules.items()]


def weight_only_output(ours, layers, x, t, ctx):
    for m in layers.values():
        m.target, m.act_fmt = "fake", None  # the weight-only arithmetic: a different model
    with torch.no_grad():
        return ours(x, t, ctx, return_dict=False)[0]


@pytest.mark.parametrize(
    "fmt,act_scale,native", [("nvfp4", "static", True), ("nvfp4", "dynamic", True), ("fp8_e4m3", "static", True)]
)
def test_export_runs_in_comfyui_as_trained(comfy, monkeypatch, fmt, act_scale, native):
    ours, layers, dm, calls, ren = export_and_load(comfy, monkeypatch, fmt, act_scale, native)
    x, t, ctx = inputs(2)
    seen, hooks = record_layers({o: dm.get_submodule(o) for o in ren})
    with torch.no_grad():
        y_comfy = dm(x, t, ctx)
        y_ours = ours(x, t, ctx, return_dict=False)[0]
        # layer by layer on ComfyUI's own inputs: no propagation of the two implementations' 1e-6 difference
        layer_err = max(rel(layers[ren[o]](a), y) for o, (a, y) in seen.items())
    for h in hooks:
        h.remove()
    assert len(seen) == len(layers)
    y_wo = weight_only_output(ours, layers, x, t, ctx)
    err, gap = rel(y_comfy, y_ours), rel(y_comfy, y_wo)
    print(
        f"\n{fmt} ({act_scale}{', GPU path' if native else ''}): ComfyUI vs target comfyui {err:.2e} "
        f"(worst layer on identical inputs {layer_err:.2e}); vs weight-only {gap:.2e}"
    )
    assert layer_err <= LAYER_TOL
    assert err <= TOL
    assert gap > 10 * err  # the comparison resolves the activation arithmetic
    if native:  # ComfyUI's own activation quantizer ran in every quantized layer
        assert len(calls) == len(layers) and set(calls) == {
            "TensorCoreNVFP4Layout" if fmt == "nvfp4" else "TensorCoreFP8E4M3Layout"
        }


def test_int8_export_runs_in_comfyui_up_to_level_flips(comfy, monkeypatch):
    """INT8 (W8A8, dynamic per-row activations) runs on ComfyUI's own ops end to end and equals our model up to
    int8 level flips, each accounted for.

    Where the flips come from: each quantized layer rounds ``x / s`` per row, ``s = amax_row / 127``, to an
    integer level. The diffusers and ComfyUI Wan give the first layer inputs that differ by float32 round-off
    (~1e-7 relative), so ``x / s`` differs by ``d = |x_o / s_o - x_c / s_c|`` (~1e-5 of a level); an element
    whose ``x / s`` lies within ``d`` of a rounding boundary (a half-integer) rounds to the neighbouring level
    on one side: a flip, one level (``s``) away. Each flip moves the layer's output by ``s |W[:, k]|``, far
    more than round-off, so downstream layers see larger ``d`` and flip more (1e-3 of a level on average
    over the model). Boundaries are one level apart, so element ``i`` flips with probability ``min(d_i, 1)``
    and the expected count is ``E = sum_i min(d_i, 1)`` (measured ``d``, both runs).

    What is asserted, per quantized layer (``o``: our run, ``c``: ComfyUI's, levels from comfy-kitchen's own
    ``quantize_int8_rowwise`` on each run's recorded input):

    1. no level differs by more than one, and the flips number at most ``E + 6 sqrt(E) + 6`` (a Poisson tail
       far out) and at most 1% of the elements: a wrong scale (e.g. ``amax / 128``) moves most levels;
    2. the layer outputs differ by no more than what the flips and the scale difference explain, element by
       element: ``y_o - y_c = (q_o - q_c) s_o W^T + q_c (s_o - s_c) W^T`` + float32 round-off, so
       ``|y_o - y_c| <= s_o |q_o - q_c| |W|^T + |s_o - s_c| |q_c| |W|^T + 2 gamma_{K+4} (|q_o s_o| |W|^T + |b|)``
       with ``gamma_n = n u / (1 - n u)``, ``u = 2^-24`` (the standard bound of a K-term float32 dot product,
       four roundings added for the scale products and the bias; ComfyUI's int32 sum of products is exact);
    3. with the flips undone (our model run with ComfyUI's levels in every quantized layer, each scaled by
       our own ``s``), the whole forward equals ComfyUI's within ``TOL``, the bound the two Wan
       implementations meet for every other format: the flips are the whole end-to-end difference;
    4. the end-to-end difference ``err`` is then at most ``TOL`` plus the flips' effect on our model
       (``rel(y_ours, y_forced)``, triangle inequality), and that effect is what the flips' size predicts:
       a flip is a rounding error like all the others, one level instead of up to half a level, so with the
       network answering all rounding errors (energy ``R = sum (x - q s)^2``) by the int8 vs weight-only gap
       ``G``, the flips (energy ``F = sum_flips s^2``) move the output by about ``G sqrt(F / R)`` (independent
       errors add in quadrature). ``err <= TOL + 3 G sqrt(F / R)``: a margin of 3 over that root-mean-square
       estimate for a sum of only ~100 signed terms.

    Measured with torch 2.13.0+cpu: 125 flips in 77824 activations (expected 134), worst layer at 0.97 of its
    bound (a lone flip is bounded exactly), ``err`` 1.17e-4, 1.18e-6 with ComfyUI's levels, estimate 7.6e-5.
    """
    from comfy_kitchen.backends.eager.quantization import quantize_int8_rowwise

    ours, layers, dm, _, ren = export_and_load(comfy, monkeypatch, "int8", "dynamic", False)
    x, t, ctx = inputs(2)
    seen_c, hooks = record_layers({o: dm.get_submodule(o) for o in ren})
    seen_o, hooks_o = record_layers({o: layers[ren[o]] for o in ren})
    with torch.no_grad():
        y_comfy = dm(x, t, ctx)
        y_ours = ours(x, t, ctx, return_dict=False)[0]
    for h in hooks + hooks_o:
        h.remove()
    assert len(seen_c) == len(seen_o) == len(layers)
    with torch.no_grad():  # on identical inputs the levels agree: float32 summation order only
        assert max(rel(layers[ren[o]](a), y) for o, (a, y) in seen_c.items()) <= LAYER_TOL

    u = 2.0**-24
    levels_c, n_flips, n_elems, expected, worst_ratio, e_flip, e_round = {}, 0, 0, 0.0, 0.0, 0.0, 0.0
    for o in ren:
        (xc, yc), (xo, yo) = seen_c[o], seen_o[o]
        lay = layers[ren[o]]
        K = xc.shape[-1]
        qc, sc = quantize_int8_rowwise(xc.reshape(-1, K))
        qo, so = quantize_int8_rowwise(xo.reshape(-1, K))
        levels_c[o] = qc
        dq = (qo.int() - qc.int()).abs()
        assert dq.max() <= 1, f"{o}: levels differ by {dq.max().item()}"
        d = (xo.reshape(-1, K) / so - xc.reshape(-1, K) / sc).abs().clamp(max=1.0)
        n_flips += int(dq.sum())
        n_elems += dq.numel()
        expected += float(d.sum())
        e_flip += float((dq * so**2).sum())  # squared size of the flips: one level each
        e_round += float(((xo.reshape(-1, K) - qo.float() * so) ** 2).sum())  # of all rounding errors
        with torch.no_grad():
            W = lay.quantized_weight().abs()
        b = lay.bias.detach().abs() if lay.bias is not None else torch.zeros(W.shape[0])
        gamma = (K + 4) * u / (1 - (K + 4) * u)
        bound = (
            so * (dq.float() @ W.T)
            + (so - sc).abs() * (qc.abs().float() @ W.T)
            + 2 * gamma * ((qo.abs().float() * so) @ W.T + b)
        )
        dy = (yo - yc).reshape(-1, W.shape[0]).abs()
        worst_ratio = max(worst_ratio, float((dy / bound).max()))
        assert (dy <= bound).all(), f"{o}: output differs by more than its flips explain"

    forced_levels = {}

    def force(o):
        def pre(mod, args):
            xin = args[0]
            K = xin.shape[-1]
            s = (xin.reshape(-1, K).abs().amax(-1, keepdim=True).float() / 127.0).clamp(min=1e-30)
            forced = (levels_c[o].float() * s).reshape(xin.shape).to(xin.dtype)
            forced_levels[o] = quantize_int8_rowwise(forced.reshape(-1, K))[0]
            return (forced,)

        return pre

    hooks = [layers[ren[o]].register_forward_pre_hook(force(o)) for o in ren]
    with torch.no_grad():
        y_forced = ours(x, t, ctx, return_dict=False)[0]
    for h in hooks:
        h.remove()
    assert all(torch.equal(forced_levels[o], levels_c[o]) for o in ren)  # our quantizer kept ComfyUI's levels
    y_wo = weight_only_output(ours, layers, x, t, ctx)
    err, err_forced = rel(y_comfy, y_ours), rel(y_comfy, y_forced)
    flip_effect, gap = rel(y_ours, y_forced) * (y_forced.norm() / y_comfy.norm()).item(), rel(y_comfy, y_wo)
    estimate = gap * (e_flip / e_round) ** 0.5
    print(
        f"\nint8: {n_flips} level flips in {n_elems} activations ({n_flips / n_elems:.1e}; expected {expected:.1f}), "
        f"worst layer output difference / its bound {worst_ratio:.2f}; ComfyUI vs target comfyui {err:.2e}, "
        f"with ComfyUI's levels {err_forced:.2e}, flips' effect {flip_effect:.2e} (estimate {estimate:.2e}); "
        f"vs weight-only {gap:.2e}; "
        f"torch {torch.__version__}"
    )
    assert n_flips <= expected + 6 * expected**0.5 + 6 and n_flips <= 1e-2 * n_elems
    assert err_forced <= TOL
    assert err <= TOL + flip_effect
    assert err <= TOL + 3 * estimate
    assert gap > 10 * err_forced  # the comparison resolves the activation arithmetic


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_e4m3"])
def test_weight_only_export_is_what_comfyui_runs_on_cpu(comfy, monkeypatch, fmt):
    """Without NVFP4 / FP8 kernels (this CPU) ComfyUI runs those exports weight-only: target ``fake`` matches;
    the export warns that GPUs with kernels run it otherwise."""
    from rcm_diffusers.quant.export import export_quantized
    from rcm_diffusers.quant.modules import quantize_transformer

    root, _, _ = comfy
    ours = tiny_wan()
    quantize_transformer(ours, fmt, target="fake")
    name = f"wo_{fmt}.safetensors"
    with pytest.warns(UserWarning, match="trained weight-only, but ComfyUI on GPUs"):
        export_quantized(ours, root / "diffusion_models" / name, layout="comfyui")
    dm, calls = load_in_comfy(comfy, monkeypatch, name, native=False)
    x, t, ctx = inputs(3)
    with torch.no_grad():
        err = rel(dm(x, t, ctx), ours(x, t, ctx, return_dict=False)[0])
    print(f"\n{fmt} weight-only on CPU: ComfyUI vs target fake {err:.2e}")
    assert err <= TOL and calls == []


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_e4m3", "int8"])
def test_rcm_lora_loader_on_a_quantized_export_equals_comfyuis_own_loader(comfy, monkeypatch, fmt):
    """RCMLoraLoader refused every LoRA on an NVFP4 model (it compared with the packed uint8 storage) while
    LoraLoaderModelOnly applies it: both now give the same model output on each quantized export."""
    import folder_paths

    from rcm_diffusers.lora.io import save_lora
    from rcm_diffusers.quant.export import export_quantized
    from rcm_diffusers.quant.modules import quantize_transformer

    root, nodes, mm = comfy
    (root / "loras").mkdir(exist_ok=True)
    folder_paths.add_model_folder_path("loras", str(root / "loras"), is_default=True)
    ours = tiny_wan()
    layers = quantize_transformer(ours, fmt, target="fake")
    name = f"lora_base_{fmt}.safetensors"
    export_quantized(ours, root / "diffusion_models" / name, layout="comfyui", check_comfyui=False)
    g = torch.Generator().manual_seed(5)
    lora = {}
    for target, (n, k) in {"attn1.to_q": (128, 128), "ffn.net.0.proj": (256, 128), "ffn.net.2": (128, 256)}.items():
        assert f"blocks.0.{target}" in layers  # a quantized layer
        lora[f"transformer.blocks.0.{target}.lora_A.weight"] = 0.05 * torch.randn(4, k, generator=g)
        lora[f"transformer.blocks.0.{target}.lora_B.weight"] = 0.05 * torch.randn(n, 4, generator=g)
    save_lora(root / "loras" / f"q_{fmt}.safetensors", lora, arch="wan", format="comfyui")
    cls = nodes.NODE_CLASS_MAPPINGS["UNETLoader"]
    (model,) = cls().load_unet(unet_name=name, weight_dtype="default")
    x, t, ctx = inputs(4)
    outs = {}
    for loader in ("RCMLoraLoader", "LoraLoaderModelOnly", None):
        if loader is None:
            m = model
        else:
            node = nodes.NODE_CLASS_MAPPINGS[loader]
            kw = dict(model=model, lora_name=f"q_{fmt}.safetensors", strength_model=1.0)
            (m,) = node.execute(**kw).args if hasattr(node, "define_schema") else getattr(node(), node.FUNCTION)(**kw)
        mm.load_models_gpu([m])
        with torch.no_grad():
            outs[loader] = m.model.diffusion_model(x, t, ctx).clone()
    err, effect = rel(outs["RCMLoraLoader"], outs["LoraLoaderModelOnly"]), rel(outs["RCMLoraLoader"], outs[None])
    print(f"\n{fmt}: RCMLoraLoader vs LoraLoaderModelOnly {err:.2e}; LoRA effect {effect:.2e}")
    assert err <= 1e-6 and effect > 1e-3
