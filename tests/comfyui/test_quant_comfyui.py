"""Quantized exports inside a current ComfyUI, on the CPU: each loads through ``UNETLoader`` and its
forward equals our fake-quant model under the matching ``target`` (issue 14; docs/math.md §7).

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
# int8 rounds activations per row to 255 levels: the implementations' ~1e-7 input differences flip the rounding
# of a few of the ~1e5 activation elements (one level = amax_row / 127), measured 1.2e-6 to 3.8e-5 end to end
# depending on the input; the layer-wise check above is the exact statement. No second implementation is needed
# for this: ComfyUI's own Wan with each quantized layer's output replaced by ours on the same input (layer-wise
# 2e-7, float32 summation order) ends 1.2e-4 away (measured 2026-12-01; nvfp4 0, fp8 4e-8 the same way), so
# <= 1e-5 end to end would need bitwise-identical int8 arithmetic
INT8_TOL = 1e-4


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

    print(f"\nComfyUI {comfyui_version.__version__}, comfy-kitchen {version('comfy-kitchen')}, torch {torch.__version__}, "
          f"stand-ins: {missing or 'none'}")
    yield root, nodes, mm
    if finder:
        sys.meta_path.remove(finder)


def tiny_wan():
    """Diffusers Wan 2.1 T2V that ComfyUI detects as such (dim 128 = one head of 128, text_dim 4096)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=1, attention_head_dim=128, in_channels=16,
                                 out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=256, num_layers=2,
                                 cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6).eval()


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


@pytest.mark.parametrize("fmt,act_scale,native", [("nvfp4", "static", True), ("nvfp4", "dynamic", True),
                                                  ("fp8_e4m3", "static", True), ("int8", "dynamic", False)])
def test_export_runs_in_comfyui_as_trained(comfy, monkeypatch, fmt, act_scale, native):
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
    x, t, ctx = inputs(2)
    seen = {}
    ren = {v.removesuffix(".weight"): k.removesuffix(".weight") for k, v in _rename_wan([f"{n}.weight" for n in layers]).items()}
    def keep(o):
        def hook(mod, args, y):
            seen.setdefault(o, (args[0].clone(), y.clone()))  # returns None: the output stays as it is
        return hook

    hooks = [dm.get_submodule(o).register_forward_hook(keep(o)) for o in ren]
    with torch.no_grad():
        y_comfy = dm(x, t, ctx)
        y_ours = ours(x, t, ctx, return_dict=False)[0]
        # layer by layer on ComfyUI's own inputs: no propagation of the two implementations' 1e-6 difference
        layer_err = max(rel(layers[ren[o]](a), y) for o, (a, y) in seen.items())
    for h in hooks:
        h.remove()
    assert len(seen) == len(layers)
    for m in layers.values():
        m.target, m.act_fmt = "fake", None  # the weight-only arithmetic: a different model
    with torch.no_grad():
        y_wo = ours(x, t, ctx, return_dict=False)[0]
    err, gap = rel(y_comfy, y_ours), rel(y_comfy, y_wo)
    print(f"\n{fmt} ({act_scale}{', GPU path' if native else ''}): ComfyUI vs target comfyui {err:.2e} "
          f"(worst layer on identical inputs {layer_err:.2e}); vs weight-only {gap:.2e}")
    assert layer_err <= LAYER_TOL
    assert err <= (TOL if fmt != "int8" else INT8_TOL)
    assert gap > 10 * err  # the comparison resolves the activation arithmetic
    if native:  # ComfyUI's own activation quantizer ran in every quantized layer
        assert len(calls) == len(layers) and set(calls) == {"TensorCoreNVFP4Layout" if fmt == "nvfp4" else "TensorCoreFP8E4M3Layout"}


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
