"""Training on one card: a low-precision frozen base, host offload of its blocks, host-held checkpoints.

Three mechanisms for shared-base LoRA runs (``mode shared``), each an option of the rCM trainer (docs/training.md,
"Training on one card"):

* ``base_dtype`` (``FrozenLinear``): every ``nn.Linear`` of the frozen base inside the transformer blocks (attention
  q / k / v / out, cross-attention, feed-forward; the ``base_layer`` under a peft LoRA layer) keeps its weight in
  ``fp8`` (FP8 E4M3, one float32 scale per row and block of ``FP8_BLOCK`` inputs) or ``int8`` (symmetric, one float32
  scale per output channel), quantized with ``rcm_diffusers.quant.formats`` (the rules ComfyUI runs, docs/math.md
  §7), and dequantized to the compute dtype in each call. Biases, norms, modulation tables, the embeddings and the
  output head stay in ``weight_dtype``; the LoRA adapters, their gradients and AdamW stay in float32. With
  ``base_weights`` (``distill.base_weights``) the stores come already quantized from a file (FP8 E4M3 with one scale
  per tensor or none, or INT8 per channel) and are used as stored (``apply_low_memory(stores=...)``).
* ``blocks_to_swap N`` (``BlockSwap``): the frozen Linear weights of the last ``N`` blocks of each network live in host
  memory (pinned on CUDA) and are copied to the device just before the block runs, the next one prefetched on a side
  stream; at most ``PREFETCH_BLOCKS`` swapped blocks are on the device at once. Copies go host -> device only: the
  host copy is the weight, a device copy is dropped, never written back. LoRA weights are not in a block's store and
  never move. Every pass loads what it needs (teacher, JVP, student grad forward and its recompute, fake score, DMD
  simulation); a backward without checkpointing loads a block again when its gradient needs the weight.
* ``activation_offload`` (``HostActivations``): what the grad-enabled forward saves for the backward outside the
  checkpointed blocks -- with gradient checkpointing that is each block's inputs -- goes to (pinned) host memory,
  one copy per distinct tensor, and comes back when the backward recomputes that block.

How a quantized or swapped Linear computes (``_FrozenLinearFn``): ``y = linear(x, W, b)`` with ``W`` dequantized
from the store; its autograd rule saves nothing (the gradient with respect to ``x`` dequantizes ``W`` again; the base
has no gradient), and its forward-mode rule (``torch.func.jvp``) is ``dy = linear(dx, W)``. So neither the backward
nor a checkpoint keeps a device copy of a swapped weight alive, and a swapped block can be dropped right after it
ran. The numbers are those of ``nn.Linear`` with the dequantized weight: a run on a quantized base equals, bit for
bit, a run on a base whose weights were replaced by ``dequantized_weight`` (tests/test_lowmem.py).

Why our own mechanisms and not diffusers' (``python benchmarks/lowmem_probe.py`` measures each point; 2026-12-04,
2-core CPU, torch 2.13.0+cpu, diffusers 0.42.1): ``apply_layerwise_casting(storage_dtype=float8_e4m3fn)`` stores every
``nn.Linear`` it reaches in float8 -- on a model with peft adapters that is every ``lora_A`` / ``lora_B`` (80 of 80 on
the tiny Wan), so the trained adapters would live in float8 -- casts without a scale (relative RMS error 3.3 % on
N(0, 0.02) weights, 2.6 % with our per-block scales), and a ``torch.func.jvp`` through a cast layer stops with an
internal functorch assertion (the hook casts the parameters inside the transform). ``apply_group_offloading(
offload_type="block_level")`` fails the same ``torch.func.jvp`` (with host and device both the CPU, so only its
hooks act); it moves every parameter of a block, the adapters inside it included (with a stream it restores each
from the host copy taken when it was applied: the GPU check records whether an adapter update survives); and what a
grad-enabled forward saved of an offloaded block's weights stays on the device until the backward. Both serve
inference; neither holds for a forward-mode JVP through a LoRA-adapted base.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..models import HUNYUAN15_CONTEXT_EXTRA, transformer_blocks
from .memory import BASE_DTYPES

__all__ = [
    "BASE_DTYPES",
    "FP8_BLOCK",
    "PREFETCH_BLOCKS",
    "quantize_weight",
    "dequantize_weight",
    "dequantized_weight",
    "WeightStore",
    "FrozenLinear",
    "BlockSwap",
    "HostActivations",
    "LowMemory",
    "apply_low_memory",
    "transformer_blocks",
    "base_networks",
    "check_base_dtype",
    "frozen_linears",
]

#: values of the ``base_dtype`` option: the frozen Linear weights as ``weight_dtype``, FP8 E4M3 block-scaled, INT8
#: inputs per float32 scale of the ``fp8`` base (per output row)
FP8_BLOCK = 128
#: swapped blocks on the device at once: the one running and the one prefetched
PREFETCH_BLOCKS = 2


# ----------------------------------------------------------------------------- formats


def quantize_weight(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(values, scale)`` of a Linear weight ``[out, in]`` in ``fmt``: ``fp8`` = float8_e4m3fn values ``[out, nb *
    FP8_BLOCK]`` (the input dimension zero-padded to whole blocks) and float32 scales ``[out, nb, 1]``
    (``quant.formats`` fp8_e4m3 per row of each block); ``int8`` = int8 values ``[out, in]``, float32 scales ``[out,
    1]`` (``quant.formats`` int8 per channel); ``weight_dtype`` = the weight itself, no scale."""
    from ..quant.formats import quantize

    if fmt == "weight_dtype":
        return w.detach(), None
    if fmt == "int8":
        q = quantize(w.detach(), "int8", per_channel=True)
        return q.values.to(torch.int8), q.scale
    if fmt == "fp8":
        out, k = w.shape
        pad = -k % FP8_BLOCK
        wb = F.pad(w.detach().float(), (0, pad)).reshape(out, (k + pad) // FP8_BLOCK, FP8_BLOCK)
        q = quantize(wb, "fp8_e4m3", per_channel=True)  # one scale per (row, block): the last dimension is the block
        return q.values.reshape(out, k + pad).to(torch.float8_e4m3fn), q.scale
    raise ValueError(f"unknown base_dtype {fmt!r}; known: {', '.join(BASE_DTYPES)}")


def dequantize_weight(values: torch.Tensor, scale: torch.Tensor | None, fmt: str, shape: tuple, dtype) -> torch.Tensor:
    """The weight ``[out, in]`` in ``dtype`` from ``quantize_weight``'s ``(values, scale)``: ``values * scale``
    (``quant.formats.dequantize``) computed in ``dtype``: the values are exact in bfloat16 (E4M3's 3 mantissa bits,
    INT8's 7), the scale is rounded to ``dtype`` once (2^-9 relative in bfloat16, against FP8's 2^-4), and the product
    once. One ``dtype`` tensor is the whole working set (no float32 copy of the largest Linear). An ``fp8`` weight
    read from a file (``base_weights``) has unpadded values ``[out, in]`` and one 0-d scale for the whole tensor, or
    none: ``values.to(dtype) * scale.to(dtype)`` (``values.to(dtype)``), as ComfyUI computes its scaled FP8 layers."""
    if fmt == "weight_dtype":
        return values if values.dtype == dtype else values.to(dtype)
    out, k = shape
    w = values.to(dtype)
    if fmt == "fp8" and (scale is None or scale.dim() == 0):  # per tensor (or unscaled), from a file
        return w if scale is None else w.mul_(scale.to(dtype))
    if fmt == "fp8":
        w = w.view(out, -1, FP8_BLOCK).mul_(scale.to(dtype)).view(out, -1)
        if w.shape[1] != k:
            w = w[:, :k].contiguous()
    else:
        w = w.mul_(scale.to(dtype))
    return w


def dequantized_weight(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """``w`` after a round trip through ``fmt``, in ``w``'s dtype: the weight a ``FrozenLinear`` of that format
    computes with (what a reference run on a dequantized base loads)."""
    v, s = quantize_weight(w, fmt)
    return dequantize_weight(v, s, fmt, tuple(w.shape), w.dtype)


def check_base_dtype(fmt: str, device) -> None:
    """Raise ``ValueError`` (one line) when ``device`` cannot hold or dequantize ``fmt`` (``float8_e4m3fn`` has no
    kernels on MPS), or when ``fmt`` is not one of ``BASE_DTYPES``."""
    if fmt not in BASE_DTYPES:
        raise ValueError(f"base_dtype {fmt!r}: use one of {', '.join(BASE_DTYPES)}")
    dev = torch.device(device)
    if fmt == "fp8":
        if dev.type == "mps":
            raise ValueError("base_dtype fp8: this device (mps) has no float8 kernels; use base_dtype int8")
        if dev.type in ("cpu", "cuda"):  # float8 casts run on every CUDA architecture torch supports, and on CPU
            return
        try:
            torch.zeros(2, dtype=torch.float8_e4m3fn, device=dev).to(torch.float32).sum()
        except (RuntimeError, TypeError) as e:
            raise ValueError(
                f"base_dtype fp8: {dev} cannot convert float8_e4m3fn ({type(e).__name__}); use base_dtype int8"
            ) from None


# ----------------------------------------------------------------------------- the frozen Linear


def _in_backward() -> bool:
    """Whether autograd's engine is running (a backward, or a checkpoint's recompute inside one)."""
    return torch._C._current_graph_task_id() != -1


class WeightStore:
    """The frozen weight of one ``FrozenLinear``: ``host`` (the weight, in its format; ``None`` for a resident layer)
    and ``dev`` (the ``(values, scale)`` on the device, or ``None`` while a swapped block is not loaded). ``fp8``
    scales are per row and block (``quantize_weight``) or, for weights read from a file, one 0-d scale per tensor
    (or ``None``); ``int8`` scales are per output channel (``dequantize_weight``).
    ``swap`` / ``key`` name the ``BlockSwap`` and block that load it."""

    __slots__ = ("fmt", "shape", "dtype", "host", "dev", "swap", "key")

    def __init__(self, values, scale, fmt: str, shape: tuple, dtype):
        self.fmt, self.shape, self.dtype = fmt, tuple(shape), dtype
        self.host = None
        self.dev = (values, scale)
        self.swap = None
        self.key = None

    def tensors(self) -> tuple:
        """``(values, scale)`` on the device, loading the block first when it is swapped out."""
        if self.dev is None:
            self.swap.acquire(self.key, backward=_in_backward())
        return self.dev

    def weight(self) -> torch.Tensor:
        """The dequantized weight on the device, in the compute dtype."""
        v, s = self.tensors()
        return dequantize_weight(v, s, self.fmt, self.shape, self.dtype)

    def nbytes(self) -> int:
        """Bytes of the stored weight (values and scales)."""
        t = self.host if self.host is not None else self.dev
        return sum(x.numel() * x.element_size() for x in t if x is not None)


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    h = t.detach().to("cpu", copy=True)
    return h.pin_memory() if pin else h


class _FrozenLinearFn(torch.autograd.Function):
    """``linear(x, W, b)`` with ``W`` from a ``WeightStore``; saves nothing for the backward (module docstring)."""

    @staticmethod
    def forward(x, layer, bias):
        w = layer.store.weight()
        layer._w = w  # for the forward-mode rule, called right after; dropped by FrozenLinear.forward
        return F.linear(x, w, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, layer, _ = inputs
        ctx.layer = layer
        ctx.x_dtype = x.dtype
        dev = x.device.type
        ctx.autocast = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None

    @staticmethod
    def backward(ctx, g):
        if not ctx.needs_input_grad[0]:
            return None, None, None
        w = ctx.layer.store.weight()
        if ctx.autocast is not None:
            w = w.to(ctx.autocast)
        return g.matmul(w).to(ctx.x_dtype), None, None

    @staticmethod
    def jvp(ctx, dx, _layer, _db):
        return F.linear(dx, ctx.layer._w)


class FrozenLinear(nn.Module):
    """A frozen ``nn.Linear`` whose weight lives in a ``WeightStore`` (quantized, and / or on the host); the bias
    stays a frozen parameter in its own dtype. Not a parameter: optimizers, DDP, EMA and checkpoints never see it."""

    def __init__(self, linear: nn.Linear, fmt: str, device=None, host: bool = False, pin: bool = False, stored=None):
        """``stored``: ``(values, scale)`` already in ``fmt`` (read from a ``base_weights`` file); ``linear.weight``
        is then only read for its dtype (a placeholder, never quantized)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        dtype = linear.weight.dtype
        if stored is not None:
            v, s = stored
            if device is not None and not host:
                v, s = v.to(device), (None if s is None else s.to(device))
        else:
            w = linear.weight.detach()
            if device is not None and not (host and fmt == "weight_dtype"):  # quantize where the arithmetic is fast
                w = w.to(device)  # (one layer at a time on the device)
            v, s = quantize_weight(w, fmt)
        self.store = WeightStore(v, s, fmt, (self.out_features, self.in_features), dtype)
        if host:  # a swapped block: the weight lives on the host from the start, the device never holds all of them
            self.store.host = tuple(None if t is None else _host_copy(t, pin) for t in self.store.dev)
            self.store.dev = None
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self._w = None

    @property
    def fmt(self) -> str:
        return self.store.fmt

    def forward(self, x):
        try:
            return _FrozenLinearFn.apply(x, self, self.bias)
        finally:
            self._w = None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt}"


def frozen_linears(module: nn.Module) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """``(name, parent, attribute, linear)`` of every frozen ``nn.Linear`` under ``module`` that is not a LoRA
    adapter (peft's ``lora_A`` / ``lora_B``): the base layers a ``FrozenLinear`` replaces."""
    out = []
    for name, mod in module.named_modules():
        if type(mod) is not nn.Linear or mod.weight.requires_grad or ".lora_" in f".{name}":
            continue
        parent_name, _, attr = name.rpartition(".")
        out.append((name, module.get_submodule(parent_name) if parent_name else module, attr, mod))
    return out


# ----------------------------------------------------------------------------- blocks and networks

#: the transformer block classes of the supported families, in execution order within their parent lists


def base_networks(model) -> list[nn.Module]:
    """The diffusers transformers of a model: the experts of a ``WanExpertSwitch``, else the model itself."""
    from .experts import switch_of

    sw = switch_of(model)
    from ..models import _base_model

    return list(sw.experts.values()) if sw is not None else [_base_model(model)]


# ----------------------------------------------------------------------------- block swap


class BlockSwap:
    """Host offload of the frozen Linear weights of chosen blocks (see the module docstring).

    ``chains``: per network, its blocks in execution order; ``swapped``: per network, the indices of its swapped
    blocks. A block is loaded by its forward pre-hook (and, when a backward needs a weight that is not on the device,
    by ``WeightStore.tensors``); loading one prefetches the next swapped block in the direction of the pass (forward:
    later blocks; in a backward, recompute included: earlier ones). At most ``window`` swapped blocks are on the
    device; the least recently used is dropped first.

    Measurement aids: ``h2d_bytes`` / ``h2d_copies`` count copies, ``max_resident`` the most swapped blocks on the
    device at once, and ``trace`` (a list, when set) receives ``(key, resident keys)`` per block that ran."""

    def __init__(self, chains: list[list[nn.Module]], swapped: list[list[int]], device, window: int = PREFETCH_BLOCKS):
        self.device = torch.device(device)
        self.window = max(1, int(window))
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.stores: dict[tuple, list[WeightStore]] = {}
        self.order: dict[tuple, tuple | None] = {}  # (key, backward) -> the swapped block to prefetch
        self.resident: collections.OrderedDict = collections.OrderedDict()  # key -> CUDA event of its copy (or None)
        self.h2d_bytes = 0
        self.h2d_copies = 0
        self.max_resident = 0
        self.trace: list | None = None
        self._hooks = []
        for c, (blocks, idx) in enumerate(zip(chains, swapped)):
            idx = sorted(set(idx))
            for i in idx:
                key = (c, i)
                stores = [m.store for m in blocks[i].modules() if isinstance(m, FrozenLinear)]
                for s in stores:
                    s.swap, s.key = self, key
                    if s.host is None:  # still on the device: move it out
                        s.host = tuple(None if t is None else _host_copy(t, self.cuda) for t in s.dev)
                        s.dev = None
                self.stores[key] = stores
            for i, block in enumerate(blocks):
                self.order[((c, i), False)] = next(((c, j) for j in idx if j > i), None)
                self.order[((c, i), True)] = next(((c, j) for j in reversed(idx) if j < i), None)
                self._hooks.append(block.register_forward_pre_hook(functools.partial(self._before_block, (c, i))))
            if idx and blocks:  # a pass starts at block 0: prefetch the first swapped block before it
                self.order[((c, -1), False)] = (c, idx[0])

    def host_bytes(self) -> int:
        """Bytes of the swapped weights held on the host."""
        return sum(s.nbytes() for stores in self.stores.values() for s in stores)

    def block_bytes(self, key) -> int:
        return sum(s.nbytes() for s in self.stores[key])

    def resident_bytes(self) -> int:
        """Bytes of swapped blocks now on the device (the prefetch buffer)."""
        return sum(self.block_bytes(k) for k in self.resident)

    # ---- hooks
    def _before_block(self, key, module, args):
        backward = _in_backward()
        if key in self.stores:
            self.acquire(key, backward)
        else:
            self._prefetch_after(key, backward)
        if self.trace is not None:
            self.trace.append((key, tuple(self.resident)))

    def before_network(self, chain: int):
        """A pass of network ``chain`` starts (its forward pre-hook, outside a backward): drop what an earlier
        backward left on the device, prefetch the first swapped block."""
        if not _in_backward():
            self.release_all()
            nxt = self.order.get(((chain, -1), False))
            if nxt is not None:
                self._load(nxt, keep=None)

    # ---- loading
    def acquire(self, key, backward: bool = False) -> None:
        """Make block ``key``'s weights usable on the device now, then prefetch the next swapped block."""
        if key not in self.resident:
            self._load(key, keep=None)
        ev = self.resident[key]
        if ev is not None:  # the copy ran on the side stream: order the compute stream after it
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(ev)
            for s in self.stores[key]:
                for t in s.dev:
                    if t is not None:
                        t.record_stream(cur)  # the allocator keeps the memory until the compute stream is past it
            self.resident[key] = None
        self.resident.move_to_end(key)
        self._prefetch_after(key, backward)

    def _prefetch_after(self, key, backward: bool) -> None:
        nxt = self.order.get((key, backward))
        if nxt is not None and nxt not in self.resident:
            self._load(nxt, keep=key)

    def _load(self, key, keep) -> None:
        """Copy block ``key`` host -> device (on the side stream on CUDA), dropping least recently used blocks other
        than ``keep`` so that at most ``window`` are resident."""
        if key in self.resident:
            return
        while len(self.resident) >= self.window:
            victim = next((k for k in self.resident if k != keep), None)
            if victim is None:
                break
            self._drop(victim)
        ctx = torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()
        with ctx:
            for s in self.stores[key]:
                s.dev = tuple(None if h is None else self._h2d(h) for h in s.host)
            ev = None
            if self.cuda:
                ev = torch.cuda.Event()
                ev.record(self.stream)
        self.resident[key] = ev
        self.max_resident = max(self.max_resident, len(self.resident))

    def _h2d(self, h: torch.Tensor) -> torch.Tensor:
        d = torch.empty_like(h, device=self.device)
        d.copy_(h, non_blocking=self.cuda)
        self.h2d_bytes += h.numel() * h.element_size()
        self.h2d_copies += 1
        return d

    def _drop(self, key) -> None:
        """Forget block ``key``'s device copies (nothing is copied back: the host holds the weights)."""
        for s in self.stores[key]:
            s.dev = None
        self.resident.pop(key, None)

    def after_network(self) -> None:
        """A network call ended (its forward post-hook): outside a backward, drop its swapped blocks, so that every
        pass loads what it uses and no swapped weight stays on the device between passes."""
        if not _in_backward():
            self.release_all()

    def release_all(self) -> None:
        """Drop every swapped block from the device."""
        for k in list(self.resident):
            self._drop(k)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


# ----------------------------------------------------------------------------- activation offload


class HostActivations:
    """Saved-tensor hooks that keep what a grad-enabled forward saves on the host (see the module docstring).

    Within one forward a tensor saved several times (Wan passes the same text states and time embedding to every
    block) is copied once; the table holds weak references, so it keeps no device tensor alive. Frozen and trainable
    parameters saved by an op stay where they are. ``host_bytes`` counts
    the bytes copied to the host (the last forward: ``last_host_bytes``), ``h2d_bytes`` those copied back."""

    def __init__(self, device, params=()):
        self.cuda = torch.device(device).type == "cuda"
        self._params = list(params)
        self._skip: set = set()
        self._seen: dict = {}
        self.host_bytes = 0
        self.last_host_bytes = 0
        self.h2d_bytes = 0
        self._stack: list = []

    def begin(self) -> None:
        """Start a forward: a fresh table of copies, the parameters' storages to leave alone."""
        self._seen = {}
        self.last_host_bytes = 0
        self._skip = {p.untyped_storage().data_ptr() for p in self._params}

    def pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() in self._skip or t.numel() == 0:
            return t
        # the same tensor object at the same version: copied once. Keyed by the object (a weak reference, so a freed
        # tensor whose memory a new one reuses is never mistaken for it), not by its address
        hit = self._seen.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == t._version:
            return hit[2]
        host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, device="cpu", pin_memory=self.cuda)
        host.copy_(t, non_blocking=self.cuda)
        n = t.numel() * t.element_size()
        self.host_bytes += n
        self.last_host_bytes += n
        packed = (t.device, host)
        self._seen[id(t)] = (weakref.ref(t), t._version, packed)
        return packed

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        dev, host = packed
        self.h2d_bytes += host.numel() * host.element_size()
        if dev.type == "cpu":
            return host
        return host.to(dev, non_blocking=self.cuda)

    # forward hooks of a transformer
    def enter(self, module, args):
        if torch.is_grad_enabled() and not _in_backward():
            self.begin()
            cm = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            cm.__enter__()
            self._stack.append(cm)
        else:
            self._stack.append(None)

    def exit(self, module, args, output):
        cm = self._stack.pop() if self._stack else None
        if cm is not None:
            cm.__exit__(None, None, None)


# ----------------------------------------------------------------------------- applying them


class LowMemory:
    """What ``apply_low_memory`` installed on a model: the ``FrozenLinear`` layers, the ``BlockSwap`` (or ``None``),
    the ``HostActivations`` (or ``None``)."""

    def __init__(self, base_dtype, blocks_to_swap, swap, activations, layers):
        self.base_dtype, self.blocks_to_swap = base_dtype, blocks_to_swap
        self.swap, self.activations, self.layers = swap, activations, layers

    def device_weight_bytes(self) -> int:
        """Bytes of the resident frozen Linear weights (swapped blocks not counted)."""
        return sum(m.store.nbytes() for m in self.layers if m.store.swap is None)

    def describe(self) -> str:
        parts = [f"base Linear weights {self.base_dtype}"]
        if self.swap is not None:
            parts.append(
                f"{self.blocks_to_swap} blocks per network on the host "
                f"({self.swap.host_bytes() / 2**30:.2f} GiB, {'pinned' if self.swap.cuda else 'host'} memory)"
            )
        if self.activations is not None:
            parts.append("checkpointed block inputs on the host")
        return ", ".join(parts)


def apply_low_memory(
    model,
    *,
    base_dtype: str = "weight_dtype",
    blocks_to_swap: int = 0,
    activation_offload: bool = False,
    device=None,
    swap_window: int = PREFETCH_BLOCKS,
    stores: dict | None = None,
) -> LowMemory | None:
    """Install the low-memory mechanisms on ``model`` (a diffusers transformer or a ``WanExpertSwitch``, adapters
    already added) and move it to ``device``: block Linears to ``FrozenLinear`` of ``base_dtype`` (all blocks when
    quantized; only the swapped ones for ``weight_dtype``), the last ``blocks_to_swap`` blocks of each network to the
    host, saved-tensor hooks for ``activation_offload``. ``None`` when nothing was asked.

    ``stores``: ``{diffusers Linear name: (values, scale)}`` of every block Linear, already in ``base_dtype`` (one
    network; ``distill.base_weights``): those are used as they are, the Linears' weights (placeholders) are not."""
    check_base_dtype(base_dtype, device or "cpu")
    if base_dtype == "weight_dtype" and blocks_to_swap == 0 and not activation_offload:
        if device is not None:
            model.to(device)
        return None
    nets = base_networks(model)
    chains = [transformer_blocks(n) for n in nets]
    for n, blocks in zip(nets, chains):
        if blocks_to_swap > len(blocks):
            raise ValueError(f"blocks_to_swap {blocks_to_swap}: {type(n).__name__} has {len(blocks)} blocks")
    swapped = [list(range(len(b) - blocks_to_swap, len(b))) for b in chains]
    dev = torch.device(device) if device is not None else torch.device("cpu")
    layers = []
    left = dict(stores) if stores is not None else None
    if left is not None and (len(nets) != 1 or base_dtype == "weight_dtype"):
        raise ValueError("stores: one network, in a quantized base_dtype")
    for net, blocks, idx in zip(nets, chains, swapped):
        where = {id(m): n for n, m in net.named_modules()} if left is not None else {}
        for i, block in enumerate(blocks):
            if base_dtype == "weight_dtype" and i not in idx:
                continue
            for name, parent, attr, lin in frozen_linears(block):
                stored = None
                if left is not None:
                    key = f"{where[id(block)]}.{name}".replace(".base_layer", "")
                    if key not in left:
                        raise ValueError(f"stores: no weight for {key}")
                    stored = left.pop(key)
                fl = FrozenLinear(lin, base_dtype, dev, host=i in idx, pin=dev.type == "cuda", stored=stored)
                setattr(parent, attr, fl)
                layers.append(fl)
    if left:
        raise ValueError(f"stores: {len(left)} weight(s) match no block Linear, e.g. {next(iter(left))}")
    model.to(dev)  # parameters (adapters, biases, norms, embeddings); the stores are not parameters
    swap = None
    if blocks_to_swap:
        swap = BlockSwap(chains, swapped, dev, swap_window)
        for c, n in enumerate(nets):
            swap._hooks.append(n.register_forward_pre_hook(lambda m, a, c=c: swap.before_network(c)))
            swap._hooks.append(n.register_forward_hook(lambda m, a, o: swap.after_network(), always_call=True))
    acts = None
    if activation_offload:
        acts = HostActivations(dev, params=[p for n in nets for p in n.parameters()])
        for n in nets:
            n.register_forward_pre_hook(acts.enter)
            n.register_forward_hook(acts.exit, always_call=True)
    return LowMemory(base_dtype, blocks_to_swap, swap, acts, layers)


# ----------------------------------------------------------------------------- the start-up check


def _card() -> tuple[str, float | None, str]:
    """``(device type, total bytes or None, name)`` of the card this process will train on."""
    import os

    if torch.cuda.is_available():
        i = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        p = torch.cuda.get_device_properties(i)
        return "cuda", float(p.total_memory), p.name
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps", None, "mps"
    return "cpu", None, "cpu"


def train_setup(cfg, config: dict, class_name: str, latent_shape, text_tokens: int, experts: int):
    """The memory model's ``TrainSetup`` of an rCM run (``memory.TrainSetup``) from its config, the teacher's
    transformer config and one sample's latent shape ``[C, (F,) H, W]``."""
    import math

    from .memory import TrainSetup
    from .terms import needs_jvp

    patch = config.get("patch_size", 1)
    if class_name == "Flux2Transformer2DModel":  # patchified latents: one token per latent pixel
        tokens = math.prod(latent_shape[-2:])
    elif class_name.startswith("Flux") or class_name == "QwenImageTransformer2DModel":  # 2 x 2-packed tokens
        tokens = math.prod(n // 2 for n in latent_shape[-2:])
    elif class_name == "HunyuanVideo15Transformer3DModel":  # [C, F, H, W], patch (patch_size_t, p, p)
        pt = config.get("patch_size_t", 1)
        tokens = math.prod(n // q for n, q in zip(latent_shape[-3:], (pt, patch, patch)))
        text_tokens += HUNYUAN15_CONTEXT_EXTRA  # the ByT5 and (zero, masked) image tokens join the attention too
    else:
        tokens = math.prod(n // p for n, p in zip(latent_shape[-3:], patch))
    fd = cfg.fd_type if needs_jvp(cfg) else 2
    s = TrainSetup.from_config(
        config,
        class_name,
        tokens=tokens,
        text_tokens=text_tokens,
        batch=cfg.batch_size,
        lora_rank=cfg.lora_rank,
        weight_dtype=cfg.weight_dtype,
        gradient_checkpointing=cfg.gradient_checkpointing,
        fd_type=fd,
        mode=cfg.mode,
        ema=cfg.ema_rate > 0,
        experts=experts,
        context_parallel=cfg.context_parallel_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        checkpointing_policy=cfg.checkpointing_policy,
        base_dtype=cfg.base_dtype,
        blocks_to_swap=cfg.blocks_to_swap,
        activation_offload=cfg.activation_offload,
        student_update_freq=cfg.student_update_freq,
        max_simulation_steps=cfg.max_simulation_steps,
        use_dmd=cfg.use_dmd,
    )
    if cfg.fake_lora_rank and cfg.fake_lora_rank != cfg.lora_rank and s.lora_rank:
        s.lora_params_fake = int(round(s.lora_params_fake * cfg.fake_lora_rank / cfg.lora_rank))
    return s


def _check_base_weights(cfg, config: dict, class_name: str, two: bool, kind: str) -> str:
    """The format of ``cfg.base_weights``'s block Linears (``base_weights.scan_base_weights``: the header only),
    refusing (one line, exit status 2) a file that cannot serve, two experts, and a ``base_dtype`` other than
    ``weight_dtype`` or the file's."""
    import diffusers

    from .base_weights import BaseWeightsError, scan_base_weights
    from .errors import user_error

    if two:
        user_error(
            f"--base_weights {cfg.base_weights}: one network's file, and {cfg.pretrained} trains two experts; "
            "add --experts one (and --transformer_subfolder for the expert the file holds)"
        )
    try:
        bw = scan_base_weights(cfg.base_weights, getattr(diffusers, class_name), config)
        check_base_dtype(bw.fmt, kind)
    except (BaseWeightsError, ValueError) as e:
        user_error(str(e))
    if cfg.base_dtype not in ("weight_dtype", bw.fmt):
        user_error(
            f"--base_dtype {cfg.base_dtype} with --base_weights {cfg.base_weights}, whose block Linears are "
            f"{bw.fmt}: the file's format is kept; use --base_dtype {bw.fmt} or weight_dtype"
        )
    return bw.fmt


def startup_check(cfg, log=print) -> None:
    """Before the run folder is touched: refuse (one line, exit status 2) a ``base_dtype`` the device cannot run,
    ``blocks_to_swap`` beyond the model's blocks, the one-card options with FSDP2 or context parallelism; print the
    memory model's predicted peak for the card this process sees, and refuse a setting whose peak exceeds 90 % of
    it (``device_memory_gb``, else the card's memory), naming the cheapest setting that would fit
    (``memory.cheapest_fitting``). Without a GPU and without ``device_memory_gb`` it only prints."""
    import json
    import os

    from .errors import user_error
    from .inputs import model_index

    one_card = cfg.base_dtype != "weight_dtype" or cfg.blocks_to_swap > 0 or cfg.activation_offload
    one_card = one_card or bool(getattr(cfg, "base_weights", ""))
    kind, total, name = _card()
    try:
        check_base_dtype(cfg.base_dtype, kind)
    except ValueError as e:
        user_error(str(e))
    if one_card and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true", "yes"):
        user_error(
            "base_dtype / base_weights / blocks_to_swap / activation_offload are for one card; FSDP2 shards the "
            "frozen base over the processes instead: use one or the other"
        )
    if one_card and cfg.context_parallel_size > 1:
        user_error(
            "base_dtype / base_weights / blocks_to_swap / activation_offload are for one card; "
            "context_parallel_size > 1 runs a sample on several: use one or the other"
        )
    index = model_index(cfg.pretrained)
    from .experts import HIGH, index_boundary_ratio

    two = cfg.experts == "both" or (cfg.experts == "auto" and index_boundary_ratio(index) is not None)
    sub = HIGH if two else cfg.transformer_subfolder
    path = os.path.join(os.path.expanduser(cfg.pretrained), sub, "config.json")
    try:
        if os.path.isfile(path):
            with open(path) as f:
                config = json.load(f)
        else:  # a hub id: its config.json only (from the cache, or a small download)
            import diffusers

            config = dict(getattr(diffusers, index[sub][1]).load_config(cfg.pretrained, subfolder=sub))
    except Exception as e:  # noqa: BLE001 - offline, no such repository: the loader reports it later
        if getattr(cfg, "base_weights", ""):
            user_error(
                f"--base_weights: cannot check it without {cfg.pretrained}/{sub}/config.json ({type(e).__name__})"
            )
        log(f"memory: no prediction ({sub}/config.json: {type(e).__name__})")
        return
    class_name = config.get("_class_name") or index[sub][1]
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    if getattr(cfg, "base_weights", ""):  # the file's format is the base's: the check below plans with it
        cfg = cfg.model_copy(update={"base_dtype": _check_base_weights(cfg, config, class_name, two, kind)})
    n_blocks = config.get("num_layers", 0) + config.get("num_single_layers", 0)
    if cfg.blocks_to_swap > n_blocks:
        user_error(
            f"blocks_to_swap {cfg.blocks_to_swap}: {cfg.pretrained} has {n_blocks} transformer blocks per network"
        )
    from .data import LatentDataset
    from .memory import CARDS, GiB, cheapest_fitting, predict_training, setting_text

    try:
        row = LatentDataset(cfg.data_dir).get([0])
        s = train_setup(
            cfg,
            config,
            class_name,
            tuple(row["latents"].shape[1:]),
            int(row["prompt_embeds"].shape[-2]),
            2 if two else 1,
        )
        capacity = cfg.device_memory_gb * 1e9 if cfg.device_memory_gb else total
        plan = "cuda" if (kind == "cuda" or cfg.device_memory_gb) else kind
        pred = predict_training(s, "cpu" if plan == "cpu" else "cuda")
    except (ValueError, KeyError) as e:  # a combination the model does not cover
        log(f"memory: no prediction ({e})")
        return
    card = min(CARDS, key=lambda c: abs(CARDS[c]["memory"] - (capacity or 24e9)))
    if cfg.device_memory_gb:
        where = f"planned {cfg.device_memory_gb:g} GB card ({capacity / GiB:.1f} GiB)"
    else:
        where = f"{name} ({capacity / GiB:.1f} GiB)" if capacity else f"{name} (no card limit)"
    log(
        f"memory: predicted peak {pred['total'] / GiB:.2f} GiB on {where}; host {pred['host'] / GiB:.2f} GiB; "
        f"{setting_text(s)}"
    )
    if capacity is None or pred["total"] <= 0.9 * capacity:
        return
    rank = cfg.lora_rank
    ranks = [r for r in (rank, rank // 2, rank // 4, rank // 8) if r >= 4] or [rank]
    fmts = [cfg.base_dtype] if getattr(cfg, "base_weights", "") else [cfg.base_dtype, "fp8", "int8"]
    best = cheapest_fitting(s, capacity, card, formats=fmts, ranks=ranks)
    head = (
        f"memory: the predicted peak {pred['total'] / GiB:.1f} GiB does not fit 90 % of {where} "
        f"({0.9 * capacity / GiB:.1f} GiB)"
    )
    if best is None:
        user_error(
            f"{head}, and no setting of base_dtype, blocks_to_swap, activation_offload and lora_rank >= "
            f"{ranks[-1]} does; use a larger card, fewer frames or a lower resolution"
        )
    c, p, t = best
    user_error(
        f"{head}; the cheapest setting that fits: {setting_text(c)} (predicted {p['total'] / GiB:.1f} GiB, "
        f"host {p['host'] / GiB:.1f} GiB, step time {t['slowdown']:.2f}x on PCIe 4.0 x16)"
    )
