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
from train_helpers import TEXT_DIM, TEXT_LEN, make_tiny_wan, run_script

from rcm_diffusers.distill import inputs as R
from rcm_diffusers.distill.data import write_latent_dataset


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return make_tiny_wan(str(tmp_path_factory.mktemp("input_errors") / "pipe"))


def _write(root, n=6, classes=3, latents=None, text_dim=TEXT_DIM, index=None):
    """A small valid Wan dataset (overridable pieces) like train_helpers.make_dataset's."""
    g = torch.Generator().manual_seed(0)
    label = torch.arange(n) % classes if index is None else index
    lat = torch.randn(n, 4, 1, 4, 4, generator=g) if latents is None else latents
    tables = {
        "prompt_embeds": torch.randn(classes, TEXT_LEN, text_dim, generator=g),
        "negative_prompt_embeds": torch.zeros(1, TEXT_LEN, text_dim),
    }
    write_latent_dataset(
        str(root),
        {"latents": lat, "prompt_index": label},
        family="wan",
        tables=tables,
        table_index={"prompt_embeds": "prompt_index", "negative_prompt_embeds": None},
    )
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


BAD = {
    "missing data_dir": (_missing_dir, "no such folder"),
    "empty data_dir": (_empty_dir, "no meta.json"),
    "missing tables": (_missing_tables, "tables file tables.safetensors is missing"),
    "missing shard": (_missing_shard, "shard shard-00000.safetensors is missing"),
    "truncated shard": (_truncated_shard, "truncated"),
    "meta not JSON": (_meta_not_json, "not valid JSON"),
    "3 channels": (_three_channels, "3 channels, the teacher's transformer takes 4"),
    "4-D latents": (_four_d, r"needs \[N, C, T, H, W\]"),
    "text width": (_text_width, f"{TEXT_DIM // 2} wide, the teacher's transformer takes {TEXT_DIM}"),
    "index out of range": (_index_range, "prompt_index holds 7, outside the table rows 0..2"),
    "overstated num_samples": (_overstated, "num_samples is 60 but the shards hold 6"),
    "zero num_samples": (_zero, "num_samples 0 must be a whole number >= 1"),
    "unknown family": (_family, "unknown family 'video'"),
    "shard outside": (_outside, "not a file name inside the dataset folder"),
    "int64 latents": (_int64_latents, "latents has dtype I64; it must be a float tensor"),
}


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
    cfg = SimpleNamespace(
        pretrained=teacher, data_dir=str(_write(tmp_path / "ok")), transformer_subfolder="transformer", experts="auto"
    )
    info = R.check_inputs(cfg)
    fields = ["latents", "negative_prompt_embeds", "prompt_embeds", "prompt_index"]
    assert (info["family"], info["num_samples"], info["fields"]) == ("wan", 6, fields)
    assert info["shapes"]["latents"] == ("F32", (4, 1, 4, 4))
    assert info["shapes"]["prompt_embeds"] == ("F32", (TEXT_LEN, TEXT_DIM))


def _pairs(root, noise=True, noise_shape=(4, 1, 4, 4), shape=(4, 1, 4, 4)):
    """An ODE-pair dataset like training/prepare_data.py --synthetic writes (``noise`` beside ``latents``)."""
    g = torch.Generator().manual_seed(1)
    fields = {"latents": torch.randn(5, *shape, generator=g), "prompt_index": torch.arange(5) % 3}
    if noise:
        fields["noise"] = torch.randn(5, *(shape if noise_shape is None else noise_shape), generator=g)
    write_latent_dataset(
        str(root),
        fields,
        family="wan",
        tables={"prompt_embeds": torch.randn(3, TEXT_LEN, TEXT_DIM, generator=g)},
        table_index={"prompt_embeds": "prompt_index"},
    )
    return root


@pytest.mark.parametrize(
    "kind,match",
    [
        (
            "no noise",
            r"regression_data_dir .*pairs_no noise: no 'noise' field, so these are not ODE pairs; make them with "
            r"training/prepare_data.py --synthetic",
        ),
        ("noise shape", r"noise \[4, 1, 2, 2\] must have the latents' shape \[4, 1, 4, 4\]"),
        ("missing", r"--regression_data_dir .*pairs_missing: no such folder"),
    ],
)
def test_bad_ode_pairs_are_one_line_before_anything(teacher, tmp_path, capsys, kind, match):
    """With the regression term on, the ODE pairs are checked like the training data, and must hold the ``noise``
    each teacher sample started from, in the latents' shape; a valid pair set passes."""
    pairs = tmp_path / f"pairs_{kind}"
    if kind != "missing":
        _pairs(pairs, noise=kind != "no noise", noise_shape=(4, 1, 2, 2) if kind == "noise shape" else (4, 1, 4, 4))
    cfg = SimpleNamespace(
        pretrained=teacher,
        data_dir=str(_write(tmp_path / "ok")),
        transformer_subfolder="transformer",
        experts="auto",
        regression_weight=1.0,
        regression_data_dir=str(pairs),
    )
    _assert_one_line_exit_2(cfg, capsys, match)


def test_valid_ode_pairs_pass(teacher, tmp_path):
    cfg = SimpleNamespace(
        pretrained=teacher,
        data_dir=str(_write(tmp_path / "ok")),
        transformer_subfolder="transformer",
        experts="auto",
        regression_weight=1.0,
        regression_data_dir=str(_pairs(tmp_path / "pairs")),
    )
    assert R.check_inputs(cfg)["num_samples"] == 6


def test_int64_latents_stop_the_trainer_before_anything_is_written(teacher, tmp_path):
    """They used to train to a 'finished' run (exit 0, final.json)."""
    data = _int64_latents(tmp_path)
    out = tmp_path / "run"
    p = run_script(
        [
            "--config",
            os.path.join("training", "configs", "tiny-wan-test.yaml"),
            "--pretrained",
            teacher,
            "--data_dir",
            str(data),
            "--output_dir",
            str(out),
            "--max_steps",
            "2",
        ]
    )
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
        assert (
            p.stderr.strip().count("\n") == 0 and "holds only pickle weights (diffusion_pytorch_model.bin)" in p.stderr
        )
        assert not out.exists()


def test_ode_pairs_of_another_latent_size_are_refused_before_anything(teacher, tmp_path, capsys):
    """Pairs valid for the teacher but of another resolution than the training data ([4, 1, 8, 8] against
    [4, 1, 4, 4]) are refused with one line; so are another text width or family when the teacher's config cannot
    tell (``check_pairs`` on the datasets' summaries)."""
    from rcm_diffusers.distill.data import DataError, check_dataset

    pairs = _pairs(tmp_path / "pairs8", noise_shape=None, shape=(4, 1, 8, 8))
    data = _write(tmp_path / "ok")
    cfg = SimpleNamespace(
        pretrained=teacher,
        data_dir=str(data),
        transformer_subfolder="transformer",
        experts="auto",
        regression_weight=1.0,
        regression_data_dir=str(pairs),
    )
    _assert_one_line_exit_2(
        cfg,
        capsys,
        r"--regression_data_dir .*pairs8: latents per sample are \[4, 1, 8, 8\], the "
        r"training data's \(--data_dir .*ok\) are \[4, 1, 4, 4\]",
    )
    d = check_dataset(str(data))
    wide = check_dataset(str(_write(tmp_path / "wide", text_dim=TEXT_DIM * 2)))
    with pytest.raises(
        DataError,
        match=rf"prompt_embeds are {2 * TEXT_DIM} wide, the training data's .* are "
        rf"{TEXT_DIM} wide",
    ):
        R.check_pairs(wide, d, "P", "D")
    with pytest.raises(DataError, match="family 'flux', the training data's"):
        R.check_pairs({**d, "family": "flux"}, d, "P", "D")
    R.check_pairs(check_dataset(str(_pairs(tmp_path / "pairs4"))), d, "P", "D")


class _OneProcess:
    process_index, num_processes, is_main_process = 0, 1, True


def test_nan_and_inf_values_are_found_by_a_streaming_scan(tmp_path, capsys):
    """``scan_values`` reads every float value in chunks (here one row at a time) and names the first NaN / inf:
    a latent of sample 4 (in the second shard), a row of the prompt table, the noise of an ODE pair; processes
    share the read (``part`` / ``parts``); through ``scan_data_values`` it is one line, exit status 2, and
    ``check_data_values false`` skips it."""
    from rcm_diffusers.distill.data import DataError, scan_values

    lat = torch.randn(6, 4, 1, 4, 4)
    lat[4, 2, 0, 1, 3] = float("nan")
    root = tmp_path / "nan"
    g = torch.Generator().manual_seed(0)
    write_latent_dataset(
        str(root),
        {"latents": lat, "prompt_index": torch.arange(6) % 3},
        family="wan",
        tables={"prompt_embeds": torch.randn(3, TEXT_LEN, TEXT_DIM, generator=g)},
        table_index={"prompt_embeds": "prompt_index"},
        shard_size=4,
    )
    for kw in ({}, {"chunk_bytes": 1}):
        with pytest.raises(DataError, match=r"--data_dir .*nan: latents of sample 4 holds NaN or inf \(shard-00001"):
            scan_values(str(root), **kw)
    found = []  # two processes: each reads half of every field's rows, one of them meets sample 4
    for part in (0, 1):
        try:
            scan_values(str(root), part=part, parts=2)
        except DataError as e:
            found.append((part, "latents of sample 4" in str(e)))
    assert found == [(0, True)]
    tab = load_file(root / "tables.safetensors")
    lat[4, 2, 0, 1, 3] = 0.0
    write_latent_dataset(
        str(root),
        {"latents": lat, "prompt_index": torch.arange(6) % 3},
        family="wan",
        tables={"prompt_embeds": tab["prompt_embeds"].index_fill(0, torch.tensor([2]), float("inf"))},
        table_index={"prompt_embeds": "prompt_index"},
        shard_size=4,
    )
    with pytest.raises(DataError, match=r"table 'prompt_embeds', row 2 holds NaN or inf \(tables.safetensors\)"):
        scan_values(str(root), chunk_bytes=1)
    pairs = _pairs(tmp_path / "pairs")
    f = load_file(pairs / "shard-00000.safetensors")
    f["noise"][3, 0, 0, 0, 0] = float("-inf")
    from safetensors.torch import save_file

    save_file(f, pairs / "shard-00000.safetensors")
    cfg = SimpleNamespace(
        data_dir=str(_write(tmp_path / "ok")),
        regression_weight=1.0,
        regression_data_dir=str(pairs),
        check_data_values=True,
    )
    with pytest.raises(SystemExit) as e:
        R.scan_data_values(cfg, _OneProcess())
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert "--regression_data_dir" in err and "noise of sample 3" in err, err
    R.scan_data_values(SimpleNamespace(**{**vars(cfg), "check_data_values": False}), _OneProcess())


@pytest.mark.parametrize(
    "world,cp,latents,match",
    [
        (None, 2, (4, 1, 4, 4), "context_parallel_size 2 needs 2 x k processes, this run has 1"),
        ("3", 2, (4, 1, 4, 4), "context_parallel_size 2 needs 2 x k processes, this run has 3"),
        (
            "4",
            4,
            (4, 1, 4, 4),
            "context_parallel_size 4 does not divide the 2 attention heads of WanTransformer3DModel",
        ),
        (
            "2",
            2,
            (4, 1, 2, 6),
            r"context_parallel_size 2: a sample has 3 video tokens \(1 x 2 x 6 latents, patch "
            r"1 x 2 x 2\), not divisible by 2",
        ),
    ],
)
def test_refused_context_parallel_settings_are_one_line_before_anything(
    teacher, tmp_path, capsys, monkeypatch, world, cp, latents, match
):
    """A process count that is not a multiple of the CP size (one process included), a CP size that does not divide
    the heads, a sample whose video tokens it does not divide: refused by ``check_inputs`` from the launcher's
    WORLD_SIZE, the teacher's config.json and the data's headers, before any process group or folder."""
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.delenv("RANK", raising=False)
    data = _write(tmp_path / "d", latents=torch.randn(6, *latents))
    cfg = SimpleNamespace(
        pretrained=teacher,
        data_dir=str(data),
        transformer_subfolder="transformer",
        experts="auto",
        context_parallel_size=cp,
    )
    _assert_one_line_exit_2(cfg, capsys, match)


def test_a_rank_other_than_0_leaves_the_line_to_rank_0(tmp_path, capsys, monkeypatch):
    """Every rank reaches the same verdict: rank 0 prints it at once, another rank first waits for the launcher to
    stop it and prints only if it is still running then (the line is never lost)."""
    import time

    from rcm_diffusers.distill import errors as E

    monkeypatch.setattr(E, "PEER_WAIT_S", 0.3)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, waits in (("0", False), ("1", True)):
        monkeypatch.setenv("RANK", rank)
        t = time.perf_counter()
        with pytest.raises(SystemExit) as e:
            E.user_error("bad")
        assert e.value.code == 2 and (time.perf_counter() - t >= 0.3) == waits
        assert capsys.readouterr().err == "error: bad\n"
