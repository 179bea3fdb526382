"""The teachers the trainers support, matched by exact class (``model_index.json``: the pipeline's ``_class_name`` and
every transformer entry), before any model loads.

A class name is never matched by prefix: ``Flux2Pipeline`` is not FLUX.1, ``Flux2KleinPipeline`` is not FLUX.2
[dev], ``WanAnimatePipeline`` is not Wan 2.1/2.2, ``QwenImageEditPipeline`` is not Qwen-Image text-to-image,
``HunyuanVideo15ImageToVideoPipeline`` is not HunyuanVideo-1.5 text-to-video;
their dimensions, conditioning and LoRA targets differ, and taking them for a supported family would fail only after
the teacher has loaded, or not at all. A teacher outside ``FAMILIES`` is refused in one line that lists the supported
ones. Adding a family is one entry here (and its data family in ``data.FAMILIES``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Family", "FAMILIES", "UnsupportedTeacher", "family_of", "teacher_family", "check_family", "supported"]


@dataclass(frozen=True)
class Family:
    """A teacher family: its name (the trainer's), the exact pipeline and transformer classes, and the data families
    (``data.FAMILIES``) its datasets carry."""

    name: str
    pipelines: tuple[str, ...]
    transformers: tuple[str, ...]
    data: tuple[str, ...]

    def describe(self) -> str:
        return f"{' / '.join(self.pipelines)} ({' / '.join(self.transformers)})"


FAMILIES = (
    # Wan 2.1 T2V / I2V, Wan 2.2 T2V / I2V (two experts: transformer and transformer_2) and TI2V
    Family("wan", ("WanPipeline", "WanImageToVideoPipeline"), ("WanTransformer3DModel",), ("wan", "wan_i2v")),
    # FLUX.1 [dev] / [schnell]
    Family("flux", ("FluxPipeline",), ("FluxTransformer2DModel",), ("flux",)),
    # Qwen-Image text-to-image (QwenImageEditPipeline, QwenImageImg2ImgPipeline, ... are other teachers)
    Family("qwen", ("QwenImagePipeline",), ("QwenImageTransformer2DModel",), ("qwen",)),
    # FLUX.2 [dev] text-to-image (Flux2KleinPipeline: the same transformer class with another text encoder, true CFG
    # and no guidance embedding, is another teacher)
    Family("flux2", ("Flux2Pipeline",), ("Flux2Transformer2DModel",), ("flux2",)),
    # HunyuanVideo-1.5 text-to-video (HunyuanVideo15ImageToVideoPipeline, the same transformer class with image
    # conditions, is another teacher)
    Family("hunyuan15", ("HunyuanVideo15Pipeline",), ("HunyuanVideo15Transformer3DModel",), ("hunyuan15",)),
)

#: model_index.json keys of the transformers a pipeline holds (Wan 2.2: two experts)
_TRANSFORMER_KEYS = ("transformer", "transformer_2")


class UnsupportedTeacher(ValueError):
    """A teacher the trainers do not support (one line, naming the supported ones)."""


def supported() -> str:
    """The supported teachers, for messages: ``WanPipeline / WanImageToVideoPipeline (WanTransformer3DModel), ...``."""
    return ", ".join(f.describe() for f in FAMILIES)


def family_of(pipeline: str | None, transformers: list[str]) -> Family:
    """The family whose pipeline class is ``pipeline`` and whose transformer class is every one of ``transformers``
    (exact names); ``UnsupportedTeacher`` otherwise."""
    for fam in FAMILIES:
        if pipeline in fam.pipelines:
            odd = [t for t in transformers if t not in fam.transformers]
            if not transformers or odd:
                got = ", ".join(odd) if odd else "no transformer"
                raise UnsupportedTeacher(
                    f"a {pipeline} with {got} is not a supported teacher (a {pipeline} takes "
                    f"{' / '.join(fam.transformers)}); supported: {supported()}"
                )
            return fam
    what = f"a {pipeline}" if pipeline else "a pipeline without a _class_name"
    if transformers:
        what += f" with {', '.join(transformers)}"
    raise UnsupportedTeacher(f"{what} is not a supported teacher; supported: {supported()}")


def teacher_family(index: dict, transformer_subfolder: str = "transformer") -> Family:
    """The family of a teacher from its ``model_index.json`` (``index``): the pipeline's ``_class_name`` and the class
    of every transformer it holds (``transformer``, ``transformer_2`` and ``transformer_subfolder``, those not null)."""
    keys = list(dict.fromkeys([*_TRANSFORMER_KEYS, transformer_subfolder]))
    classes = []
    for key in keys:
        entry = index.get(key)
        if isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[1]:
            classes.append(str(entry[1]))
    return family_of(index.get("_class_name"), list(dict.fromkeys(classes)))


def check_family(cfg, index: dict) -> Family:
    """``teacher_family`` of ``--pretrained`` (``cfg.pretrained``, its ``model_index.json`` read as ``index``); an
    unsupported teacher ends the process with one ``error:`` line and exit status 2, before any model loads."""
    from .errors import user_error

    try:
        return teacher_family(index, getattr(cfg, "transformer_subfolder", "transformer") or "transformer")
    except UnsupportedTeacher as e:
        user_error(f"--pretrained {cfg.pretrained}: {e}")
