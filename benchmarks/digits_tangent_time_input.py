"""How the time-input rounding changes the sCM tangent on digits: ``python benchmarks/digits_tangent_time_input.py``.

The student at initialisation (= the shipped digits teacher: the LoRA starts at zero) gives ``dF`` along the teacher
flow (``losses.scm_dF``) for ``t ~ p_G`` (digits.yaml: P_mean -0.8, P_std 1.6) on training digits. Reference: exact
JVP (``fd_type 0``) with the exact time (``time_input float``). Each variant (``fd_type`` 0 / 2 x ``time_input``
float / bf16) reports the relative error of ``dF`` to the reference (median, 90th percentile), the cosine of its
normalised sCM direction ``g`` (r = 1) to the reference's, and for fd_type 2 the share of samples whose two network
calls (at ``t`` and ``t - h``) see a different bfloat16 timestep. The teacher velocity ``F_T`` of each variant sees
the same time input as its student, as in training; the first line is how much the teacher's own ``F`` moves
when its time input is rounded. One thread, CPU, a few seconds per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rcm_diffusers import digits as D  # noqa: E402
from rcm_diffusers.attention import enable_jvp_attention  # noqa: E402
from rcm_diffusers.distill import losses as L  # noqa: E402
from rcm_diffusers.distill.data import LatentDataset  # noqa: E402
from rcm_diffusers.models import denoiser  # noqa: E402
from rcm_diffusers.trigflow import sample_p_G, trigflow_noise  # noqa: E402

F64 = torch.float64


def trig_to_rf(t: torch.Tensor) -> torch.Tensor:
    return torch.sin(t) / (torch.sin(t) + torch.cos(t))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=512, help="samples")
    p.add_argument("--h", type=float, default=1e-4, help="finite-difference step of fd_type 2 (digits.yaml fd_h)")
    p.add_argument("--out", default="", help="optional JSON output path")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    tr, emb = D.load_teacher()
    enable_jvp_attention(tr)
    data = LatentDataset(os.path.join(D.ASSETS, "digits_latents"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(len(data), generator=g)[: a.n].tolist()
    batch = data.get(ids)
    x0 = batch["latents"].to(F64)
    cond = batch["prompt_embeds"].float()
    t = sample_p_G(a.n, -0.8, 1.6, 1.0, generator=g)
    x_t = trigflow_noise(x0, torch.randn(x0.shape, dtype=F64, generator=g), t)
    den = {ti: denoiser(tr, torch.float32, ti) for ti in ("float", "bf16")}

    def F(ti):
        return lambda x, tt: den[ti].F(x, tt, encoder_hidden_states=cond)

    with torch.no_grad():
        F_T = {ti: F(ti)(x_t, t).to(F64) for ti in den}  # the teacher sees the same time input as the student
    dT = (F_T["bf16"] - F_T["float"]).flatten(1).norm(dim=1) / F_T["float"].flatten(1).norm(dim=1)
    res = {
        "teacher_F_bf16_vs_float": {"rel_change_median": float(dT.median()), "rel_change_p90": float(dT.quantile(0.9))}
    }
    print(json.dumps(res))
    dFs = {}
    for fd, ti in ((0, "float"), (0, "bf16"), (2, "float"), (2, "bf16")):
        _, dF = L.scm_dF(F(ti), x_t, t, F_T[ti], fd_type=fd, h=a.h)
        dFs[(fd, ti)] = dF.to(F64)
    ref = dFs[(0, "float")]
    cs = (torch.cos(t) * torch.sin(t)).reshape(-1, *[1] * (x_t.dim() - 1))
    g_ref = L.normalize_g(-(cs * x_t + ref))
    for (fd, ti), dF in dFs.items():
        rel = (dF - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)
        gv = L.normalize_g(-(cs * x_t + dF))
        cos = (gv * g_ref).flatten(1).sum(1) / (gv.flatten(1).norm(dim=1) * g_ref.flatten(1).norm(dim=1))
        row = {
            "fd_type": fd,
            "time_input": ti,
            "rel_err_median": float(rel.median()),
            "rel_err_p90": float(rel.quantile(0.9)),
            "rel_err_max": float(rel.max()),
            "g_cos_mean": float(cos.mean()),
            "g_cos_min": float(cos.min()),
        }
        if fd == 2:
            ts0 = (1000 * trig_to_rf(t)).to(torch.bfloat16)
            ts1 = (1000 * trig_to_rf(t - a.h)).to(torch.bfloat16)
            row["bf16_timestep_changes"] = float((ts0 != ts1).double().mean())
        res[f"fd{fd}-{ti}"] = row
        print(json.dumps(row))
    if a.out:
        D.atomic_write_text(a.out, json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
