"""A frozen Wan base whose block Linears come already quantized from a file (option ``base_weights``,
rcm_diffusers/distill/base_weights.py): a ComfyUI-style fp8_scaled file trains, bit for bit, as a teacher folder
holding its dequantized weights, the block Linears stay FP8 from the file to the FrozenLinear stores, and files that
cannot serve end with one line, exit status 2 and nothing written."""

import json
import os
import shutil

import pytest
import safetensors
import torch
from safetensors.torch import load_file, save_file
from train_helpers import REPO, make_dataset, make_tiny_wan

from rcm_diffusers.distill import lowmem as LM
from rcm_diffusers.distill.base_weights import block_linears, scan_base_weights
from rcm_diffusers.distill.config import RCMConfig
from rcm_diffusers.lora.keys import to_original

CONFIG = os.path.join(REPO, "training", "configs", "tiny-wan-test.yaml")
FP8_MAX = 448.0


def _comfy_fp8_scaled(sd: dict, linears) -> tuple[dict, dict]:
    """``(file tensors, reference state dict)``: the block Linears as float8_e4m3fn with a per-tensor float32
    ``scale_weight`` = amax / 448 under original Wan names (``diffusion_model.`` prefix, ``scaled_fp8`` marker), every
    other tensor changed (x 1.25, so the run must take it from the file); the reference holds ``values * scale``."""
    ref = {}
    for k, v in sd.items():
        name = k[: -len(".weight")]
        if name in linears:
            scale = (v.abs().amax() / FP8_MAX).float()
            q = (v / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            ref[k] = q.to(v.dtype) * scale.to(v.dtype)
        else:
            ref[k] = v * 1.25
    plain = {k: v for k, v in ref.items() if k[: -len(".weight")] not in linears}
    out = to_original(plain, arch="wan", prefix="diffusion_model.", source="diffusers")
    for name in linears:
        w = sd[f"{name}.weight"]
        scale = (w.abs().amax() / FP8_MAX).float()
        okey = next(iter(to_original({f"{name}.weight": w}, arch="wan", prefix="diffusion_model.")))
        out[okey] = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out[okey[: -len(".weight")] + ".scale_weight"] = scale.reshape(())
    out["scaled_fp8"] = torch.zeros(2, dtype=torch.float8_e4m3fn)
    return out, ref


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny teacher, its data, its fp8_scaled file and a teacher folder holding the dequantized weights."""
    from diffusers import WanTransformer3DModel

    root = tmp_path_factory.mktemp("basew")
    pipe = make_tiny_wan(str(root / "wan"))
    t = WanTransformer3DModel.from_pretrained(pipe, subfolder="transformer")
    linears = block_linears(t)
    tensors, ref = _comfy_fp8_scaled(t.state_dict(), linears)
    path = str(root / "wan_fp8_scaled.safetensors")
    save_file(tensors, path)
    ref_pipe = str(root / "wan-ref")
    shutil.copytree(pipe, ref_pipe)
    t.load_state_dict(ref)
    t.save_pretrained(os.path.join(ref_pipe, "transformer"))
    return {"pipe": pipe, "ref": ref_pipe, "file": path, "data": make_dataset(str(root / "data"), "wan")}, root


def _cfg(setup, pretrained, name, **kw):
    paths, root = setup
    return RCMConfig.from_yaml(
        CONFIG,
        pretrained=paths[pretrained],
        data_dir=paths["data"],
        output_dir=str(root / name),
        max_steps=2,
        tangent_warmup=0,
        student_update_freq=2,
        checkpoint_every=0,
        fd_type=0,
        gradient_checkpointing=True,
        progress=False,
        **kw,
    )


def _loras(out):
    files = [os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs if f == "pytorch_lora_weights.safetensors"]
    return {os.path.relpath(f, out): load_file(f) for f in files}


class _Spy:
    """``safetensors.safe_open`` recording ``(file, key, dtype)`` of every tensor read."""

    def __init__(self, real, reads):
        self.real, self.reads = real, reads

    def __call__(self, path, *a, **kw):
        f, reads = self.real(path, *a, **kw), self.reads

        class File:
            def __enter__(self):
                f.__enter__()
                return self

            def __exit__(self, *exc):
                return f.__exit__(*exc)

            def __getattr__(self, n):
                return getattr(f, n)

            def get_tensor(self, k):
                t = f.get_tensor(k)
                reads.append((os.path.basename(str(path)), k, t.dtype))
                return t

        return File()


def test_fp8_scaled_file_trains_as_its_dequantized_weights_and_stays_fp8(setup, monkeypatch):
    """sCM (exact JVP), DMD and a fake-score iteration with base_weights = the fp8_scaled file (base_dtype
    weight_dtype keeps its format; one block on the host) export the LoRA and EMA of the plain run on the teacher
    folder holding ``values * scale``, bit for bit. No block Linear weight is ever read in another dtype than FP8 or
    from the teacher folder, the stores hold FP8 values with one float32 scale each, and no block Linear weight
    parameter remains in the model."""
    from rcm_diffusers.distill import RCMTrainer

    paths, root = setup
    RCMTrainer(_cfg(setup, "ref", "ref", cm_type="scm")).train()
    reads = []
    monkeypatch.setattr(safetensors, "safe_open", _Spy(safetensors.safe_open, reads))
    trainer = RCMTrainer(_cfg(setup, "pipe", "low", cm_type="scm", base_weights=paths["file"], blocks_to_swap=1))
    trainer.train()
    monkeypatch.undo()
    a, b = _loras(str(root / "ref")), _loras(str(root / "low"))
    assert len(a) == 2 and a.keys() == b.keys()
    for f in a:
        assert a[f].keys() == b[f].keys() and all(torch.equal(a[f][k], b[f][k]) for k in a[f]), f

    t = trainer.transformer
    layers = trainer.lowmem.layers
    assert trainer.lowmem.base_dtype == "fp8" and len(layers) == 2 * 10  # per block: attn1 / attn2 q k v o, ffn x 2
    for m in layers:
        v, s = m.store.host if m.store.host is not None else m.store.dev
        assert v.dtype == torch.float8_e4m3fn and v.shape == (m.out_features, m.in_features)
        assert s.dtype == torch.float32 and s.dim() == 0
    from diffusers import WanTransformer3DModel

    lin_names = block_linears(WanTransformer3DModel.from_pretrained(paths["pipe"], subfolder="transformer"))
    params = {n.replace(".base_layer", "") for n, _ in t.named_parameters()}
    assert not {f"{n}.weight" for n in lin_names} & params
    big = [(n, p.dtype) for n, p in t.named_parameters() if "blocks." in n and "lora_" not in n and p.dim() == 2]
    assert big == [], big
    block_w = [
        (f, k, d)
        for f, k, d in reads
        if ".blocks." in f".{k}" and k.endswith(".weight") and "norm" not in k and "lora" not in k
    ]
    assert block_w and all(f == "wan_fp8_scaled.safetensors" and d == torch.float8_e4m3fn for f, k, d in block_w), [
        r for r in block_w if r[2] != torch.float8_e4m3fn
    ][:3]


def _refused(capsys, setup, name, **kw):
    from rcm_diffusers.distill import RCMTrainer

    paths, root = setup
    with pytest.raises(SystemExit) as e:
        RCMTrainer(_cfg(setup, "pipe", name, cm_type="scm", **kw)).train()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), (e.value.code, err)
    assert not (root / name).exists()
    return err[0]


def _variant(setup, name, change, metadata=None) -> str:
    paths, root = setup
    t = load_file(paths["file"])
    change(t)
    p = str(root / name)
    save_file(t, p, metadata=metadata)
    return p


def test_files_that_cannot_serve_one_line_exit_2_nothing_written(setup, capsys):
    """A missing block Linear, a wrong shape, an NVFP4 export, a file that is not safetensors, a missing path and a
    base_dtype other than the file's format: one ``error:`` line, exit status 2, no run folder."""
    paths, root = setup
    key = "diffusion_model.blocks.1.ffn.2.weight"
    miss = _variant(setup, "missing.safetensors", lambda t: t.pop(key))
    assert "no weight for 1 of the teacher's 20 block Linears, e.g. blocks.1.ffn.2.weight" in _refused(
        capsys, setup, "missing", base_weights=miss
    )
    wrong = _variant(setup, "shape.safetensors", lambda t: t.update({key: t[key][:, :-1].contiguous()}))
    assert f"{key} is [24, 31], the teacher's blocks.1.ffn.net.2 is [24, 32]" in _refused(
        capsys, setup, "shape", base_weights=wrong
    )

    def nvfp4(t):
        w = t.pop("diffusion_model.blocks.0.self_attn.q.weight")
        t.pop("diffusion_model.blocks.0.self_attn.q.scale_weight")
        t["diffusion_model.blocks.0.self_attn.q.weight"] = torch.zeros(w.shape[0], w.shape[1] // 2, dtype=torch.uint8)
        t["diffusion_model.blocks.0.self_attn.q.weight_scale"] = torch.ones(128, 4).to(torch.float8_e4m3fn)
        t["diffusion_model.blocks.0.self_attn.q.weight_scale_2"] = torch.ones(())

    meta = {"_quantization_metadata": json.dumps({"layers": {"blocks.0.self_attn.q": {"format": "nvfp4"}}})}
    fp4 = _variant(setup, "nvfp4.safetensors", nvfp4, meta)
    line = _refused(capsys, setup, "nvfp4", base_weights=fp4)
    assert "1 layer(s) in nvfp4 (e.g. blocks.0.self_attn.q)" in line and "--base_dtype fp8" in line
    pickle = root / "wan.pt"
    torch.save({"x": torch.zeros(1)}, pickle)
    assert "not a safetensors file" in _refused(capsys, setup, "pickle", base_weights=str(pickle))
    assert "no such file" in _refused(capsys, setup, "nofile", base_weights=str(root / "none.safetensors"))
    line = _refused(capsys, setup, "int8", base_weights=paths["file"], base_dtype="int8")
    assert "--base_dtype int8 with --base_weights" in line and "are fp8" in line


def test_scan_reads_a_diffusers_layout_int8_export_and_refuses_unquantized_weights(setup):
    """The QAD export's int8_tensorwise layers (diffusers names, ``weight_scale`` [N, 1]) are held as int8 with
    their per-channel scales; a file whose block Linears are float is refused; an unscaled fp8 file is fp8."""
    from diffusers import WanTransformer3DModel

    paths, root = setup
    t = WanTransformer3DModel.from_pretrained(paths["pipe"], subfolder="transformer")
    config = {k: v for k, v in t.config.items() if not k.startswith("_")}
    sd = t.state_dict()
    linears = block_linears(t)
    q = dict(sd)
    for n in linears:
        w = sd[f"{n}.weight"]
        s = w.abs().amax(1, keepdim=True) / 127
        q[f"{n}.weight"] = (w / s).round().clamp(-127, 127).to(torch.int8)
        q[f"{n}.weight_scale"] = s.float()
    p = str(root / "int8.safetensors")
    save_file(
        q,
        p,
        metadata={
            "_quantization_metadata": json.dumps({"layers": {n: {"format": "int8_tensorwise"} for n in linears}})
        },
    )
    bw = scan_base_weights(p, WanTransformer3DModel, config)
    assert bw.fmt == "int8" and bw.scaled and set(bw.linears) == set(linears)
    plain = str(root / "plain.safetensors")
    save_file(sd, plain)
    with pytest.raises(ValueError, match="F32, not quantized"):
        scan_base_weights(plain, WanTransformer3DModel, config)
    unscaled = {k: (v.to(torch.float8_e4m3fn) if k[: -len(".weight")] in linears else v) for k, v in sd.items()}
    save_file(unscaled, plain)
    bw = scan_base_weights(plain, WanTransformer3DModel, config)
    assert bw.fmt == "fp8" and not bw.scaled
    v = torch.tensor([[1.0, -2.0], [0.5, 448.0]]).to(torch.float8_e4m3fn)
    assert torch.equal(LM.dequantize_weight(v, None, "fp8", (2, 2), torch.float32), v.float())
    s = torch.tensor(0.01)
    assert torch.equal(LM.dequantize_weight(v, s, "fp8", (2, 2), torch.bfloat16), v.to(torch.bfloat16) * s.bfloat16())
