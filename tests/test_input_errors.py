"""Bad datasets and teacher folders end with one line and exit status 2 before the run folder is touched or a
model loads (``rcm_diffusers.distill.data.check_dataset``, ``rcm_diffusers.distill.inputs.check_inputs``)."""

import json
import os
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from rcm_diffusers.distill import inputs as R
from rcm_diffusers.distill.data import write_latent_dataset
from train_helpers import TEXT_DIM, TEXT_LEN, make_tiny_wan, run_script


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return make_tiny_wan(str(tmp_path_factory.mktemp("input_errors") / "pipe"))


def _write(root, n=6, classes=3, latents=None, text_dim=TEXT_DIM, index=None):
    """A small valid Wan dataset (overridable pieces) like train_helpers.make_dataset's."""
    g = torch.Generator().manual_seed(0)
    label = torch.arange(n) % classes if index is None else index
    lat = torch.randn(n, 4, 1, 4, 4, generator=g) if latents is None else latents
    tables = {"prompt_embeds": torch.randn(classes, TEXT_LEN, text_dim, generator=g),
              "negative_prompt_embeds": torch.zeros(1, TEXT_LEN, text_dim)}
    write_latent_dataset(str(root), {"latents": lat, "prompt_index": label}, family="wan", tables=tables,
                         table_index={"prompt_embeds": "prompt_index", "negative_prompt_embeds": None})
    return root


def _meta(root, **kw):
    m = json.load(open(root / "meta.json"))
    m.update(kw)
    json.dump(m, open(root / "meta.json", "w"))


def _missing_dir(d):
    return d / "nope"


def _empty_dir(d):
    (d / "empty").mkdir()
    return d / "empty"


def _missing_tables(d):
    os.remove(_write(d / "x") / "tables.safetensors")
    return d / "x"


def _missing_shard(d):
    os.remove(_write(d / "x") / "shard-00000.safetensors")
    return d / "x"


def _truncated_shard(d):
    p = _write(d / "x") / "shard-00000.safetensors"
    raw = p.read_bytes()
    p.write_bytes(raw[: len(raw) - 40])
    return d / "x"


def _meta_not_json(d):
    (_write(d / "x") / "meta.json").write_text('{"format": "rcm-latents", ')
    return d / "x"


def _three_channels(d):
    return _write(d / "x", latents=torch.randn(6, 3, 1, 4, 4))


def _four_d(d):
    return _write(d / "x", latents=torch.randn(6, 4, 4, 4))


def _text_width(d):
    return _write(d / "x", text_dim=TEXT_DIM // 2)


def _index_range(d):
    return _write(d / "x", index=torch.tensor([0, 1, 2, 0, 1, 7]))


def _overstated(d):
    _meta(_write(d / "x"), num_samples=60)
    return d / "x"


def _zero(d):
    _meta(_write(d / "x"), num_samples=0)
    return d / "x"


def _family(d):
    _meta(_write(d / "x"), family="video")
    return d / "x"


def _outside(d):
    _write(d / "other")
    _meta(_write(d / "x"), shards=[{"file": "../other/shard-00000.safetensors", "num_samples": 6}])
    return d / "x"


def _int64_latents(d):
    return _write(d / "x", latents=torch.randint(0, 5, (6, 4, 1, 4, 4)))


BAD = {"missing data_dir": (_missing_dir, "no such folder"), "empty data_dir": (_empty_dir, "no meta.json"),
       "missing tables": (_missing_tables, "tables file tables.safetensors is missing"),
       "missing shard": (_missing_shard, "shard shard-00000.safetensors is missing"),
       "truncated shard": (_truncated_shard, "truncated"), "meta not JSON": (_meta_not_json, "not valid JSON"),
       "3 channels": (_three_channels, "3 channels, the teacher's transformer takes 4"),
       "4-D latents": (_four_d, r"needs \[N, C, T, H, W\]"),
       "text width": (_text_width, f"{TEXT_DIM // 2} wide, the teacher's transformer takes {TEXT_DIM}"),
       "index out of range": (_index_range, "prompt_index holds 7, outside the table rows 0..2"),
       "overstated num_samples": (_overstated, "num_samples is 60 but the shards hold 6"),
       "zero num_samples": (_zero, "num_samples 0 must be a whole number >= 1"),
       "unknown family": (_family, "unknown family 'video'"),
       "shard outside": (_outside, "not a file name inside the dataset folder"),
       "int64 latents": (_int64_latents, "latents has dtype I64; it must be a float tensor")}


@pytest.mark.parametrize("kind", list(BAD))
def test_every_data_error_is_one_line_before_anything(teacher, tmp_path, capsys, kind):
    make, match = BAD[kind]
    data = make(tmp_path)
    cfg = SimpleNamespace(pretrained=teacher, data_dir=str(data), transformer_subfolder="transformer", experts="auto")
    _assert_one_line_exit_2(cfg, capsys, match)


def _assert_one_line_exit_2(cfg, capsys, match):
    """``check_inputs(cfg)`` ends with exit status 2 and one ``error: ...`` line matching ``match``."""
    with pytest.raises(SystemExit) as e:
        R.check_inputs(cfg)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert re.search(match, err), err


def test_a_valid_dataset_passes(teacher, tmp_path):
    cfg = SimpleNamespace(pretrained=teacher, data_dir=str(_write(tmp_path / "ok")), transformer_subfolder="transformer",
                          experts="auto")
    assert R.check_inputs(cfg) == {"family": "wan", "num_samples": 6, "fields": ["latents", "negative_prompt_embeds",
                                                                                "prompt_embeds", "prompt_index"]}


def _pairs(root, noise=True, noise_shape=(4, 1, 4, 4)):
    """An ODE-pair dataset like training/prepare_data.py --synthetic writes (``noise`` beside ``latents``)."""
    g = torch.Generator().manual_seed(1)
    fields = {"latents": torch.randn(5, 4, 1, 4, 4, generator=g), "prompt_index": torch.arange(5) % 3}
    if noise:
        fields["noise"] = torch.randn(5, *noise_shape, generator=g)
    write_latent_dataset(str(root), fields, family="wan",
                         tables={"prompt_embeds": torch.randn(3, TEXT_LEN, TEXT_DIM, generator=g)},
                         table_index={"prompt_embeds": "prompt_index"})
    return root


@pytest.mark.parametrize("kind,match", [
    ("no noise", r"regression_data_dir .*pairs_no noise: no 'noise' field, so these are not ODE pairs; make them with "
                 r"training/prepare_data.py --synthetic"),
    ("noise shape", r"noise \[4, 1, 2, 2\] must have the latents' shape \[4, 1, 4, 4\]"),
    ("missing", r"--regression_data_dir .*pairs_missing: no such folder")])
def test_bad_ode_pairs_are_one_line_before_anything(teacher, tmp_path, capsys, kind, match):
    """With the regression term on, the ODE pairs are checked like the training data, and must hold the ``noise``
    each teacher sample started from, in the latents' shape; a valid pair set passes."""
    pairs = tmp_path / f"pairs_{kind}"
    if kind != "missing":
        _pairs(pairs, noise=kind != "no noise", noise_shape=(4, 1, 2, 2) if kind == "noise shape" else (4, 1, 4, 4))
    cfg = SimpleNamespace(pretrained=teacher, data_dir=str(_write(tmp_path / "ok")), transformer_subfolder="transformer",
                          experts="auto", regression_weight=1.0, regression_data_dir=str(pairs))
    _assert_one_line_exit_2(cfg, capsys, match)


def test_valid_ode_pairs_pass(teacher, tmp_path):
    cfg = SimpleNamespace(pretrained=teacher, data_dir=str(_write(tmp_path / "ok")), transformer_subfolder="transformer",
                          experts="auto", regression_weight=1.0, regression_data_dir=str(_pairs(tmp_path / "pairs")))
    assert R.check_inputs(cfg)["num_samples"] == 6


def test_int64_latents_stop_the_trainer_before_anything_is_written(teacher, tmp_path):
    """They used to train to a 'finished' run (exit 0, final.json)."""
    data = _int64_latents(tmp_path)
    out = tmp_path / "run"
    p = run_script(["--config", os.path.join("training", "configs", "tiny-wan-test.yaml"), "--pretrained", teacher,
                    "--data_dir", str(data), "--output_dir", str(out), "--max_steps", "2"])
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.strip().count("\n") == 0 and "latents has dtype I64" in p.stderr
    assert not out.exists()


def test_a_teacher_with_only_pickle_weights_is_one_line(teacher, tmp_path):
    pipe = tmp_path / "pipe_bin"
    shutil.copytree(teacher, pipe)
    st = pipe / "transformer" / "diffusion_pytorch_model.safetensors"
    torch.save(load_file(st), pipe / "transformer" / "diffusion_pytorch_model.bin")
    os.remove(st)
    data = _write(tmp_path / "data")
    out = tmp_path / "run"
    for script in ("rcm.py", "qad.py"):
        p = run_script(["--pretrained", str(pipe), "--data_dir", str(data), "--output_dir", str(out)], script=script)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
        assert p.stderr.strip().count("\n") == 0 and "holds only pickle weights (diffusion_pytorch_model.bin)" in p.stderr
        assert not out.exists()
