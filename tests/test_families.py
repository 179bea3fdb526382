"""The trainers' teacher families, matched by exact class before any model loads (rcm_diffusers.distill.families):
FLUX.2 [klein], Wan Animate and Qwen-Image Edit are not taken for FLUX.2 [dev] / Wan / Qwen-Image, and an unsupported
teacher is refused in one line that lists the supported ones."""

import json
from types import SimpleNamespace

import pytest
import torch
from train_helpers import run_script

from rcm_diffusers.distill import inputs as R
from rcm_diffusers.distill.data import write_latent_dataset
from rcm_diffusers.distill.families import UnsupportedTeacher, family_of, supported, teacher_family

SUPPORTED = (
    "supported: WanPipeline / WanImageToVideoPipeline (WanTransformer3DModel), FluxPipeline (FluxTransformer2DModel), "
    "QwenImagePipeline (QwenImageTransformer2DModel), Flux2Pipeline (Flux2Transformer2DModel), "
    "HunyuanVideo15Pipeline (HunyuanVideo15Transformer3DModel)"
)


def _index(pipeline, transformer, transformer_2=None):
    return {
        "_class_name": pipeline,
        "transformer": ["diffusers", transformer],
        "transformer_2": ["diffusers", transformer_2] if transformer_2 else [None, None],
    }


@pytest.mark.parametrize(
    "index, family",
    [
        (_index("WanPipeline", "WanTransformer3DModel"), "wan"),
        (_index("WanImageToVideoPipeline", "WanTransformer3DModel"), "wan"),
        (_index("WanImageToVideoPipeline", "WanTransformer3DModel", "WanTransformer3DModel"), "wan"),  # Wan 2.2 experts
        (_index("FluxPipeline", "FluxTransformer2DModel"), "flux"),
        (_index("QwenImagePipeline", "QwenImageTransformer2DModel"), "qwen"),
        (_index("HunyuanVideo15Pipeline", "HunyuanVideo15Transformer3DModel"), "hunyuan15"),
        (_index("Flux2Pipeline", "Flux2Transformer2DModel"), "flux2"),
    ],
)
def test_supported_teachers_by_exact_class(index, family):
    assert teacher_family(index).name == family


@pytest.mark.parametrize(
    "index, match",
    [
        (
            _index("Flux2KleinPipeline", "Flux2Transformer2DModel"),
            "a Flux2KleinPipeline with Flux2Transformer2DModel is not a supported",
        ),
        (_index("Flux2Pipeline", "FluxTransformer2DModel"), "a Flux2Pipeline with FluxTransformer2DModel"),
        (
            _index("WanAnimatePipeline", "WanAnimateTransformer3DModel"),
            "a WanAnimatePipeline with WanAnimateTransformer3DModel",
        ),
        (
            _index("WanPipeline", "WanVACETransformer3DModel"),
            "a WanPipeline with WanVACETransformer3DModel is not a supported "
            r"teacher \(a WanPipeline takes WanTransformer3DModel\)",
        ),
        (_index("FluxPipeline", "Flux2Transformer2DModel"), "a FluxPipeline with Flux2Transformer2DModel"),
        (
            _index("QwenImageEditPipeline", "QwenImageTransformer2DModel"),
            "a QwenImageEditPipeline with QwenImageTransformer2DModel",
        ),
        (
            _index("HunyuanVideo15ImageToVideoPipeline", "HunyuanVideo15Transformer3DModel"),
            "a HunyuanVideo15ImageToVideoPipeline with HunyuanVideo15Transformer3DModel is not a supported",
        ),
        (
            _index("WanPipeline", "WanTransformer3DModel", "WanAnimateTransformer3DModel"),
            "with WanAnimateTransformer3DModel",
        ),
        ({"_class_name": "FluxPipeline", "transformer": [None, None]}, "a FluxPipeline with no transformer"),
    ],
)
def test_other_teachers_are_refused_naming_the_supported_ones(index, match):
    with pytest.raises(UnsupportedTeacher, match=match) as e:
        teacher_family(index)
    assert str(e.value).endswith(SUPPORTED) and "\n" not in str(e.value)


def test_prefixes_do_not_match():
    for name in ("Flux2Pipeline", "Flux2KleinPipeline", "FluxKontextPipeline", "WanAnimatePipeline", "WanVACEPipeline"):
        with pytest.raises(UnsupportedTeacher):
            family_of(name, ["FluxTransformer2DModel" if name.startswith("Flux") else "WanTransformer3DModel"])
    assert supported() in SUPPORTED


def _fake_teacher(root, pipeline, transformer):
    """A pipeline folder that is only its model_index.json and a transformer whose weights file is not a model:
    refused before anything reads it, or the run would fail on loading it instead."""
    (root / "transformer").mkdir(parents=True)
    (root / "model_index.json").write_text(json.dumps(_index(pipeline, transformer)))
    (root / "transformer" / "config.json").write_text(json.dumps({"_class_name": transformer}))
    (root / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"not a model")
    return root


def _data(root):
    g = torch.Generator().manual_seed(0)
    write_latent_dataset(
        str(root),
        {"latents": torch.randn(2, 4, 4, 4, generator=g)},
        family="flux",
        tables={
            "prompt_embeds": torch.randn(1, 6, 32, generator=g),
            "pooled_prompt_embeds": torch.randn(1, 32, generator=g),
        },
        table_index={"prompt_embeds": None, "pooled_prompt_embeds": None},
    )
    return root


@pytest.mark.parametrize(
    "pipeline, transformer",
    [("Flux2KleinPipeline", "Flux2Transformer2DModel"), ("WanAnimatePipeline", "WanAnimateTransformer3DModel")],
)
def test_check_inputs_refuses_flux2_klein_and_wan_animate_in_one_line(tmp_path, capsys, pipeline, transformer):
    teacher = _fake_teacher(tmp_path / "teacher", pipeline, transformer)
    cfg = SimpleNamespace(
        pretrained=str(teacher), data_dir=str(tmp_path / "no_data"), transformer_subfolder="transformer", experts="auto"
    )
    with pytest.raises(SystemExit) as e:
        R.check_inputs(cfg)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: --pretrained {teacher}: a {pipeline} with {transformer} is not a supported teacher")
    assert err.strip().endswith(SUPPORTED)


def test_rcm_script_refuses_a_flux2_klein_folder_before_the_teacher_loads(tmp_path):
    teacher = _fake_teacher(tmp_path / "flux2_klein", "Flux2KleinPipeline", "Flux2Transformer2DModel")
    out = tmp_path / "run"
    p = run_script(
        ["--pretrained", str(teacher), "--data_dir", str(_data(tmp_path / "data")), "--output_dir", str(out)]
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert (
        p.stderr.strip().count("\n") == 0
        and "a Flux2KleinPipeline with Flux2Transformer2DModel is not a supported" in p.stderr
    )
    assert p.stderr.strip().endswith(SUPPORTED) and not out.exists()
