"""Random draws that are a function of each sample alone.

The trainers draw noise and times through a ``torch.Generator``; a batch's draws then depend on how many samples
share that generator and in which order they are drawn. ``SampleGenerators`` holds one generator per batch row
and the draws below take row ``j`` from generator ``j`` only, so a sample's noise is the same whether it is drawn
in a batch of 8, in a micro-batch of 2 (gradient accumulation) or on another process: a batch split into parts
draws exactly what the whole batch draws. With a plain generator (or ``None``) each function is the
``torch`` call it replaces, stream for stream.
"""

from __future__ import annotations

import torch

__all__ = ["SampleGenerators", "randn", "rand", "randint"]


class SampleGenerators:
    """One ``torch.Generator`` per batch row; ``gens[a:b]`` is the generators of rows ``a..b-1``."""

    def __init__(self, generators):
        self.generators = list(generators)
        if not self.generators:
            raise ValueError("SampleGenerators needs at least one generator")

    def __len__(self) -> int:
        return len(self.generators)

    def __getitem__(self, rows: slice) -> "SampleGenerators":
        if not isinstance(rows, slice):
            raise TypeError("SampleGenerators takes a slice of rows")
        return SampleGenerators(self.generators[rows])

    @property
    def device(self) -> torch.device:
        return self.generators[0].device


def _rows(draw, shape, generator: SampleGenerators) -> torch.Tensor:
    shape = tuple(shape)
    if not shape or shape[0] != len(generator):
        raise ValueError(
            f"a draw of shape {shape} from {len(generator)} per-sample generators: the leading "
            "dimension must be the batch, one row per generator"
        )
    return torch.cat([draw((1, *shape[1:]), g) for g in generator.generators])


def randn(shape, generator=None, dtype=None, device=None) -> torch.Tensor:
    """``torch.randn(shape)``; with ``SampleGenerators`` row ``j`` comes from generator ``j``."""
    if isinstance(generator, SampleGenerators):
        return _rows(lambda s, g: torch.randn(s, dtype=dtype, generator=g, device=device), shape, generator)
    return torch.randn(shape, dtype=dtype, generator=generator, device=device)


def rand(shape, generator=None, dtype=None, device=None) -> torch.Tensor:
    """``torch.rand(shape)``; with ``SampleGenerators`` row ``j`` comes from generator ``j``."""
    if isinstance(generator, SampleGenerators):
        return _rows(lambda s, g: torch.rand(s, dtype=dtype, generator=g, device=device), shape, generator)
    return torch.rand(shape, dtype=dtype, generator=generator, device=device)


def randint(high: int, shape, generator=None, device=None) -> torch.Tensor:
    """``torch.randint(high, shape)``; with ``SampleGenerators`` row ``j`` comes from generator ``j``."""
    if isinstance(generator, SampleGenerators):
        return _rows(lambda s, g: torch.randint(high, s, generator=g, device=device), shape, generator)
    return torch.randint(high, shape, generator=generator, device=device)
