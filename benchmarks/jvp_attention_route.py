"""Which route gets the JVP attention into every diffusers transformer (docs/math.md §5): the measurements behind
the choice of intercepting ``scaled_dot_product_attention`` (a ``TorchFunctionMode`` during the JVP pass) over a
backend in diffusers' attention-dispatch registry.

1. Coverage: for each model of the pipeline table (tests/flow_models.py, tiny random weights, the inputs its own
   pipeline gives it), the attention calls of one JVP pass that carry a tangent, split into those that reach SDPA
   through diffusers' ``dispatch_attention_fn`` (what a registry backend would see) and those that call SDPA
   themselves (which only the interception sees).
2. Cost: one ``torch.func.jvp`` through a Wan transformer (CPU, float32) with each route, and the torch-function
   calls of that pass (what the mode's Python handler sees), against a plain forward.

    python benchmarks/jvp_attention_route.py            # both parts, ~1 min on 2 cores
    python benchmarks/jvp_attention_route.py --smoke    # 3 models, a small Wan
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from rcm_diffusers.attention import JVPAttentionMode  # noqa: E402
from rcm_diffusers.attention.function import attention, has_tangent  # noqa: E402

SDPA = torch.nn.functional.scaled_dot_product_attention


class Classify(torch.overrides.TorchFunctionMode):
    """Counts SDPA calls with a tangent by caller: through diffusers' dispatch_attention_fn or directly."""

    def __init__(self):
        super().__init__()
        self.dispatched = self.direct = self.ops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        if func is SDPA:
            bound = {**dict(zip(("query", "key", "value"), args)), **kwargs}
            if has_tangent(bound["query"], bound["key"], bound["value"]):
                frame, via = sys._getframe(1), False
                while frame is not None:
                    via = via or frame.f_code.co_name == "dispatch_attention_fn"
                    frame = frame.f_back
                if via:
                    self.dispatched += 1
                else:
                    self.direct += 1
        return func(*args, **kwargs)


def coverage(names) -> list[dict]:
    from test_jvp_processors import make_case, tangents
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for name in names:
        model, call, x, t = make_case(name)
        dx, dt = tangents(x, t)
        with sdpa_kernel(SDPBackend.MATH), Classify() as c:
            torch.func.jvp(lambda a, b: call(model, a, b), (x, t), (dx, dt))
        procs = sorted({type(p).__name__ for p in getattr(model, "attn_processors", {}).values()})
        rows.append(dict(model=name, dispatched=c.dispatched, direct=c.direct, processors=", ".join(procs) or "-"))
    return rows


def _registry_route():
    """The other route, as it would have to be written: diffusers' "native" backend entry replaced by a function whose
    SDPA has our forward-AD rule (the registry's names are an enum, so a new backend means overriding an entry)."""
    from diffusers.models import attention_dispatch as D

    native = D._AttentionBackendRegistry._backends[D.AttentionBackendName.NATIVE]

    def jvp_native(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
        return_lse=False,
        _parallel_config=None,
    ):
        if not has_tangent(query, key, value):
            return native(
                query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, _parallel_config
            )
        if attn_mask is not None and attn_mask.dim() == 2:
            attn_mask = attn_mask[:, None, None]
        return attention(query, key, value, scale=scale, attn_mask=attn_mask)

    return D, native, jvp_native


def per_call_overhead_us(n: int = 20000) -> float:
    """What the mode's Python handler adds to one torch-function call (a small op, median of 5 runs of ``n``)."""
    x = torch.ones(4)

    def loop():
        for _ in range(n):
            torch.add(x, 1.0)

    def timed():
        t0 = time.perf_counter()
        loop()
        return time.perf_counter() - t0

    plain, mode = [], []
    for _ in range(5):
        plain.append(timed())
        with JVPAttentionMode():
            mode.append(timed())
    return 1e6 * (statistics.median(mode) - statistics.median(plain)) / n


def cost(smoke: bool, reps: int) -> list[dict]:
    """Median time of one JVP pass per route, the routes interleaved (shared machines drift)."""
    from diffusers import WanTransformer3DModel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    dims = (
        dict(num_layers=2, num_attention_heads=2, attention_head_dim=32, ffn_dim=128)
        if smoke
        else dict(num_layers=4, num_attention_heads=4, attention_head_dim=64, ffn_dim=1024)
    )
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        in_channels=16,
        out_channels=16,
        text_dim=64,
        freq_dim=64,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
        **dims,
    ).eval()
    g = torch.Generator().manual_seed(1)
    shape = (1, 16, 2, 8, 8) if smoke else (1, 16, 2, 32, 32)  # 32 / 512 video tokens
    x, dx = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    t, dt = torch.tensor([700.0]), torch.tensor([200.0])
    text = torch.randn(1, 32, 64, generator=g)

    def f(a, b):
        return model(hidden_states=a, timestep=b, encoder_hidden_states=text, return_dict=False)[0]

    D, native, jvp_native = _registry_route()

    def registry():
        D._AttentionBackendRegistry._backends[D.AttentionBackendName.NATIVE] = jvp_native
        try:
            return torch.func.jvp(f, (x, t), (dx, dt))
        finally:
            D._AttentionBackendRegistry._backends[D.AttentionBackendName.NATIVE] = native

    routes = {
        "plain forward (no JVP)": lambda: f(x, t),
        "registry: native entry overridden": registry,
        "TorchFunctionMode on SDPA": lambda: _mode_jvp(f, x, t, dx, dt),
    }
    times = {k: [] for k in routes}
    for fn in routes.values():
        fn()
    for _ in range(reps):
        for k, fn in routes.items():
            t0 = time.perf_counter()
            with torch.no_grad() if k.startswith("plain") else torch.enable_grad():
                fn()
            times[k].append(time.perf_counter() - t0)
    with sdpa_kernel(SDPBackend.MATH), Classify() as c:  # counting only: math SDPA has a forward-AD rule
        torch.func.jvp(f, (x, t), (dx, dt))
    rows = [dict(route=k, ms=1e3 * statistics.median(v)) for k, v in times.items()]
    rows[-1]["ops"] = c.ops
    return rows


def _mode_jvp(f, x, t, dx, dt):
    with JVPAttentionMode():
        return torch.func.jvp(f, (x, t), (dx, dt))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--reps", type=int, default=7)
    a = p.parse_args(argv)
    from test_jvp_processors import MODELS

    names = ["Wan 2.1", "SanaVideo", "HunyuanVideo-1.5"] if a.smoke else MODELS
    cov = coverage(names)
    print("| model | SDPA calls with a tangent through dispatch_attention_fn | called directly | processors |")
    print("|---|---|---|---|")
    for r in cov:
        print(f"| {r['model']} | {r['dispatched']} | {r['direct']} | {r['processors']} |")
    rows = cost(a.smoke, 2 if a.smoke else a.reps)
    print("\n| route | median ms | torch-function calls per pass |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['route']} | {r['ms']:.1f} | {r.get('ops', '')} |")
    us = per_call_overhead_us(2000 if a.smoke else 20000)
    print(f"\nthe mode's handler adds {us:.2f} us to each torch-function call")
    return cov, rows, us


if __name__ == "__main__":
    main()
