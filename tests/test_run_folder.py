"""Checkpoints without pickle, their verification, the run-folder rules and the resume policy
(``rcm_diffusers.distill.checkpoints``, ``rcm_diffusers.distill.runs``), in process on a tiny model (no trainer launch).

The pickle hazard this guards against: accelerate's ``load_custom_state`` (accelerate/checkpointing.py)
reads ``custom_checkpoint_*.pkl`` with ``torch.load(weights_only=False)``.
"""

import errno
import hashlib
import json
import os
import pickle
import random
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from train_helpers import REPO, Payload

from rcm_diffusers.distill import checkpoints as C
from rcm_diffusers.distill import errors as E
from rcm_diffusers.distill import guards as G
from rcm_diffusers.distill import inputs as I
from rcm_diffusers.distill import run_folder as RF
from rcm_diffusers.distill.config import QADConfig, RCMConfig
from rcm_diffusers.distill.ema import PowerEMA
from rcm_diffusers.distill.optim import lr_lambda
from rcm_diffusers.distill.session import MetricsWriter, TrainState


class FakeAccelerator:
    is_main_process, is_local_main_process, process_index, num_processes = True, True, 0, 1

    def wait_for_everyone(self):
        pass


class Run:
    """Two 'networks' (student, fake) with AdamW + warm-up LambdaLR each, a power EMA and counters: the
    pieces ``training/rcm.py`` checkpoints, on a tiny MLP."""

    def __init__(self, lr=1e-2, ema_rate=0.1, seed=0):
        torch.manual_seed(seed)
        self.nets = {
            "student": torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)),
            "fake": torch.nn.Linear(4, 2),
        }
        self.named = {r: dict(m.named_parameters()) for r, m in self.nets.items()}
        self.opts = {
            r: torch.optim.AdamW(
                m.parameters(), lr=lr if r == "student" else 1e-3, betas=(0.0, 0.999), weight_decay=0.01
            )
            for r, m in self.nets.items()
        }
        self.scheds = {r: torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(3)) for r, o in self.opts.items()}
        self.ema = PowerEMA(self.named["student"], s=ema_rate)
        self.state = TrainState()
        self.ck = C.Checkpointer(
            FakeAccelerator(),
            (list(self.nets.values()), list(self.nets)),
            {r: (self.opts[r], self.named[r]) for r in self.nets},
            self.scheds,
            self.state,
            self.ema,
        )

    def train(self, n):
        for _ in range(n):
            i = self.state.step
            g = torch.Generator().manual_seed(1000 + i)
            x = torch.randn(5, 4, generator=g) + torch.rand(1).item()  # global RNG in the loop: restored on resume
            role = "student" if i % 3 else "fake"
            self.opts[role].zero_grad()
            self.nets[role](x).square().mean().backward()
            self.opts[role].step()
            self.scheds[role].step()
            if role == "student":
                self.ema.update(self.named["student"], i)
            self.state.step += 1

    def weights(self):
        return {f"{r}.{k}": p.detach().clone() for r, ps in self.named.items() for k, p in ps.items()}


def _cfg(out, **kw):
    d = RCMConfig(pretrained="p", data_dir="d", output_dir=str(out)).model_dump()
    d.update(kw)
    return SimpleNamespace(**d)


def _save(run, out, step=None):
    return run.ck.save(str(out), run.state.step if step is None else step, {"lr": 1e-2}, total_limit=0)


def _two_checkpoints(out):
    """``(run, first, newest)``: a ``Run`` with its checkpoints at steps 2 and 4 in ``out``."""
    run = Run()
    run.train(2)
    first = _save(run, out)
    run.train(2)
    return run, first, _save(run, out)


def _rewrite_manifest(path):
    """Make the manifest match whatever the files now hold (an attacker controls the whole folder)."""
    man = json.load(open(os.path.join(path, "manifest.json")))
    for n in man["files"]:
        b = open(os.path.join(path, n), "rb").read()
        man["files"][n] = {"bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}
    json.dump(man, open(os.path.join(path, "manifest.json"), "w"))


def test_resume_restores_everything_bitwise(tmp_path):
    ref = Run()
    ref.train(7)
    ck = _save(ref, tmp_path)
    assert os.path.basename(ck) == "step-00000007"
    assert sorted(os.listdir(ck)) == [
        "ema.safetensors",
        "manifest.json",
        "optimizer-fake.safetensors",
        "optimizer-student.safetensors",
        "rng-rank0.safetensors",
        "state.json",
        "trainable.safetensors",
    ]
    py, npy = random.random(), np.random.rand()
    ref.train(8)
    other = Run(seed=5)  # other initial weights and RNG: everything must come from the checkpoint
    other.train(2)
    other.ck.load(ck)
    assert other.state.step == 7 and (random.random(), np.random.rand()) == (py, npy)
    other.train(8)
    a, b = ref.weights(), other.weights()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(ref.ema.shadow[k], other.ema.shadow[k]) for k in ref.ema.shadow)
    for r in ref.opts:
        sa, sb = ref.opts[r].state_dict(), other.opts[r].state_dict()
        assert sa["param_groups"] == sb["param_groups"]
        assert all(torch.equal(sa["state"][i][k], sb["state"][i][k]) for i in sa["state"] for k in sa["state"][i])
        assert ref.scheds[r].state_dict() == other.scheds[r].state_dict()


def test_payload_is_live():
    """The payload used below does run code when unpickled (so the next test can fail)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        marker = os.path.join(d, "ran")
        pickle.loads(pickle.dumps(Payload(marker)))
        assert os.path.exists(marker)


SLOTS = [
    "trainable.safetensors",
    "optimizer-student.safetensors",
    "optimizer-fake.safetensors",
    "ema.safetensors",
    "rng-rank0.safetensors",
    "state.json",
    "manifest.json",
    # accelerate save_state's file names: never read
    "custom_checkpoint_0.pkl",
    "custom_checkpoint_1.pkl",
    "random_states_0.pkl",
    "optimizer.bin",
    "optimizer_1.bin",
    "scheduler.bin",
    "scheduler_1.bin",
    "model.safetensors",
    "pytorch_model.bin",
]


@pytest.mark.parametrize("slot", SLOTS)
@pytest.mark.parametrize("writer", ["pickle", "torch.save"])
def test_no_file_in_a_checkpoint_can_run_code(tmp_path, slot, writer):
    run = Run()
    run.train(4)
    ck = _save(run, tmp_path / "out")
    marker = tmp_path / "code_ran"
    p = os.path.join(ck, slot)
    if writer == "pickle":
        with open(p, "wb") as f:
            pickle.dump(Payload(marker), f)
    else:
        torch.save({"state": Payload(marker)}, p)
    if slot != "manifest.json":
        _rewrite_manifest(ck)  # checksums pass: only the file formats protect
    ours = slot in SLOTS[:7]
    fresh = Run(seed=3)
    if ours:
        with pytest.raises(C.CheckpointError):
            fresh.ck.load(ck)
    else:
        fresh.ck.load(ck)  # the accelerate-named files are not part of the checkpoint
        assert fresh.state.step == 4
    assert not marker.exists()


def test_verification_catches_truncation_and_bit_flips(tmp_path):
    run = Run()
    run.train(4)
    ck = _save(run, tmp_path)
    C.verify_checkpoint(ck)
    for n in sorted(os.listdir(ck)):
        if n == "manifest.json":
            continue
        p = os.path.join(ck, n)
        good = open(p, "rb").read()
        open(p, "wb").write(good[: len(good) // 2])
        with pytest.raises(C.CheckpointError, match=f"{n} has {len(good) // 2} bytes"):
            C.verify_checkpoint(ck)
        flipped = bytearray(good)
        flipped[len(good) // 2] ^= 0x10
        open(p, "wb").write(bytes(flipped))
        with pytest.raises(C.CheckpointError, match=f"{n} does not match its SHA-256"):
            C.verify_checkpoint(ck)
        open(p, "wb").write(good)
    os.remove(os.path.join(ck, "manifest.json"))
    with pytest.raises(C.CheckpointError, match="interrupted"):
        C.verify_checkpoint(ck)


def test_prune_by_step_number_not_name(tmp_path):
    for s in (99_999_999, 100_000_000, 100_000_001, 5):
        os.makedirs(tmp_path / "checkpoints" / f"step-{s:08d}")
    os.makedirs(tmp_path / "checkpoints" / "step-00000007.tmp")
    assert [s for s, _ in C.list_checkpoints(str(tmp_path))] == [5, 99_999_999, 100_000_000, 100_000_001]
    C.prune_checkpoints(str(tmp_path), 2)
    # name order would have kept step-99999999 (it sorts after step-100000001)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-00000007.tmp", "step-100000000", "step-100000001"]


def test_new_run_into_a_used_folder_is_refused_or_overwritten(tmp_path):
    out = tmp_path / "run"
    assert RF.choose_start(_cfg(out)) is None  # missing folder: fresh
    run = Run()
    run.train(3)
    _save(run, out)
    (out / "final.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="already holds a training run .*--resume latest.*--overwrite true"):
        RF.choose_start(_cfg(out, seed=1))
    assert (out / "final.json").exists() and C.list_checkpoints(str(out))
    logs = []
    assert RF.choose_start(_cfg(out, overwrite=True), logs.append) is None
    assert sorted(os.listdir(out)) == ["notes.txt"] and "removed" in logs[0]  # only the run's own files go


def test_resume_latest_falls_back_to_the_newest_intact_checkpoint(tmp_path):
    out = tmp_path / "run"
    run = Run()
    for _ in range(3):
        run.train(2)
        _save(run, out)
    ckpts = [p for _, p in C.list_checkpoints(str(out))]
    with open(os.path.join(ckpts[-1], "trainable.safetensors"), "r+b") as f:
        f.truncate(100)
    logs = []
    assert RF.choose_start(_cfg(out, resume="latest"), logs.append) == ckpts[1]
    assert "step-00000006 is damaged" in logs[0] and "trainable.safetensors has 100 bytes" in logs[0]
    assert os.path.isdir(ckpts[-1] + ".damaged") and [p for _, p in C.list_checkpoints(str(out))] == ckpts[:2]
    # all damaged: refused, not a silent fresh start
    for p in ckpts[:2]:
        os.remove(os.path.join(p, "manifest.json"))
    with pytest.raises(SystemExit, match="no intact checkpoint"):
        RF.choose_start(_cfg(out, resume="latest"))


def test_resume_an_older_checkpoint_needs_overwrite(tmp_path):
    out = tmp_path / "run"
    run = Run()
    for _ in range(3):
        run.train(2)
        _save(run, out)
    (out / "final.json").write_text("{}")
    old = str(out / "checkpoints" / "step-00000002")
    with pytest.raises(SystemExit, match="step-00000004, step-00000006.*mix two histories"):
        RF.choose_start(_cfg(out, resume=old))
    assert RF.choose_start(_cfg(out, resume=old, overwrite=True), print) == old
    assert [s for s, _ in C.list_checkpoints(str(out))] == [2] and not (out / "final.json").exists()
    # a checkpoint of another run: only into an empty folder
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit, match="needs an empty --output_dir"):
        RF.choose_start(_cfg(other, resume=old))
    with pytest.raises(SystemExit, match="no MANIFEST|has no manifest.json"):
        RF.choose_start(_cfg(tmp_path / "x", resume=str(tmp_path)))


def test_resume_policy_refuses_applies_and_ignores():
    saved = RCMConfig(pretrained="p", data_dir="d", max_steps=30).model_dump()
    ok = RCMConfig(pretrained="p", data_dir="d", max_steps=40, lr=1e-2, ema_rate=0.2, fd_type=2, checkpoint_every=7)
    assert RF.resume_changes(saved, ok, 20) == {"lr": [1e-4, 1e-2], "ema_rate": [0.1, 0.2], "fd_type": [0, 2]}
    older = {k: v for k, v in saved.items() if k not in ("lr_decay", "lr_final_ratio")}  # written before they existed
    assert RF.resume_changes(older, ok, 20) == RF.resume_changes(saved, ok, 20)
    assert RF.resume_changes(older, ok.model_copy(update={"lr_decay": "cosine"}), 20)["lr_decay"] == ["none", "cosine"]
    for kw, match in (
        ({"lora_rank": 8}, "lora_rank 32 -> 8"),
        ({"seed": 1}, "seed 0 -> 1"),
        ({"batch_size": 4}, "batch_size"),
        ({"tangent_warmup": 5}, "tangent_warmup"),
        ({"ema_rate": 0.0}, "switched on or off"),
        ({"max_steps": 15}, "--max_steps 15 is below the checkpoint's step 20"),
    ):
        with pytest.raises(SystemExit, match=match):
            RF.resume_changes(saved, RCMConfig(pretrained="p", data_dir="d", **kw), 20)
    q = QADConfig(pretrained="p", data_dir="d").model_dump()
    with pytest.raises(SystemExit, match="format 'nvfp4' -> 'int8'"):
        RF.resume_changes(q, QADConfig(pretrained="p", data_dir="d", format="int8"), 3)
    assert RF.resume_changes(q, QADConfig(pretrained="p", data_dir="d", lr=1e-3, alpha=0.5), 3) == {
        "lr": [1e-5, 1e-3],
        "alpha": [0.1, 0.5],
    }
    # every option declares its policy; the two-expert, time-input and quantizer options are refused
    for kw, match in (
        ({"experts": "one"}, "experts 'auto' -> 'one'"),
        ({"boundary_ratio": 0.5}, "boundary_ratio"),
        ({"time_input": "float"}, "time_input 'bf16' -> 'float'"),
    ):
        with pytest.raises(SystemExit, match=match):
            RF.resume_changes(saved, RCMConfig(pretrained="p", data_dir="d", **kw), 20)
    for kw in ({"time_input": "float"}, {"target": "fake"}, {"act_scale": "dynamic"}):
        with pytest.raises(SystemExit, match=f"cannot change on resume: {next(iter(kw))} "):
            RF.resume_changes(q, QADConfig(pretrained="p", data_dir="d", **kw), 3)


def test_changed_lr_and_ema_rate_apply_on_resume(tmp_path):
    run = Run(lr=1e-2)
    run.train(6)
    ck = _save(run, tmp_path)
    lam = lr_lambda(3)(run.scheds["student"].last_epoch)
    lr_fake = run.opts["fake"].param_groups[0]["lr"]
    assert run.opts["student"].param_groups[0]["lr"] == 1e-2 * lam
    run.train(3)
    same, faster = Run(lr=1e-2), Run(lr=5e-2, ema_rate=0.2)
    same.ck.load(ck)  # each load also restores the global RNG, so train each right after its load
    assert same.opts["student"].param_groups[0]["lr"] == 1e-2 * lam and same.ema.s == 0.1
    same.train(3)
    faster.ck.load(ck)
    assert faster.opts["student"].param_groups[0]["lr"] == 5e-2 * lam and faster.scheds["student"].base_lrs == [5e-2]
    assert faster.opts["fake"].param_groups[0]["lr"] == lr_fake and faster.ema.s == 0.2
    faster.train(3)
    a, b, c = run.weights(), same.weights(), faster.weights()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert max(float((a[k] - c[k]).abs().max()) for k in a if k.startswith("student")) > 1e-4


def test_a_changed_rank_is_a_clear_error_not_a_size_mismatch(tmp_path):
    run = Run()
    run.train(2)
    ck = _save(run, tmp_path)
    wide = Run()
    wide.nets["student"] = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    wide.named["student"] = dict(wide.nets["student"].named_parameters())
    wide.opts["student"] = torch.optim.AdamW(wide.nets["student"].parameters())
    wide.ck = C.Checkpointer(
        FakeAccelerator(),
        (list(wide.nets.values()), list(wide.nets)),
        {r: (wide.opts[r], wide.named[r]) for r in wide.nets},
        wide.scheds,
        wide.state,
        None,
    )
    with pytest.raises(C.CheckpointError, match="trainable weights do not load|shape"):
        wide.ck.load(ck)


def test_run_lock_refuses_a_second_writer(tmp_path):
    lock = RF.RunLock(str(tmp_path))
    with pytest.raises(SystemExit, match=f"in use by pid {os.getpid()}"):
        RF.RunLock(str(tmp_path))
    lock.release()  # (a second trainer process: tests/test_train_wan.py::test_a_used_run_folder_is_never_mixed)
    RF.RunLock(str(tmp_path)).release()
    assert RF.choose_start(_cfg(tmp_path)) is None  # the lock file alone is not a run


def test_metrics_tolerate_a_torn_last_line(tmp_path, capsys):
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": i, "loss": 0.5}) + "\n" for i in range(5)) + '{"step": 5, "lo')
    MetricsWriter(str(p), 4, True).write({"step": 4})
    assert [json.loads(ln)["step"] for ln in p.read_text().splitlines()] == [0, 1, 2, 3, 4]
    assert "dropped 1 unreadable line" in capsys.readouterr().err


def test_skipped_steps_are_reported_and_fail_past_the_fraction():
    st, logs = TrainState(), []
    cfg = SimpleNamespace(max_skipped_fraction=0.1, max_steps=20)
    G.note_skip(st, cfg, 3, "student", float("nan"), [4, 5], logs.append)
    G.note_skip(st, cfg, 7, "fake", float("inf"), [1, 2], logs.append)
    assert st.skipped == 2 and st.skipped_steps == [3, 7] and "step 3: student gradient norm is nan" in logs[0]
    with pytest.raises(SystemExit, match=r"3 of 9 steps had a non-finite gradient .*steps \[3, 7, 8\]"):
        G.note_skip(st, cfg, 8, "student", float("nan"), [0, 1], logs.append)
    w = {"a": torch.zeros(3), "b": torch.ones(2)}
    init = G.param_checksum(w)
    st.step = 20
    with pytest.raises(SystemExit, match="nothing was learned"):
        G.check_learned(w, init, st, cfg)
    w["a"][1] = 1e-6
    G.check_learned(w, init, st, cfg)
    lora = {"x.lora_A.student.weight": torch.randn(2, 3), "x.lora_B.student.weight": torch.zeros(3, 2)}
    with pytest.raises(SystemExit, match="LoRA is zero"):  # weight decay moved A, B stayed 0: B A = 0
        G.check_learned(lora, [0.0, 0.0], st, cfg)
    lora["x.lora_B.student.weight"][0, 0] = 1e-8
    G.check_learned(lora, [0.0, 0.0], st, cfg)
    w["b"][0] = float("nan")
    with pytest.raises(SystemExit, match="NaN or inf"):
        G.check_learned(w, init, st, cfg)


def test_disk_full_while_checkpointing_is_a_clear_message(tmp_path, monkeypatch):
    run = Run()
    run.train(2)
    first = _save(run, tmp_path)
    real = C._save_tensors

    def full(tensors, path, metadata=None):
        if "optimizer" in path:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(tensors, path, metadata)

    monkeypatch.setattr(C, "_save_tensors", full)
    run.train(2)
    with pytest.raises(SystemExit, match=r"disk full while writing .*step-00000004\.tmp .*MiB free.*--resume latest"):
        _save(run, tmp_path)
    assert [p for _, p in C.list_checkpoints(str(tmp_path))] == [first] and not os.path.exists(
        first.replace("2", "4") + ".tmp"
    )
    C.verify_checkpoint(first)
    assert C.is_disk_full(RuntimeError("basic_ios::clear: iostream error"))  # torch.save's text for ENOSPC


def test_real_disk_full_on_a_tiny_tmpfs(tmp_path):
    """A real ENOSPC: a 64 KiB tmpfs (8 KiB left free) mounted in a private user+mount namespace (``unshare -rm``)."""
    import shutil as sh

    if sh.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -rm (user namespaces) not available to mount a small tmpfs")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = (
        f"import sys; sys.path[:0] = [{REPO!r}, {os.path.join(REPO, 'tests')!r}]\n"
        "from test_run_folder import Run, _save\nrun = Run()\nrun.train(2)\n"
        f"open({str(mnt / 'filler')!r}, 'wb').write(bytes(56 * 1024))  # leaves 8 KiB\n"
        f"_save(run, {str(mnt / 'run')!r})\n"
    )
    p = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=64k tmpfs {mnt} && {sys.executable} -c "$0"', script],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    if "mount:" in p.stderr:
        pytest.skip(f"cannot mount tmpfs here: {p.stderr.strip()[:200]}")
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "error: disk full while writing" in p.stderr and "No space left on device" in p.stderr


def test_missing_pretrained_folder_and_config_errors_are_plain(tmp_path):
    with pytest.raises(SystemExit, match="--pretrained /nonexistent/wan: no such folder"):
        I.model_index("/nonexistent/wan")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no model_index.json"):
        I.model_index(str(tmp_path / "empty"))
    with pytest.raises(SystemExit, match=r"^error: config option max_skipped_fraction = 2(\.0)?: must lie in"):
        E.load_config_or_exit(
            ["--pretrained", "p", "--data_dir", "d", "--max_skipped_fraction", "2"], config_cls=QADConfig
        )
    with pytest.raises(SystemExit, match="^error: .*No such file"):
        E.load_config_or_exit(["--config", str(tmp_path / "nope.yaml")])
    # the whole script: one plain line, no traceback (training/qad.py uses the same helper)
    p = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "training", "rcm.py"),
            "--pretrained",
            "p",
            "--data_dir",
            "d",
            "--lora_rank",
            "0",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]  # bad input: exit status 2
    assert p.stderr.count("config option lora_rank = 0: must be >= 1") == 1


def test_overwrite_leaves_nothing_of_the_old_run(tmp_path):
    """A two-expert run's second LoRA, full-mode second expert and extra scheduler files went unremoved, so a new
    single-network run in the same folder was loaded together with the old low-noise expert."""
    from rcm_diffusers.lora.pipeline import expert_lora_files

    out = tmp_path / "run"
    run = Run()
    run.train(2)
    _save(run, out)
    for rel in (
        "pytorch_lora_weights.safetensors",
        "transformer_2/pytorch_lora_weights.safetensors",
        "ema/transformer_2/pytorch_lora_weights.safetensors",
        "student_transformer_2/config.json",
        "scheduler/scheduler_config.json",
        "scheduler/extra.json",
        "delta_comfyui.safetensors",
        "final.json",
    ):
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text("old")
    (out / "notes.txt").write_text("mine")
    assert set(expert_lora_files(str(out))) == {"transformer", "transformer_2"}
    logs = []
    assert RF.choose_start(_cfg(out, overwrite=True), logs.append) is None
    assert sorted(os.listdir(out)) == ["notes.txt"], os.listdir(out)
    (out / "pytorch_lora_weights.safetensors").write_text("new")  # the new single-network run's export
    assert expert_lora_files(str(out)) == {"transformer": str(out / "pytorch_lora_weights.safetensors")}


def test_final_json_checksums_catch_a_flipped_bit(tmp_path, capsys):
    out = tmp_path / "run"
    for rel in (
        "pytorch_lora_weights.safetensors",
        "ema/pytorch_lora_weights.safetensors",
        "scheduler/scheduler_config.json",
    ):
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(os.urandom(64))
    (out / "metrics.jsonl").write_text("{}\n")  # not an export
    files = RF.export_files(str(out))
    assert sorted(files) == [
        "ema/pytorch_lora_weights.safetensors",
        "pytorch_lora_weights.safetensors",
        "scheduler/scheduler_config.json",
    ]
    (out / "final.json").write_text(json.dumps({"step": 3, "files": files}))
    assert RF.verify_run(str(out)) == (3, []) and RF.verify_main([str(out)]) == 0
    p = out / "ema" / "pytorch_lora_weights.safetensors"
    b = bytearray(p.read_bytes())
    b[10] ^= 0x04
    p.write_bytes(bytes(b))
    (out / "transformer_2").mkdir()
    (out / "transformer_2" / "pytorch_lora_weights.safetensors").write_text("stray")
    capsys.readouterr()
    assert RF.verify_main([str(out)]) == 1
    err = capsys.readouterr().err
    assert "ema/pytorch_lora_weights.safetensors: SHA-256 differs" in err
    assert "transformer_2/pytorch_lora_weights.safetensors: not listed in final.json" in err
    assert RF.verify_main([str(tmp_path / "none")]) == 2


class _Hang(Exception):
    pass


def _no_hang(seconds=30):
    """A read that blocks (a FIFO) raises instead of hanging the test."""
    import signal

    def on_alarm(*_):
        raise _Hang("blocked reading the checkpoint")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)


def test_only_regular_files_listed_in_the_manifest_are_read(tmp_path):
    import signal

    out = tmp_path / "run"
    run, first, newest = _two_checkpoints(out)
    man = os.path.join(newest, "manifest.json")
    os.remove(man)
    os.mkfifo(man)  # opening it for reading blocks until a writer comes: --resume used to hang holding the lock
    logs = []
    _no_hang()
    try:
        assert RF.choose_start(_cfg(out, resume="latest"), logs.append) == first
        # a FIFO in place of the random state, left out of the manifest: not opened
        other = _save(run, tmp_path / "other")
        os.remove(os.path.join(other, "rng-rank0.safetensors"))
        os.mkfifo(os.path.join(other, "rng-rank0.safetensors"))
        m = json.load(open(os.path.join(other, "manifest.json")))
        del m["files"]["rng-rank0.safetensors"]
        json.dump(m, open(os.path.join(other, "manifest.json"), "w"))
        with pytest.raises(C.CheckpointError, match="rng-rank0.safetensors not listed in manifest.json"):
            C.verify_checkpoint(other)
        with pytest.raises(C.CheckpointError, match="rng-rank0.safetensors is not listed in manifest.json"):
            Run(seed=3).ck.load(other, verify=False)
    finally:
        signal.alarm(0)
    assert "not a regular file" in logs[0]
    # a file dropped from the manifest is not loaded unchecked
    third = _save(run, tmp_path / "third")
    changed = Run(seed=7)
    C._save_tensors({k: v + 1 for k, v in changed.ema.shadow.items()}, os.path.join(third, "ema.safetensors"))
    m = json.load(open(os.path.join(third, "manifest.json")))
    del m["files"]["ema.safetensors"]
    json.dump(m, open(os.path.join(third, "manifest.json"), "w"))
    with pytest.raises(C.CheckpointError, match="ema.safetensors not listed"):
        C.verify_checkpoint(third)
    fresh = Run(seed=3)
    with pytest.raises(C.CheckpointError, match="ema.safetensors is not listed"):
        fresh.ck.load(third, verify=False)


def _nested(ck):
    open(os.path.join(ck, "state.json"), "w").write("[" * 200000 + "]" * 200000)


def _rng_size(ck):
    from safetensors import safe_open
    from safetensors.torch import save_file

    p = os.path.join(ck, "rng-rank0.safetensors")
    with safe_open(p, framework="pt") as f:
        meta = f.metadata()
    save_file({"torch_cpu": torch.zeros(100, dtype=torch.uint8)}, p, metadata=meta)


def _state(**kw):
    def change(ck):
        p = os.path.join(ck, "state.json")
        st = json.load(open(p))
        for k, v in kw.items():
            if k == "last_epoch":
                st["schedulers"]["student"]["last_epoch"] = v
            else:
                st["train_state"][k] = v
        json.dump(st, open(p, "w"))

    return change


BAD_STATE = {
    "deeply nested JSON": (_nested, "cannot read .*state.json.*recursion"),
    "wrong-size RNG state": (_rng_size, "torch CPU generator state .*not 5056 bytes"),
    "string step": (_state(step="4"), "step '4' is not a whole number"),
    "negative step": (_state(step=-3), "step -3 is not a whole number"),
    "string last_epoch": (_state(last_epoch="3"), "scheduler 'student': last_epoch '3'"),
}


@pytest.mark.parametrize("kind", list(BAD_STATE))
def test_bad_values_in_a_checkpoint_fall_back_like_damage(tmp_path, kind):
    change, match = BAD_STATE[kind]
    out = tmp_path / "run"
    run, first, newest = _two_checkpoints(out)
    change(newest)
    _rewrite_manifest(newest)  # the checksums pass: only the checks of the values protect
    with pytest.raises(C.CheckpointError, match=match):
        Run(seed=3).ck.load(newest)
    with pytest.raises(C.CheckpointError, match=match):
        C.read_state(newest) if kind != "wrong-size RNG state" else C.verify_checkpoint(newest)
    logs = []
    assert RF.choose_start(_cfg(out, resume="latest"), logs.append) == first
    assert "step-00000004 is damaged" in logs[0] and os.path.isdir(newest + ".damaged")


def test_an_unreadable_file_in_the_newest_checkpoint_falls_back(tmp_path, monkeypatch):
    out = tmp_path / "run"
    run, first, newest = _two_checkpoints(out)
    bad = os.path.join(newest, "trainable.safetensors")
    if os.geteuid() != 0:
        os.chmod(bad, 0)
    else:  # root reads any file: make the read fail as it would for a user
        real = C._sha256

        def sha(path):
            if path == bad:
                raise PermissionError(errno.EACCES, "Permission denied", path)
            return real(path)

        monkeypatch.setattr(C, "_sha256", sha)
    logs = []
    assert RF.choose_start(_cfg(out, resume="latest"), logs.append) == first
    assert "cannot read trainable.safetensors (Permission denied)" in logs[0]


def test_a_run_folder_made_read_only_mid_run(tmp_path, monkeypatch, capsys):
    """Root writes anywhere, so the refusal is simulated at the first write of the checkpoint (as the kernel would
    refuse it); nothing older is lost and resuming the last checkpoint gives the same weights."""
    ref = Run()
    ref.train(6)
    run = Run()
    run.train(3)
    first = _save(run, tmp_path)
    real = C._save_tensors

    def refuse(tensors, path, metadata=None):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(C, "_save_tensors", refuse)
    run.train(3)
    with pytest.raises(
        SystemExit,
        match=r"cannot write .*step-00000006\.tmp.*Permission denied.*make the run folder "
        r"writable and run again with --resume latest",
    ):
        _save(run, tmp_path)
    monkeypatch.setattr(C, "_save_tensors", real)
    assert [p for _, p in C.list_checkpoints(str(tmp_path))] == [first] and not os.path.exists(first[:-1] + "6.tmp")
    again = Run(seed=9)
    again.ck.load(RF.choose_start(_cfg(tmp_path, resume="latest")))
    again.train(3)
    a, b = ref.weights(), again.weights()
    assert all(torch.equal(a[k], b[k]) for k in a)

    def main():  # any other write of the trainer (metrics, exports): one line, exit 1
        raise PermissionError(errno.EROFS, "Read-only file system", str(tmp_path / "metrics.jsonl"))

    with pytest.raises(SystemExit) as e:
        E.run_main(main)
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "cannot write " + str(tmp_path / "metrics.jsonl") + " (Read-only file system)" in err
    )


def _finished_run(out):
    """A run folder with three exports, a log and a checkpoint file, and the final.json a run writes."""
    for rel in (
        "pytorch_lora_weights.safetensors",
        "ema/pytorch_lora_weights.safetensors",
        "scheduler/scheduler_config.json",
        "checkpoints/step-00000002/state.json",
    ):
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(os.urandom(64))
    (out / "metrics.jsonl").write_text("{}\n")
    (out / "final.json").write_text(
        json.dumps({"step": 3, "files": RF.export_files(str(out)), "run_entries": RF.run_entries(str(out))})
    )
    assert RF.verify_run(str(out)) == (3, [])
    return out


def test_verify_reports_links_and_never_follows_them(tmp_path):
    """An export replaced by a link to an identical file outside, a linked ema/ folder (to an identical copy), a
    linked final.json, ``scheduler -> /`` and a link inside checkpoints/: each is named as a link, none is read
    through (the link to / gives one line, not a walk of the file system)."""
    import shutil

    out = _finished_run(tmp_path / "run")
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(out / "pytorch_lora_weights.safetensors", outside / "lora.safetensors")
    os.remove(out / "pytorch_lora_weights.safetensors")
    os.symlink(outside / "lora.safetensors", out / "pytorch_lora_weights.safetensors")
    shutil.copytree(out / "ema", outside / "ema")
    shutil.rmtree(out / "ema")
    os.symlink(outside / "ema", out / "ema")
    shutil.rmtree(out / "scheduler")
    os.symlink("/", out / "scheduler")
    os.symlink(outside / "lora.safetensors", out / "checkpoints" / "step-00000002" / "extra.safetensors")
    n, problems = RF.verify_run(str(out))
    lora = outside / "lora.safetensors"
    links = [
        ("checkpoints/step-00000002/extra.safetensors", lora),
        ("ema", outside / "ema"),
        ("pytorch_lora_weights.safetensors", lora),
        ("scheduler", "/"),
    ]
    assert sorted(problems) == sorted(
        f"{rel}: a symbolic link (to {to}); not followed (a run writes no links)" for rel, to in links
    ), problems
    shutil.move(str(out / "final.json"), str(outside / "final.json"))
    os.symlink(outside / "final.json", out / "final.json")
    assert RF.verify_run(str(out)) == (
        0,
        [f"final.json: a symbolic link (to {outside / 'final.json'}); not followed (a run writes no links)"],
    )


def test_verify_names_an_extra_file_anywhere_and_says_when_a_file_cannot_be_read(tmp_path, monkeypatch, capsys):
    """A file at the top of the run folder that the run did not write is named (as one inside an export folder is);
    the run's logs and checkpoints are not exports and pass; an export that cannot be read gets a read message
    (exit status 1), not a write one. Root reads any file, so the refusal is simulated at the open."""
    out = _finished_run(tmp_path / "run")
    (out / "extra.safetensors").write_bytes(b"x")
    (out / "scheduler" / "stray.json").write_text("{}")
    os.mkfifo(out / "pipe")
    _, problems = RF.verify_run(str(out))
    assert problems == [
        "extra.safetensors: not listed in final.json (not written by this run)",
        "pipe: not listed in final.json (not written by this run)",
        "scheduler/stray.json: not listed in final.json (not written by this run)",
    ], problems
    for n in ("extra.safetensors", "scheduler/stray.json", "pipe"):
        os.remove(out / n)
    real_open = os.open

    def refuse(path, flags, *a, **kw):
        if str(path).endswith("ema/pytorch_lora_weights.safetensors"):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", refuse)
    capsys.readouterr()
    assert RF.verify_main([str(out)]) == 1
    err = capsys.readouterr().err
    assert err == "error: ema/pytorch_lora_weights.safetensors: cannot read it (Permission denied)\n", err


def _forge(ck, name, change):
    """Rewrite ``name`` of checkpoint ``ck`` through ``change(tensors)`` and the manifest to match (a forgery)."""
    from safetensors.torch import load_file, save_file

    t = load_file(os.path.join(ck, name))
    change(t)
    save_file(t, os.path.join(ck, name))
    _rewrite_manifest(ck)


FORGED = {
    "trainable: a key the model lacks": (
        "trainable.safetensors",
        lambda t: t.update({"extra": torch.zeros(2)}),
        r"trainable.safetensors names 1 key\(s\) the model does not have \(extra\)",
    ),
    "trainable: a key missing": (
        "trainable.safetensors",
        lambda t: t.pop("student::2.bias"),
        r"trainable.safetensors lacks 1 key\(s\) the model has \(student::2.bias\)",
    ),
    "optimizer: state of no parameter": (
        "optimizer-student.safetensors",
        lambda t: t.update({"ghost.weight::exp_avg": torch.zeros(3)}),
        r"optimizer-student.safetensors names 1 key\(s\) the model does not have "
        r"\(ghost.weight\)",
    ),
    "optimizer: an entry missing": (
        "optimizer-student.safetensors",
        lambda t: t.pop("0.weight::exp_avg"),
        "parameters hold different state entries",
    ),
    "EMA: a key missing": ("ema.safetensors", lambda t: t.pop(sorted(t)[0]), r"ema.safetensors lacks 1 key\(s\)"),
    "trainable: another shape": (
        "trainable.safetensors",
        lambda t: t.update({"fake::bias": torch.zeros(3)}),
        r"fake::bias has shape \[3\], the model's is \[2\]",
    ),
}


@pytest.mark.parametrize("kind", list(FORGED))
def test_a_checkpoint_whose_keys_differ_from_the_model_is_damage(tmp_path, kind):
    """A (re-checksummed) checkpoint whose trainable weights, optimizer states or EMA name keys the model does not
    have, or lack keys it has: ``load`` refuses it before changing anything; the session falls back to the previous
    intact checkpoint with ``--resume latest`` (the forged one renamed ``*.damaged``) and stops with one line,
    exit status 2, with ``--resume PATH``."""
    from rcm_diffusers.distill.session import RunSession

    name, change, match = FORGED[kind]
    out = tmp_path / "run"
    run, first, newest = _two_checkpoints(out)
    _forge(newest, name, change)
    C.verify_checkpoint(newest)  # the files match the manifest: only the keys give it away
    other = Run(seed=5)
    before = other.weights()
    with pytest.raises(C.CheckpointError, match=match):
        other.ck.load(newest)
    after = other.weights()
    assert all(torch.equal(before[k], after[k]) for k in before)

    class Acc(FakeAccelerator):
        def __init__(self):
            self.logs = []

        def print(self, *a):
            self.logs.append(" ".join(map(str, a)))

    session = object.__new__(RunSession)
    session.cfg = RCMConfig(pretrained="p", data_dir="d", output_dir=str(out), resume="latest")
    session.acc, session.main, session.ckpt = Acc(), True, newest
    assert session._matching_checkpoint(other.ck) == first and session.ckpt == first
    assert os.path.isdir(newest + ".damaged") and re.search(match, session.acc.logs[0]), session.acc.logs
    assert session.saved["train_state"]["step"] == 2
    other.ck.load(first)
    os.replace(newest + ".damaged", newest)
    session.cfg, session.ckpt = RCMConfig(pretrained="p", data_dir="d", output_dir=str(out), resume=newest), newest
    with pytest.raises(SystemExit) as e:
        session._matching_checkpoint(Run(seed=6).ck)
    assert e.value.code == 2 and re.search(match, str(e.value))


def test_a_checkpoint_that_resolves_outside_the_run_folder_is_refused(tmp_path):
    """The newest checkpoint folder a link to a (valid) copy outside the run: skipped as damaged; checkpoints/ itself
    a link outside: no checkpoint is used (refused, exit status 2); ``--resume PATH`` naming a link: refused."""
    import shutil

    out = tmp_path / "run"
    run, first, newest = _two_checkpoints(out)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(newest, elsewhere)
    os.symlink(elsewhere, newest)
    C.verify_checkpoint(str(elsewhere))  # intact where it lies
    logs = []
    assert RF.choose_start(_cfg(out, resume="latest"), logs.append) == first
    assert "is a symbolic link" in logs[0] and os.path.islink(newest + ".damaged")
    with pytest.raises(SystemExit) as e:
        RF.choose_start(_cfg(out, resume=newest + ".damaged"))
    assert e.value.code == 2 and "is a symbolic link" in str(e.value)
    ckdir = out / "checkpoints"
    shutil.move(str(ckdir), str(tmp_path / "ck_outside"))
    os.symlink(tmp_path / "ck_outside", ckdir)
    logs = []
    with pytest.raises(SystemExit) as e:
        RF.choose_start(_cfg(out, resume="latest"), logs.append)
    assert e.value.code == 2 and "no intact checkpoint" in str(e.value)
    assert any("outside the run folder" in m for m in logs), logs


def test_a_refused_start_leaves_no_folder_and_no_lock(tmp_path):
    """``--resume`` of a checkpoint that does not exist into a new --output_dir: refused with exit status 2 after the
    lock was taken, and the folders the session created (lock file included) are gone again."""
    from rcm_diffusers.distill.session import RunSession

    class Acc(FakeAccelerator):
        def print(self, *a):
            pass

    out = tmp_path / "new" / "run"
    cfg = RCMConfig(
        pretrained="p", data_dir="d", output_dir=str(out), resume=str(tmp_path / "nope"), check_data_values=False
    )
    with pytest.raises(SystemExit) as e:
        RunSession(cfg, Acc(), "rcm")
    assert e.value.code == 2 and "nope is not a checkpoint directory" in str(e.value)
    assert not (tmp_path / "new").exists()
