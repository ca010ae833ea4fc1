"""The target's weights fingerprint (models/identity.py) and what it keys: the feature and
regeneration caches answer afresh for other weights under the same name; scripts/evaluate.py
refuses a config that differs from what the checkpoint was trained with."""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil

import pytest
import torch

import models.target
import train.core.feature_cache as fc
from models.target import Target
from models.target_loaders import build_tiny_random
from tests.helpers import ROOT, compose_debug
from train.data.regenerate import legacy_key, regenerate
from train.run.identity import hydra_value


def _reweighted(target: Target, scale: float = 1.01) -> Target:
    """The same name, weights re-saved after a change (one layer scaled)."""
    model = copy.deepcopy(target.model)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(scale)
    return Target(model, target.tokenizer, name=target.name)


def test_fingerprint_names_the_weights_not_their_dtype(monkeypatch):
    target = build_tiny_random(seed=0, device="cpu")
    fp = target.fingerprint
    assert len(fp) == 16 and fp == build_tiny_random(seed=0, device="cpu").fingerprint
    assert fp != build_tiny_random(seed=1, device="cpu").fingerprint
    assert _reweighted(target).fingerprint != fp
    half = copy.deepcopy(target).to(dtype=torch.bfloat16)  # the same weights held in bf16
    half._fingerprint = None
    assert half.fingerprint == fp
    calls = []
    monkeypatch.setattr(models.target, "weights_fingerprint", lambda m: calls.append(1) or "x")
    fresh = Target(target.model, target.tokenizer, name=target.name)
    assert (fresh.fingerprint, fresh.fingerprint, calls) == ("x", "x", [1])  # once per target


def test_feature_cache_key_changes_with_the_weights_under_one_name():
    target = build_tiny_random(seed=0, num_layers=4, device="cpu")
    rows = [{"input_ids": list(range(1, 9))}, {"input_ids": list(range(3, 20))}]

    def key(t):
        return fc.cache_key(fc.cache_settings(t, rows, (1, -1)))

    assert key(Target(target.model, target.tokenizer, name=target.name)) == key(target)
    assert key(_reweighted(target)) != key(target)


def test_regeneration_answers_again_for_new_weights_under_one_name(tiny_target, tmp_path):
    prompts = [[1, 5, 9, 14], [2, 6, 10, 3, 7]]
    kw = {"max_new_tokens": 4, "dtype": "float32", "cache_dir": tmp_path, "progress": False}
    _, first = regenerate(tiny_target, prompts, **kw)
    assert regenerate(tiny_target, prompts, **kw)[1]["generated"] == 0
    _, other = regenerate(_reweighted(tiny_target, 3.0), prompts, **kw)
    assert other["generated"] == 2 and other["cache"] != first["cache"]


def test_a_regeneration_cache_from_before_the_fingerprint_is_adopted(tiny_target, tmp_path):
    prompts = [[1, 5, 9, 14]]
    kw = {"max_new_tokens": 4, "dtype": "float32", "cache_dir": tmp_path, "progress": False}
    answers, stats = regenerate(tiny_target, prompts, **kw)
    new_dir = tmp_path / "data" / "regen" / stats["cache"].split("/")[-2]
    settings = json.loads((new_dir / "settings.json").read_text())
    legacy = new_dir.with_name(legacy_key(settings))
    del settings["weights"]
    (new_dir / "settings.json").write_text(json.dumps(settings))
    new_dir.rename(legacy)  # as a cache written before the fingerprint entered the key
    with pytest.warns(UserWarning, match="written before caches were keyed by the target's wei"):
        again, stats = regenerate(tiny_target, prompts, **kw)
    assert stats["generated"] == 0 and again == answers
    assert new_dir.is_dir() and not legacy.exists()


def test_hydra_values_parse_back():
    assert [hydra_value(v) for v in (None, True, 3, 1e-3, [2, 15, 27], "full", "a b")] == [
        "null", "true", "3", "0.001", "[2,15,27]", "full", "'a b'"
    ]  # fmt: skip


@pytest.fixture(scope="module")
def debug_ckpt(tmp_path_factory):
    from train.loop import run

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    run_dir = tmp_path_factory.mktemp("identity_eval") / "run"
    run(compose_debug(run_dir, "train.eval_at_ckpt=false"))
    torch.set_num_threads(threads)
    return run_dir / "checkpoints" / "step_00000002"


def test_evaluate_refuses_draft_overrides_and_other_weights(debug_ckpt, tmp_path):
    spec = importlib.util.spec_from_file_location(
        "evaluate_script", ROOT / "scripts" / "evaluate.py"
    )
    ev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ev)
    with pytest.raises(ValueError) as err:
        ev.main([str(debug_ckpt), "draft.model.num_layers=2", "target.seed=1"])
    msg = str(err.value)
    assert "draft.model.num_layers: checkpoint 1, now 2\n" in msg
    assert "target weights: checkpoint" in msg and "To match the checkpoint: draft.model.num_layers=1" in msg  # fmt: skip
    assert "an override of draft.* would be ignored" in msg
    with pytest.raises(ValueError, match=r"chat template .*\n.*data.chat_template=null"):
        ev.main([str(debug_ckpt), "data.chat_template=plain"])
    # A checkpoint from before identity.json: its draft.yaml still speaks for the draft.
    old = tmp_path / "old" / "checkpoints" / debug_ckpt.name
    shutil.copytree(debug_ckpt.parent.parent, tmp_path / "old")
    (old / "identity.json").unlink()
    with pytest.raises(ValueError, match="draft.model.num_layers: checkpoint 1, now 3"):
        ev.main([str(old), "draft.model.num_layers=3"])
