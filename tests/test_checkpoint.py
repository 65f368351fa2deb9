"""ranmt.checkpoint on its own, without training: what each function promises (atomic
replacement, which directory a path resolves to, the optimizer state and RNG tensors round
trip, errors for every unreadable part, exact averages). Written to kill the module's
mutants (docs/MUTATION.md); the trainer's resume is tested end to end in test_train.py and
test_robustness.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_model
from ranmt import checkpoint as ck
from ranmt.checkpoint import (
    CheckpointError,
    average_checkpoints,
    load_checkpoint,
    load_training_state,
    optimizer_from_tensors,
    optimizer_to_tensors,
    read_meta,
    resolve_checkpoint,
    save_checkpoint,
    step_checkpoints,
    write_meta,
)


@pytest.fixture
def vocab_files(tmp_path):
    files = {}
    for side in ("src", "tgt"):
        files[side] = tmp_path / f"vocab.{side}"
        files[side].write_bytes(f"spm {side}".encode())
    return files


def _trained_optimizer(model):
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98))
    for _ in range(2):
        optimizer.zero_grad()
        sum(p.float().pow(2).sum() for p in model.parameters()).backward()
        optimizer.step()
    return optimizer


def test_save_writes_every_part_and_load_gives_the_same_model_in_eval_mode(tmp_path,
                                                                           vocab_files):
    model, cfg = tiny_model(seed=1)
    out = save_checkpoint(tmp_path / "ck", model.train(), cfg, vocab_files, {"step": 7})
    assert out == tmp_path / "ck"
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoint.json", "model.safetensors", "spm.src.model", "spm.tgt.model"]
    assert (out / "spm.src.model").read_bytes() == b"spm src"
    assert (out / "spm.tgt.model").read_bytes() == b"spm tgt"
    meta = json.loads((out / "checkpoint.json").read_text())
    assert meta["format_version"] == ck.FORMAT_VERSION and meta["trainer"] == {"step": 7}
    assert "optimizer" not in meta
    assert (out / "checkpoint.json").read_text().startswith('{\n "format_version"')  # indented
    loaded, loaded_cfg, loaded_meta, directory = load_checkpoint(out)
    assert directory == out and not loaded.training and loaded_meta == meta
    assert loaded_cfg.model.d_model == cfg.model.d_model
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert save_checkpoint(tmp_path / "ck2", model, cfg, vocab_files) and json.loads(
        (tmp_path / "ck2/checkpoint.json").read_text())["trainer"] == {}


def test_saving_over_a_checkpoint_replaces_it_and_leaves_no_temporary(tmp_path, vocab_files):
    first, cfg = tiny_model(seed=1)
    second, _ = tiny_model(seed=2)
    save_checkpoint(tmp_path / "ck", first, cfg, vocab_files, {"step": 1})
    (tmp_path / "ck" / "stale").write_text("from the first save")
    for leftover in ("ck.tmp", "ck.old"):  # left by kills mid-write and between renames
        (tmp_path / leftover).mkdir()
        (tmp_path / leftover / "junk").write_text("x")
    save_checkpoint(tmp_path / "ck", second, cfg, vocab_files, {"step": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "vocab.src", "vocab.tgt"]
    assert not (tmp_path / "ck" / "stale").exists()
    loaded, _, meta, _ = load_checkpoint(tmp_path / "ck")
    assert meta["trainer"] == {"step": 2}
    key = next(iter(second.state_dict()))
    assert torch.equal(loaded.state_dict()[key], second.state_dict()[key])


def test_a_kill_between_the_two_renames_leaves_the_previous_checkpoint_findable(
        tmp_path, vocab_files, monkeypatch):
    """save_checkpoint moves the old directory aside as NAME.old before renaming the new one
    into place; resolve_checkpoint finds best.old when a kill came in between."""
    run = tmp_path / "run"
    first, cfg = tiny_model(seed=1)
    save_checkpoint(run / "best", first, cfg, vocab_files, {"step": 1})
    renames = []
    real_replace = type(run).replace

    def replace_then_die(self, target):
        renames.append(self.name)
        if len(renames) == 2:  # the new directory's rename: killed before it
            raise KeyboardInterrupt
        return real_replace(self, target)

    monkeypatch.setattr(type(run), "replace", replace_then_die)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(run / "best", tiny_model(seed=2)[0], cfg, vocab_files, {"step": 2})
    monkeypatch.undo()
    assert renames == ["best", "best.tmp"] and not (run / "best").exists()
    assert resolve_checkpoint(run) == run / "best.old"
    assert load_checkpoint(run)[2]["trainer"] == {"step": 1}
    # the next save clears the stale .old and .tmp and writes best again
    save_checkpoint(run / "best", tiny_model(seed=3)[0], cfg, vocab_files, {"step": 3})
    assert sorted(p.name for p in run.iterdir()) == ["best"]
    assert load_checkpoint(run)[2]["trainer"] == {"step": 3}


def test_optimizer_state_and_extra_tensors_round_trip(tmp_path, vocab_files):
    model, cfg = tiny_model(seed=1)
    optimizer = _trained_optimizer(model)
    rng = torch.get_rng_state()
    save_checkpoint(tmp_path / "ck", model, cfg, vocab_files, {"step": 2}, optimizer,
                    {"cpu_rng": rng})
    stored = load_file(str(tmp_path / "ck/optimizer.safetensors"))
    assert "extra.cpu_rng" in stored and any(k.startswith("state.0.") for k in stored)
    state, extra = load_training_state(tmp_path / "ck")
    assert list(extra) == ["cpu_rng"] and torch.equal(extra["cpu_rng"], rng)
    original = optimizer.state_dict()
    assert state["param_groups"] == json.loads(json.dumps(original["param_groups"]))
    assert sorted(state["state"]) == sorted(original["state"])
    for index, values in original["state"].items():
        assert sorted(state["state"][index]) == sorted(values)
        for key, value in values.items():
            assert torch.equal(state["state"][index][key], value), (index, key)
    fresh = torch.optim.Adam(tiny_model(seed=1)[0].parameters(), lr=5.0)
    fresh.load_state_dict(state)
    assert fresh.param_groups[0]["lr"] == 1e-3 and fresh.param_groups[0]["betas"] == [0.9, 0.98]


def test_optimizer_tensors_split_tensors_from_metadata():
    parameter = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([parameter], lr=0.1, momentum=0.5)
    parameter.grad = torch.full((2,), 2.0)
    optimizer.step()
    optimizer.state[parameter]["count"] = 3  # a non-tensor entry stays in the metadata
    tensors, meta = optimizer_to_tensors(optimizer)
    assert list(tensors) == ["state.0.momentum_buffer"]
    assert meta["state"] == {"0": {"count": 3}}
    state = optimizer_from_tensors({**tensors, "other.x": torch.zeros(1)}, meta)
    assert sorted(state["state"][0]) == ["count", "momentum_buffer"]
    assert state["state"][0]["count"] == 3
    assert torch.equal(state["state"][0]["momentum_buffer"], tensors["state.0.momentum_buffer"])
    assert state["param_groups"] == meta["param_groups"]
    # a key with dots after the index keeps them
    state = optimizer_from_tensors({"state.1.a.b": torch.ones(1)}, {"state": {},
                                                                    "param_groups": []})
    assert list(state["state"][1]) == ["a.b"]


def test_only_extra_tensors_make_an_optimizer_file_without_optimizer_state(tmp_path,
                                                                           vocab_files):
    model, cfg = tiny_model()
    save_checkpoint(tmp_path / "ck", model, cfg, vocab_files, None, None,
                    {"cpu_rng": torch.get_rng_state()})
    assert json.loads((tmp_path / "ck/checkpoint.json").read_text())["optimizer"] is None
    with pytest.raises(CheckpointError, match="no optimizer state"):
        load_training_state(tmp_path / "ck")


def test_training_state_errors(tmp_path, vocab_files):
    model, cfg = tiny_model()
    save_checkpoint(tmp_path / "plain", model, cfg, vocab_files)
    with pytest.raises(CheckpointError, match="no optimizer state; cannot resume"):
        load_training_state(tmp_path / "plain")
    save_checkpoint(tmp_path / "ck", model, cfg, vocab_files, {}, _trained_optimizer(model))
    (tmp_path / "ck/optimizer.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(CheckpointError, match="optimizer.safetensors cannot be loaded"):
        load_training_state(tmp_path / "ck")
    (tmp_path / "ck/optimizer.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no optimizer state"):
        load_training_state(tmp_path / "ck")


def _step_dirs(run, *names):
    for name in names:
        (run / "checkpoints" / name).mkdir(parents=True)
        (run / "checkpoints" / name / "checkpoint.json").write_text("{}")


def test_step_checkpoints_are_complete_step_directories_oldest_first(tmp_path):
    run = tmp_path / "run"
    _step_dirs(run, "step_00000020", "step_00000003", "step_00000100.tmp",
               "step_00000100.old", "step_0000007", "best_00000001")
    (run / "checkpoints" / "step_00000050").mkdir()  # no checkpoint.json: incomplete
    assert [p.name for p in step_checkpoints(run)] == ["step_00000003", "step_00000020"]
    assert step_checkpoints(tmp_path / "nothing") == []


def test_resolve_checkpoint_prefers_best_then_the_newest_step(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(run)
    run.mkdir()
    with pytest.raises(CheckpointError, match=r"holds no ranmt checkpoint \(no checkpoint.json, "
                                               r"best/ or checkpoints/step_\*\)$"):
        resolve_checkpoint(run)
    _step_dirs(run, "step_00000001", "step_00000002", "step_00000003")
    assert resolve_checkpoint(run) == run / "checkpoints/step_00000003"
    (run / "best.old").mkdir()
    (run / "best.old/checkpoint.json").write_text("{}")
    assert resolve_checkpoint(run) == run / "best.old"
    (run / "best").mkdir()
    (run / "best/checkpoint.json").write_text("{}")
    assert resolve_checkpoint(run) == run / "best"
    assert resolve_checkpoint(run / "best") == run / "best"
    assert resolve_checkpoint(run / "best/checkpoint.json") == run / "best"


def test_read_meta_refuses_unreadable_and_other_versions(tmp_path):
    (tmp_path / "checkpoint.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable or corrupted"):
        read_meta(tmp_path)
    (tmp_path / "checkpoint.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(CheckpointError, match="unreadable or corrupted"):
        read_meta(tmp_path)
    for content, shown in (([1], "None"), ({"format_version": 2}, "2"), ({}, "None")):
        (tmp_path / "checkpoint.json").write_text(json.dumps(content))
        with pytest.raises(CheckpointError, match=f"format version {shown}, this ranmt reads "
                                                   f"version {ck.FORMAT_VERSION}"):
            read_meta(tmp_path)
    with pytest.raises(CheckpointError, match="unreadable"):
        read_meta(tmp_path / "missing")


def test_write_meta_replaces_the_file_and_leaves_no_temporary(tmp_path):
    meta = {"format_version": ck.FORMAT_VERSION, "trainer": {"step": 3, "name": "ü"}}
    write_meta(tmp_path, meta)
    assert read_meta(tmp_path) == meta
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.json"]
    assert "\n" in (tmp_path / "checkpoint.json").read_text()  # indented, readable


def test_load_checkpoint_refuses_weights_that_do_not_match_the_config(tmp_path, vocab_files):
    model, cfg = tiny_model()
    out = save_checkpoint(tmp_path / "ck", model, cfg, vocab_files)
    weights = load_file(str(out / "model.safetensors"))
    name = sorted(weights)[0]
    save_file({k: v for k, v in weights.items() if k != name}, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"weights do not match the config .*{name}"):
        load_checkpoint(out)
    dropped = sorted(weights)[:7]  # the message names the first five of each
    save_file({k: v for k, v in weights.items() if k not in dropped},
              str(out / "model.safetensors"))
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(out)
    assert f"missing {dropped[:5]}, unexpected []" in str(error.value)
    save_file({**weights, "extra.weight": torch.ones(1)}, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match="unexpected \\['extra.weight'\\]"):
        load_checkpoint(out)
    (out / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="model.safetensors cannot be loaded"):
        load_checkpoint(out)


def test_average_is_the_exact_mean_of_the_newest_steps(tmp_path, vocab_files):
    run = tmp_path / "run"
    models = []
    for seed, step in ((1, 5), (2, 10), (3, 15)):
        model, cfg = tiny_model(seed=seed)
        models.append(model)
        for side in ("src", "tgt"):  # each step its own vocabulary files: the newest's are kept
            vocab_files[side].write_bytes(f"spm {side} {step}".encode())
        save_checkpoint(run / "checkpoints" / f"step_{step:08d}", model, cfg, vocab_files,
                        {"step": step, "note": "kept"})
    with pytest.raises(CheckpointError, match="^--last must be >= 1$"):
        average_checkpoints(run, 0, tmp_path / "avg0")
    with pytest.raises(CheckpointError, match="^run .*typo does not exist$"):
        average_checkpoints(tmp_path / "typo", 2, tmp_path / "avg_typo")
    single, _, _, _ = load_checkpoint(average_checkpoints(run, 1, tmp_path / "avg1"))
    for name, tensor in single.state_dict().items():
        assert torch.equal(tensor, models[2].state_dict()[name]), name
    with pytest.raises(CheckpointError, match="holds 3 step checkpoint\\(s\\), fewer than "
                                               "--last 4"):
        average_checkpoints(run, 4, tmp_path / "avg4")
    out = average_checkpoints(run, 2, tmp_path / "avg")
    averaged, _, meta, _ = load_checkpoint(out)
    assert meta["trainer"] == {"step": 15, "note": "kept",
                               "averaged": ["step_00000010", "step_00000015"]}
    assert (out / "spm.src.model").read_bytes() == b"spm src 15"
    assert (out / "spm.tgt.model").read_bytes() == b"spm tgt 15"
    for name, tensor in averaged.state_dict().items():
        expected = ((models[1].state_dict()[name].double() + models[2].state_dict()[name].double())
                    / 2).to(tensor.dtype)
        assert torch.equal(tensor, expected), name
    whole = average_checkpoints(run, 3, tmp_path / "avg3")
    averaged3, _, _, _ = load_checkpoint(whole)
    name = next(iter(averaged3.state_dict()))
    expected = sum(m.state_dict()[name].double() for m in models) / 3
    assert torch.equal(averaged3.state_dict()[name], expected.float())
    # a checkpoint.json without trainer state (written by hand or another tool) averages too
    newest = run / "checkpoints/step_00000015"
    write_meta(newest, {k: v for k, v in read_meta(newest).items() if k != "trainer"})
    _, _, meta, _ = load_checkpoint(average_checkpoints(run, 2, tmp_path / "avg_no_trainer"))
    assert meta["trainer"] == {"averaged": ["step_00000010", "step_00000015"]}
