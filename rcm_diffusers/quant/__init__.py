"""Quantization-aware distillation (docs/math.md §7): low-bit formats with a straight-through gradient
(``formats``), the Linear swap over a diffusers transformer (``modules``), the ComfyUI-loadable
export (``export``) and the QAD objective with the block-wise warm start (``qad``)."""
