"""rcm-lora CLI smoke tests: convert, extract, merge, transfer, inspect, bad input."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_lora_extract_merge import with_low_rank_delta
from test_lora_keys import assert_same_effect, random_lora, tiny_flux, tiny_wan

from rcm_diffusers.lora import cli, io, keys


def test_cli_convert_extract_merge_transfer(tmp_path, capsys):
    lora = random_lora(tiny_wan(), rank=2)
    io.save_lora(tmp_path / "d.safetensors", lora, "wan", format="diffusers")
    assert (
        cli.main(["convert", str(tmp_path / "d.safetensors"), str(tmp_path / "c.safetensors"), "--format", "comfyui"])
        == 0
    )
    c = load_file(tmp_path / "c.safetensors")
    assert "diffusion_model.blocks.1.cross_attn.o.lora_up.weight" in c
    assert not any(
        k.endswith(".alpha") and not k.startswith("diffusion_model.blocks.") for k in c
    )  # see comfyui_file_forms
    assert_same_effect(io.load_lora(tmp_path / "c.safetensors")[0], lora)

    base = {k: v.clone() for k, v in tiny_wan().state_dict().items()}
    ft, _ = with_low_rank_delta(base, r=2)
    orig_base, orig_ft = keys.to_original(base, prefix=""), keys.to_original(ft, prefix="")
    torch.save({"model": orig_base}, tmp_path / "base.pt")
    save_file(orig_ft, tmp_path / "ft.safetensors")
    assert (
        cli.main(
            [
                "extract",
                "--finetuned",
                str(tmp_path / "ft.safetensors"),
                "--base",
                str(tmp_path / "base.pt"),
                "--output",
                str(tmp_path / "x.safetensors"),
                "--rank",
                "2",
                "--report",
                str(tmp_path / "r.json"),
            ]
        )
        == 0
    )
    rep = json.loads((tmp_path / "r.json").read_text())
    assert max(r["rel_error"] for r in rep if r["kind"] == "lora") < 1e-5
    assert "worst relative error" in capsys.readouterr().out

    assert (
        cli.main(
            [
                "merge",
                "--base",
                str(tmp_path / "base.pt"),
                "--lora",
                str(tmp_path / "x.safetensors"),
                "--output",
                str(tmp_path / "m.safetensors"),
            ]
        )
        == 0
    )
    m = load_file(tmp_path / "m.safetensors")
    torch.testing.assert_close(
        m["blocks.0.self_attn.q.weight"], orig_ft["blocks.0.self_attn.q.weight"], rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(m["blocks.1.modulation"], orig_ft["blocks.1.modulation"])

    assert (
        cli.main(
            [
                "transfer",
                "--base",
                str(tmp_path / "base.pt"),
                "--finetuned",
                str(tmp_path / "ft.safetensors"),
                "--finetuned-base",
                str(tmp_path / "base.pt"),
                "--weight",
                "0.5",
                "--output",
                str(tmp_path / "t"),
                "--layout",
                "diffusers",
            ]
        )
        == 0
    )
    t = load_file(tmp_path / "t" / "diffusion_pytorch_model.safetensors")
    k = "blocks.0.ffn.net.2.weight"
    torch.testing.assert_close(t[k], base[k] + 0.5 * (ft[k] - base[k]))
    assert cli.main(["inspect", str(tmp_path / "x.safetensors")]) == 0
    assert '"layout": "ComfyUI / original' in capsys.readouterr().out


def test_cli_bad_input_one_line_errors(tmp_path, capsys):
    assert (
        cli.main(
            ["convert", str(tmp_path / "none.safetensors"), str(tmp_path / "o.safetensors"), "--format", "comfyui"]
        )
        == 2
    )
    assert "not found" in capsys.readouterr().err
    save_file({"transformer.blocks.0.attn1.to_qq.lora_A.weight": torch.zeros(2, 24)}, tmp_path / "bad.safetensors")
    assert (
        cli.main(["convert", str(tmp_path / "bad.safetensors"), str(tmp_path / "o.safetensors"), "--format", "comfyui"])
        == 2
    )
    assert "to_qq.lora_A.weight" in capsys.readouterr().err
    assert not (tmp_path / "o.safetensors").exists()


def test_python_dash_m_entry_point():
    r = subprocess.run(
        [sys.executable, "-m", "rcm_diffusers.lora", "--help"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and "extract" in r.stdout and "transfer" in r.stdout


@pytest.fixture
def files(tmp_path):
    lora = random_lora(tiny_wan(), rank=2)
    save_file({k: v.clone() for k, v in tiny_wan().state_dict().items()}, tmp_path / "base.safetensors")
    io.save_lora(tmp_path / "l.safetensors", lora, "wan", format="comfyui")
    return tmp_path, keys.to_comfy_keys(lora)


# Issue 17 item 7: each of these was a raw traceback or a silent wrong result; now exit 2 + one line, no output.


def test_inspect_pt_lora_and_empty_pt(files, capsys):
    tmp_path, comfy = files
    torch.save(comfy, tmp_path / "l.pt")
    assert cli.main(["inspect", str(tmp_path / "l.pt")]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "LoRA"
    (tmp_path / "empty.pt").write_bytes(b"")
    assert cli.main(["inspect", str(tmp_path / "empty.pt")]) == 2
    assert "not a readable checkpoint" in capsys.readouterr().err


def test_extract_on_empty_or_truncated_file(files, capsys):
    tmp_path, _ = files
    (tmp_path / "empty.safetensors").write_bytes(b"")
    raw = (tmp_path / "base.safetensors").read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(raw[: len(raw) // 2])
    for bad in ("empty.safetensors", "trunc.safetensors"):
        assert (
            cli.main(
                [
                    "extract",
                    "--finetuned",
                    str(tmp_path / bad),
                    "--base",
                    str(tmp_path / "base.safetensors"),
                    "--output",
                    str(tmp_path / "x.safetensors"),
                    "--rank",
                    "2",
                ]
            )
            == 2
        )
        assert "not a readable safetensors file" in capsys.readouterr().err
    assert not (tmp_path / "x.safetensors").exists()


def test_merge_with_mismatched_lora_ranks(files, capsys):
    tmp_path, comfy = files
    broken = dict(comfy)
    broken["diffusion_model.blocks.0.self_attn.q.lora_up.weight"] = torch.zeros(24, 3)
    save_file(broken, tmp_path / "broken.safetensors")
    assert (
        cli.main(
            [
                "merge",
                "--base",
                str(tmp_path / "base.safetensors"),
                "--lora",
                str(tmp_path / "broken.safetensors"),
                "--output",
                str(tmp_path / "m.safetensors"),
            ]
        )
        == 2
    )
    assert "rank mismatch" in capsys.readouterr().err
    assert not (tmp_path / "m.safetensors").exists()


def test_merge_refuses_nan_weight_and_nan_lora(files, capsys):
    tmp_path, comfy = files
    assert (
        cli.main(
            [
                "merge",
                "--base",
                str(tmp_path / "base.safetensors"),
                "--lora",
                str(tmp_path / "l.safetensors"),
                "--weight",
                "nan",
                "--output",
                str(tmp_path / "m.safetensors"),
            ]
        )
        == 2
    )
    assert "finite" in capsys.readouterr().err
    nan = dict(comfy)
    nan["diffusion_model.blocks.1.ffn.0.lora_down.weight"] = torch.full((2, 24), float("nan"))
    save_file(nan, tmp_path / "nan.safetensors")
    assert (
        cli.main(
            [
                "merge",
                "--base",
                str(tmp_path / "base.safetensors"),
                "--lora",
                str(tmp_path / "nan.safetensors"),
                "--output",
                str(tmp_path / "m.safetensors"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "NaN" in err and "blocks.1.ffn" in err
    assert (
        cli.main(
            [
                "transfer",
                "--base",
                str(tmp_path / "base.safetensors"),
                "--finetuned",
                str(tmp_path / "base.safetensors"),
                "--finetuned-base",
                str(tmp_path / "base.safetensors"),
                "--weight",
                "inf",
                "--output",
                str(tmp_path / "m.safetensors"),
            ]
        )
        == 2
    )
    assert not (tmp_path / "m.safetensors").exists()


@pytest.mark.parametrize("rank", ["0", "-1"])
def test_extract_refuses_rank_below_one(files, capsys, rank):
    tmp_path, _ = files
    assert (
        cli.main(
            [
                "extract",
                "--finetuned",
                str(tmp_path / "base.safetensors"),
                "--base",
                str(tmp_path / "base.safetensors"),
                "--output",
                str(tmp_path / "x.safetensors"),
                "--rank",
                rank,
            ]
        )
        == 2
    )
    assert "rank must be a whole number >= 1" in capsys.readouterr().err
    assert not (tmp_path / "x.safetensors").exists()


def test_convert_to_a_folder_path(files, capsys):
    tmp_path, _ = files
    (tmp_path / "outdir").mkdir()
    assert (
        cli.main(["convert", str(tmp_path / "l.safetensors"), str(tmp_path / "outdir"), "--format", "diffusers"]) == 2
    )
    assert "is a folder" in capsys.readouterr().err


def test_outputs_are_never_written_over_silently(files, capsys):
    tmp_path, _ = files
    lora, base = tmp_path / "l.safetensors", tmp_path / "base.safetensors"
    old = {p: p.read_bytes() for p in (lora, base)}
    (tmp_path / "o.safetensors").write_bytes(b"precious")
    assert cli.main(["convert", str(lora), str(tmp_path / "o.safetensors"), "--format", "diffusers"]) == 2
    assert "o.safetensors already exists; pass --overwrite" in capsys.readouterr().err
    assert (tmp_path / "o.safetensors").read_bytes() == b"precious"
    assert (
        cli.main(["convert", str(lora), str(tmp_path / "o.safetensors"), "--format", "diffusers", "--overwrite"]) == 0
    )
    assert io.load_lora(tmp_path / "o.safetensors")[0]
    # an input is never the output, --overwrite or not
    for argv in (
        ["convert", str(lora), str(lora), "--format", "diffusers"],
        ["convert", str(lora), str(tmp_path / "." / "l.safetensors"), "--format", "comfyui", "--overwrite"],
        ["merge", "--base", str(base), "--lora", str(lora), "--output", str(base)],
        ["merge", "--base", str(base), "--lora", str(lora), "--output", str(base), "--overwrite"],
        [
            "merge",
            "--base",
            str(base),
            "--lora",
            str(lora),
            "--output",
            str(tmp_path),
            "--layout",
            "diffusers",
            "--overwrite",
        ],
    ):
        assert cli.main(argv) == 2, argv
        assert "would write over the input" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in (lora, base)} == old
    (tmp_path / "m.safetensors").write_bytes(b"x")
    assert (
        cli.main(["merge", "--base", str(base), "--lora", str(lora), "--output", str(tmp_path / "m.safetensors")]) == 2
    )
    assert (
        cli.main(
            [
                "merge",
                "--base",
                str(base),
                "--lora",
                str(lora),
                "--output",
                str(tmp_path / "m.safetensors"),
                "--overwrite",
            ]
        )
        == 0
    )


BROKEN = {
    "wrong shapes": ({"diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.zeros(48)}, "wrong shapes"),
    "rank mismatch": ({"diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.zeros(24, 3)}, "rank mismatch"),
    "all NaN": ({"diffusion_model.blocks.1.ffn.0.lora_down.weight": torch.full((2, 24), float("nan"))}, "NaN or inf"),
    "rank 0": (
        {
            "diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.zeros(0, 24),
            "diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.zeros(24, 0),
        },
        "rank 0",
    ),
}


@pytest.mark.parametrize("kind", list(BROKEN))
def test_convert_refuses_and_inspect_warns_about_a_broken_lora(files, capsys, kind):
    tmp_path, comfy = files
    change, match = BROKEN[kind]
    save_file({**comfy, **change}, tmp_path / "broken.safetensors")
    assert (
        cli.main(
            ["convert", str(tmp_path / "broken.safetensors"), str(tmp_path / "o.safetensors"), "--format", "diffusers"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1 and "blocks." in err, err
    assert not (tmp_path / "o.safetensors").exists()
    assert cli.main(["inspect", str(tmp_path / "broken.safetensors")]) == 0
    out = capsys.readouterr()
    assert match in " ".join(json.loads(out.out)["problems"]) and "warning" in out.err and match in out.err
    assert (
        cli.main(
            [
                "merge",
                "--base",
                str(tmp_path / "base.safetensors"),
                "--lora",
                str(tmp_path / "broken.safetensors"),
                "--output",
                str(tmp_path / "m.safetensors"),
            ]
        )
        == 2
    )
    assert match in capsys.readouterr().err and not (tmp_path / "m.safetensors").exists()


def _wan_1_3b_lora(in_width):
    """A rank-1 LoRA on two layers of Wan 2.1 T2V 1.3B (hidden size 1536), ComfyUI names; self_attn.q's lora_A is
    ``in_width`` wide."""
    g = torch.Generator().manual_seed(0)
    return {
        "diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.randn(1, in_width, generator=g),
        "diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.randn(1536, 1, generator=g),
        "diffusion_model.blocks.0.self_attn.k.lora_down.weight": torch.randn(1, 1536, generator=g),
        "diffusion_model.blocks.0.self_attn.k.lora_up.weight": torch.randn(1536, 1, generator=g),
    }


def test_convert_refuses_a_lora_too_wide_for_its_architecture(tmp_path, capsys):
    """A lora_A 3 columns wider than the 1536-wide layer of Wan 2.1 1.3B (a shipped architecture, found from the LoRA's
    own sizes) was written with rc 0; convert now runs inspect's check: exit 2, one line naming the layer, no file."""
    save_file(_wan_1_3b_lora(1539), tmp_path / "wide.safetensors")
    assert (
        cli.main(
            ["convert", str(tmp_path / "wide.safetensors"), str(tmp_path / "o.safetensors"), "--format", "diffusers"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("rcm-lora convert: error: ") and err.count("\n") == 1, err
    assert "blocks.0.attn1.to_q: LoRA delta (1536, 1539) vs weight (1536, 1536) in wan2.1-t2v-1.3b" in err, err
    assert "to_k" not in err and not (tmp_path / "o.safetensors").exists()
    assert cli.main(["inspect", str(tmp_path / "wide.safetensors")]) == 0  # inspect warns about the same
    out = capsys.readouterr()
    assert json.loads(out.out)["problems"] == [
        "blocks.0.attn1.to_q: LoRA delta (1536, 1539) vs weight (1536, 1536) in wan2.1-t2v-1.3b"
    ]
    assert "warning" in out.err
    # the same LoRA at the layer's width converts
    save_file(_wan_1_3b_lora(1536), tmp_path / "fits.safetensors")
    assert (
        cli.main(
            ["convert", str(tmp_path / "fits.safetensors"), str(tmp_path / "o.safetensors"), "--format", "diffusers"]
        )
        == 0
    )
    assert set(load_file(tmp_path / "o.safetensors")) == {
        f"transformer.blocks.0.attn1.{m}.lora_{ab}.weight" for m in ("to_q", "to_k") for ab in "AB"
    }


@pytest.mark.parametrize("alpha", [True, False])
def test_convert_refuses_a_rank_0_fused_flux_lora(tmp_path, capsys, alpha):
    """A rank-0 LoRA on Flux's fused img_attn.qkv was dropped by the split into q/k/v (rc 0, the layer silently gone)
    or, with an alpha, divided by its rank (a traceback); convert now refuses it like any rank-0 LoRA: exit 2, one
    line, no file; inspect warns instead of failing."""
    comfy = keys.to_comfy_keys(random_lora(tiny_flux(), rank=2), "flux")
    t = "diffusion_model.double_blocks.0.img_attn.qkv"
    broken = {**comfy, f"{t}.lora_down.weight": torch.zeros(0, 32), f"{t}.lora_up.weight": torch.zeros(96, 0)}
    if not alpha:
        broken.pop(f"{t}.alpha")
    save_file(broken, tmp_path / "r0.safetensors")
    assert (
        cli.main(
            ["convert", str(tmp_path / "r0.safetensors"), str(tmp_path / "o.safetensors"), "--format", "diffusers"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "transformer_blocks.0.attn.to_q: rank 0 (lora_A (0, 32), lora_B (32, 0))" in err, (
        err
    )
    assert not (tmp_path / "o.safetensors").exists()
    assert cli.main(["inspect", str(tmp_path / "r0.safetensors")]) == 0
    assert "rank 0" in " ".join(json.loads(capsys.readouterr().out)["problems"])


def test_extract_warns_what_stock_diffusers_drops_from_the_file(tmp_path, capsys):
    """The default (ComfyUI) file of a fine-tune whose patch embedding changed holds it as a full .diff, which stock
    diffusers' load_lora_weights drops with only an INFO log: extract says so in one warning line, largest delta first,
    with what keeps it; nothing when the file holds no such key."""
    from test_lora_official import low_rank_ft, official_from

    base = {k: v.clone() for k, v in tiny_wan().state_dict().items()}
    torch.save(base, tmp_path / "base.pt")

    def extract(ft, name, *extra):
        save_file(ft, tmp_path / f"{name}_ft.safetensors")
        assert (
            cli.main(
                [
                    "extract",
                    "--finetuned",
                    str(tmp_path / f"{name}_ft.safetensors"),
                    "--base",
                    str(tmp_path / "base.pt"),
                    "--output",
                    str(tmp_path / f"{name}.safetensors"),
                    "--rank",
                    "2",
                    *extra,
                ]
            )
            == 0
        )
        assert (tmp_path / f"{name}.safetensors").exists()
        return [line for line in capsys.readouterr().err.splitlines() if line.startswith("rcm-lora extract:")]

    # official rCM form (Linear patch embedding): its delta is a LoRA pair, which --format diffusers keeps
    (line,) = extract(official_from(low_rank_ft(base)), "official")
    out = tmp_path / "official.safetensors"
    assert line.startswith(
        "rcm-lora extract: warning: stock diffusers (pipe.load_lora_weights) drops 17 full delta(s) "
        f"of {out} with no more than an INFO log: patch_embedding.diff, "
    )
    assert line.endswith(
        f"; --format diffusers keeps the patch embedding's (as a LoRA pair), "
        f'rcm_diffusers.load_full_lora(pipe, "{out}") applies every delta of the file'
    ), line
    assert (
        extract(official_from(low_rank_ft(base)), "official_d", "--format", "diffusers") == []
    )  # nothing left to drop
    # diffusers form (Conv3d patch embedding): a full delta in every layout, so only load_full_lora keeps it
    ft, _ = with_low_rank_delta(base, r=2)
    for k in ("blocks.0.attn1.to_q.bias", "blocks.1.scale_shift_table"):
        ft[k] = base[k].clone()
    assert extract(ft, "linear_only") == []  # LoRA pairs only: no warning
    ft["patch_embedding.weight"] = base["patch_embedding.weight"] + 0.1
    assert extract(ft, "conv") == [
        f"rcm-lora extract: warning: stock diffusers (pipe.load_lora_weights) drops 1 full delta(s) of "
        f"{tmp_path / 'conv.safetensors'} with no more than an INFO log: patch_embedding.diff; "
        f'rcm_diffusers.load_full_lora(pipe, "{tmp_path / "conv.safetensors"}") applies every delta of the file'
    ]
