"""rcm-lora CLI smoke tests (issue 8): convert, extract, merge, transfer, inspect, bad input."""

import json
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file

from rcm_diffusers.lora import cli, io, keys
from test_lora_extract_merge import with_low_rank_delta
from test_lora_keys import assert_same, random_lora, tiny_wan


def test_cli_convert_extract_merge_transfer(tmp_path, capsys):
    lora = random_lora(tiny_wan(), rank=2)
    io.save_lora(tmp_path / "d.safetensors", lora, "wan", format="diffusers")
    assert cli.main(["convert", str(tmp_path / "d.safetensors"), str(tmp_path / "c.safetensors"), "--format", "comfyui"]) == 0
    c = load_file(tmp_path / "c.safetensors")
    assert "diffusion_model.blocks.1.cross_attn.o.lora_up.weight" in c
    assert_same(io.load_lora(tmp_path / "c.safetensors")[0], lora)

    base = {k: v.clone() for k, v in tiny_wan().state_dict().items()}
    ft, _ = with_low_rank_delta(base, r=2)
    orig_base, orig_ft = keys.to_original(base, prefix=""), keys.to_original(ft, prefix="")
    torch.save({"model": orig_base}, tmp_path / "base.pt")
    save_file(orig_ft, tmp_path / "ft.safetensors")
    assert cli.main(["extract", "--finetuned", str(tmp_path / "ft.safetensors"), "--base", str(tmp_path / "base.pt"),
                     "--output", str(tmp_path / "x.safetensors"), "--rank", "2", "--report", str(tmp_path / "r.json")]) == 0
    rep = json.loads((tmp_path / "r.json").read_text())
    assert max(r["rel_error"] for r in rep if r["kind"] == "lora") < 1e-5
    assert "worst relative error" in capsys.readouterr().out

    assert cli.main(["merge", "--base", str(tmp_path / "base.pt"), "--lora", str(tmp_path / "x.safetensors"),
                     "--output", str(tmp_path / "m.safetensors")]) == 0
    m = load_file(tmp_path / "m.safetensors")
    torch.testing.assert_close(m["blocks.0.self_attn.q.weight"], orig_ft["blocks.0.self_attn.q.weight"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m["blocks.1.modulation"], orig_ft["blocks.1.modulation"])

    assert cli.main(["transfer", "--base", str(tmp_path / "base.pt"), "--finetuned", str(tmp_path / "ft.safetensors"),
                     "--finetuned-base", str(tmp_path / "base.pt"), "--weight", "0.5",
                     "--output", str(tmp_path / "t"), "--layout", "diffusers"]) == 0
    t = load_file(tmp_path / "t" / "diffusion_pytorch_model.safetensors")
    k = "blocks.0.ffn.net.2.weight"
    torch.testing.assert_close(t[k], base[k] + 0.5 * (ft[k] - base[k]))
    assert cli.main(["inspect", str(tmp_path / "x.safetensors")]) == 0
    assert '"layout": "ComfyUI / original' in capsys.readouterr().out


def test_cli_bad_input_one_line_errors(tmp_path, capsys):
    assert cli.main(["convert", str(tmp_path / "none.safetensors"), str(tmp_path / "o.safetensors"), "--format", "comfyui"]) == 2
    assert "not found" in capsys.readouterr().err
    save_file({"transformer.blocks.0.attn1.to_qq.lora_A.weight": torch.zeros(2, 24)}, tmp_path / "bad.safetensors")
    assert cli.main(["convert", str(tmp_path / "bad.safetensors"), str(tmp_path / "o.safetensors"), "--format", "comfyui"]) == 2
    assert "to_qq.lora_A.weight" in capsys.readouterr().err
    assert not (tmp_path / "o.safetensors").exists()


def test_python_dash_m_entry_point():
    r = subprocess.run([sys.executable, "-m", "rcm_diffusers.lora", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "extract" in r.stdout and "transfer" in r.stdout
