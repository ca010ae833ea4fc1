"""Every experiment composes; every `_target_` resolves; unknown experiments fail helpfully."""

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_method
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="train", overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # as @hydra.main does: run_dir reads ${hydra:job...}
    return cfg


def _targets(node, path=""):
    if OmegaConf.is_dict(node):
        for key, value in node.items():
            if key == "_target_":
                yield path, value
            else:
                yield from _targets(value, f"{path}.{key}")


def test_experiment_is_not_a_default():
    raw = OmegaConf.load(CONF / "train.yaml")
    assert not any("experiment" in str(d) for d in raw.defaults)


def test_there_are_experiments():
    assert len(EXPERIMENTS) >= 4, EXPERIMENTS


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_and_targets_resolve(name):
    text = (CONF / "experiment" / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_"), (
        f"{name}.yaml must start with '# @package _global_'"
    )
    cfg = _compose(f"+experiment={name}")
    assert cfg.name == name, "an experiment names its runs after itself"
    cfg_no_hydra = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    OmegaConf.resolve(cfg_no_hydra)  # every interpolation resolves
    found = dict(_targets(cfg_no_hydra))
    assert ".target" in found and ".draft.model" in found
    for where, target in found.items():
        assert callable(get_method(target)), f"{where}._target_={target} is not importable"


def test_run_dir_does_not_depend_on_time():
    # All ranks of a multi-process run resolve the config independently; they must agree.
    raw = OmegaConf.to_container(OmegaConf.load(CONF / "train.yaml"), resolve=False)
    assert "now:" not in raw["run_dir"] and "now:" not in raw["name"]


def test_unknown_experiment_lists_the_available_ones():
    proc = subprocess.run(
        [sys.executable, "train.py", "+experiment=no_such_thing"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "no_such_thing" in proc.stderr and "Available options" in proc.stderr
    assert EXPERIMENTS[0] in proc.stderr


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_sets_only_known_train_and_decode_keys(name):
    # Hydra accepts new keys silently; a misspelt or retired key would simply do nothing.
    base = OmegaConf.load(CONF / "train.yaml")
    decode_keys = {k for f in (CONF / "decode").glob("*.yaml") for k in OmegaConf.load(f)}
    exp = OmegaConf.load(CONF / "experiment" / f"{name}.yaml")
    assert set(exp.get("train", {}).keys()) <= set(base.train.keys()), name
    assert set(exp.get("decode", {}).keys()) <= decode_keys, name
