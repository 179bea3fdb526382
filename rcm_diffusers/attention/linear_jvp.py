"""The forward-mode rule of ``nn.Linear`` in a JVP pass with constant weights: one product, not two.

PyTorch's forward-AD formula of ``addmm`` / ``mm`` is ``tY = tX W^T + X tW^T (+ tb)``. In the sCM tangent pass
(``torch.func.jvp`` in ``x_t`` and ``t``, under ``no_grad``) the weights carry no tangent, so ``tW`` is a zero
tensor; the zero-tensor fallback materialises it at the weight's size and runs the second product on zeros. Every
linear layer of the JVP pass then costs three products of its size (primal, tangent, the zero one) instead of two,
and allocates a weight-sized block of zeros (the "weight copies" the memory model measured in the JVP pass).

``enable_linear_jvp(model)`` gives every ``nn.Linear`` of ``model`` (base layers, the LoRA ``lora_A`` / ``lora_B``
of peft, the condition embedders; and the convolutions, Wan's patch embedding, which have the same rule) a forward
that, in a no-grad pass whose input carries a tangent while its weight and bias do not, goes through
``_ConstantWeightTangent``: the primal is the layer's own product as before, the tangent the same product of ``tX``
without bias, the value the stock rule gives (its extra term is exactly zero), and no zeros are made. Any other call
(grad enabled, no tangent, or a weight with a tangent) is the stock ``forward``. ``disable_linear_jvp(model)``
removes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .function import has_tangent

__all__ = ["enable_linear_jvp", "disable_linear_jvp"]

_TAG = "_rcm_linear_jvp"


class _ConstantWeightTangent(torch.autograd.Function):
    """``module``'s product ``op(x, module.weight, module.bias)`` whose forward-AD rule treats the weight and bias as
    constants: the tangent is ``op(tx, module.weight, None)``. The module goes in as a plain argument, not its
    tensors, so no zero tangent is made for them either."""

    @staticmethod
    def forward(x, module, op):
        return op(x, module.weight, module.bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.module, ctx.op = inputs[1], inputs[2]

    @staticmethod
    def jvp(ctx, t_x, _t_module, _t_op):
        module, op = ctx.module, ctx.op
        ctx.module = ctx.op = None
        return op(t_x, module.weight, None)

    @staticmethod
    def backward(ctx, grad):  # only no-grad passes take this path (``_forward_of``)
        raise RuntimeError("_ConstantWeightTangent is for no-grad forward-mode passes only")


def _forward_of(module: nn.Module):
    stock = module.forward
    op = F.linear if isinstance(module, nn.Linear) else module._conv_forward

    def forward(x):
        if (
            not torch.is_grad_enabled()
            and has_tangent(x)
            and not has_tangent(*[p for p in (module.weight, module.bias) if p is not None])
        ):
            return _ConstantWeightTangent.apply(x, module, op)
        return stock(x)

    forward.__dict__[_TAG] = stock
    return forward


_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def enable_linear_jvp(model: nn.Module) -> int:
    """Give every ``nn.Linear`` (and convolution: Wan's patch embedding) in ``model`` the one-product tangent rule
    (module docstring); returns how many layers it changed."""
    n = 0
    for m in model.modules():
        if type(m) in _LAYERS and not hasattr(m.__dict__.get("forward"), _TAG):
            if "forward" in m.__dict__:  # someone else's per-instance forward: leave it alone
                continue
            m.forward = _forward_of(m)
            n += 1
    return n


def disable_linear_jvp(model: nn.Module) -> None:
    """Undo ``enable_linear_jvp``."""
    for m in model.modules():
        fwd = m.__dict__.get("forward")
        if fwd is not None and hasattr(fwd, _TAG):
            del m.forward
