"""The embedded digits benchmark: data, class-conditional tiny Wan teacher, evaluator, samplers, report.

A small but real distillation problem that runs on a CPU with nothing downloaded:

- **Data**: scikit-learn's 8x8 handwritten digits (1797 images, 10 classes, shipped with the
  package), a fixed stratified 75/25 train / held-out split (``SPLIT_SEED``), pixels ``0..16``
  scaled to ``[-1, 1]``, stored as Wan latents ``[B, C=1, T=1, H=8, W=8]``. No upsampling: with
  patch ``(1, 2, 2)`` the 8x8 image is 16 tokens on a 4x4 grid, enough for attention to matter,
  and 16x16 would make every teacher/student call 4x dearer on 2 CPU cores for the same content.
- **Teacher**: ``WanTransformer3DModel`` (~0.94M parameters, dim 128, 4 layers), rectified flow
  (``x_r = (1 - r) x0 + r eps``, target ``v = eps - x0``, docs/math.md §1), conditioned through
  ``encoder_hidden_states`` = a learned ``[TEXT_LEN, TEXT_DIM]`` embedding per class; row
  ``NULL_CLASS`` (= 10) is the null embedding for CFG. The table ships beside the model
  (``class_embeddings.safetensors``) in a diffusers ``WanPipeline`` directory.
- **Evaluator**: a seeded MLP classifier on the train split; class accuracy of samples, Fréchet
  distance in its 64-d hidden features against the held-out split, within-class diversity
  relative to real held-out digits.

Modules: ``teacher`` (data, teacher, latent dataset), ``evaluate`` (classifier, FD, diversity), ``sample`` (teacher /
student samplers), ``report`` (grids, report table, demo run variants); the shipped files are under ``assets/``.
"""

from __future__ import annotations

from .evaluate import (
    DigitClassifier,
    Evaluator,
    frechet_distance,
    load_classifier,
    train_classifier,
    within_class_diversity,
)
from .report import ABLATIONS, Row, run_overrides, run_state, save_grid, write_report
from .sample import sample_pipeline, sample_student, sample_teacher, timed
from .teacher import (
    ASSETS,
    CLASSIFIER_PATH,
    HELD_OUT_FRACTION,
    NULL_CLASS,
    NUM_CLASSES,
    ODE_PAIRS2_DIR,
    ODE_PAIRS_DIR,
    SPLIT_SEED,
    TEACHER2_DIR,
    TEACHER_DIR,
    TEXT_DIM,
    TEXT_LEN,
    atomic_write_text,
    build_teacher,
    init_class_embeddings,
    load_digits_split,
    load_student,
    load_student_pipeline,
    load_teacher,
    save_teacher,
    teacher_config,
    to_pixels,
    train_rectified_flow,
    write_latent_dataset_for,
    write_ode_pairs,
)

__all__ = [
    "ASSETS",
    "TEACHER_DIR",
    "TEACHER2_DIR",
    "ODE_PAIRS_DIR",
    "ODE_PAIRS2_DIR",
    "CLASSIFIER_PATH",
    "NUM_CLASSES",
    "NULL_CLASS",
    "TEXT_LEN",
    "TEXT_DIM",
    "SPLIT_SEED",
    "HELD_OUT_FRACTION",
    "Row",
    "load_digits_split",
    "to_pixels",
    "teacher_config",
    "build_teacher",
    "init_class_embeddings",
    "train_rectified_flow",
    "save_teacher",
    "load_teacher",
    "load_student",
    "load_student_pipeline",
    "write_latent_dataset_for",
    "write_ode_pairs",
    "DigitClassifier",
    "train_classifier",
    "load_classifier",
    "frechet_distance",
    "within_class_diversity",
    "Evaluator",
    "sample_teacher",
    "sample_student",
    "sample_pipeline",
    "timed",
    "save_grid",
    "write_report",
    "atomic_write_text",
    "ABLATIONS",
    "run_overrides",
    "run_state",
]
