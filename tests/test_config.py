"""Every experiment composes; every `_target_` resolves; unknown experiments fail helpfully."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_method
from omegaconf import OmegaConf

import train.run.resolvers  # noqa: F401  (registers ${safe_dirname:}, as train.py does)
from train.losses.divergences import LOSSES, loss_options
from train.run.resolvers import MAX_DIRNAME
from train.run.settings import check_settings
from train.run.setup import instantiate

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
# The experiments and the shared blocks they include (conf/experiment/base/).
EXPERIMENT_FILES = sorted((CONF / "experiment").rglob("*.yaml"))
LOSS_CONFIGS = sorted(p.stem for p in (CONF / "loss").glob("*.yaml"))


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


@pytest.mark.parametrize("path", EXPERIMENT_FILES, ids=lambda p: p.stem)
def test_experiment_sets_only_known_train_and_decode_keys(path):
    # Hydra accepts new keys silently; a misspelt or retired key would simply do nothing.
    assert path.read_text().startswith("# @package _global_"), path
    base = OmegaConf.load(CONF / "train.yaml")
    decode_keys = {k for f in (CONF / "decode").glob("*.yaml") for k in OmegaConf.load(f)}
    exp = OmegaConf.load(path)
    assert set(exp.get("train", {}).keys()) <= set(base.train.keys()), path
    assert set(exp.get("decode", {}).keys()) <= decode_keys, path


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_passes_the_startup_checks(name):
    check_settings(_compose(f"+experiment={name}"))


@pytest.mark.parametrize("name", LOSS_CONFIGS)
def test_every_loss_config_composes_into_an_experiment(name):
    cfg = _compose("+experiment=eagle_tv", f"loss={name}")
    check_settings(cfg)
    assert cfg.loss.name == name and name in LOSSES  # the file names its registered loss
    loss_options(LOSSES[name], cfg.loss)  # every other key is an option of that loss


# The README's own example (a local path) and a hub id: values with '/'.
README_EXAMPLE = (
    "target=hf",
    "target.path=/models/my-llama",
    "data=local",
    "data.source=chats.jsonl",
)
HUB_ID = ("target=hf", "target.path=HuggingFaceTB/SmolLM2-360M-Instruct")


@pytest.mark.parametrize(
    "overrides, flat",
    [
        (
            README_EXAMPLE,
            "data.source=chats.jsonl,data=local,target.path=_models_my-llama,target=hf",
        ),
        (HUB_ID, "target.path=HuggingFaceTB_SmolLM2-360M-Instruct,target=hf"),
    ],
)
def test_run_dir_is_flat_when_override_values_hold_slashes(overrides, flat):
    cfg = _compose(*overrides)
    want = ("runs", "draft_lm_kl", flat, "seed0")
    assert Path(cfg.run_dir).parts == want
    # Hydra creates no directory at launch (a refused start leaves none): the run creates
    # run_dir and writes .hydra/ there once its checks pass (train/run/files.py).
    assert (cfg.hydra.run.dir, cfg.hydra.sweep.subdir, cfg.hydra.output_subdir) == (".", ".", None)


def test_train_py_resolves_the_same_flat_run_dir():
    # train.py registers the resolver itself (every accelerate/torchrun rank runs it).
    proc = subprocess.run(
        [sys.executable, "train.py", *README_EXAMPLE, "seed=3", "--cfg", "job", "--resolve"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    flat = "data.source=chats.jsonl,data=local,target.path=_models_my-llama,target=hf"
    assert f"run_dir: runs/draft_lm_kl/{flat}/seed3\n" in proc.stdout


def test_long_run_dir_names_are_cut_with_a_hash():
    long_a = [f"optim.betas=[0.9,0.9{'9' * 60}]", f"data.source=/data/{'x' * 80}a.jsonl"]
    long_b = [f"optim.betas=[0.9,0.9{'9' * 60}]", f"data.source=/data/{'x' * 80}b.jsonl"]
    names = []
    for overrides in (long_a, long_b, long_a):
        parts = Path(_compose(*overrides).run_dir).parts
        assert len(parts) == 4 and parts[-1] == "seed0"
        names.append(parts[2])
    assert all(len(n) == MAX_DIRNAME for n in names)
    assert names[0].startswith("data.source=_data_xxx")
    assert names[0] != names[1], "overrides that differ only past the cut still differ"
    assert names[0] == names[2], "the same overrides always give the same name (every rank)"


MAX_COMMENT_BLOCK = 3  # recipes say what (and briefly why); measurements live in docs/results.md


def _comment_blocks(lines):
    """(first line number, length) of every comment block.

    A block is a maximal run of whole-line comments, plus the line before it when that line
    has a trailing comment whose '#' sits at the run's column (a continued inline comment).
    A first line `# @package _global_` belongs to no block.
    """
    start = 1 if lines and lines[0].strip() == "# @package _global_" else 0
    i = start
    while i < len(lines):
        if not lines[i].lstrip().startswith("#"):
            i += 1
            continue
        first = i
        while i < len(lines) and lines[i].lstrip().startswith("#"):
            i += 1
        length = i - first
        column = len(lines[first]) - len(lines[first].lstrip())
        trailing = re.search(r"\s#", lines[first - 1]) if first > start else None
        if trailing and trailing.start() + 1 == column:
            yield first, length + 1  # 1-based number of the value line
        else:
            yield first + 1, length


def test_no_yaml_comment_block_is_longer_than_three_lines():
    # A config comment says what a value is and, in two lines at most, why (pointing at the
    # docs/results.md row that measured it); tables, dated figures and history belong in docs.
    long_blocks = [
        f"{path.relative_to(ROOT)}:{line} ({length} lines)"
        for path in sorted(CONF.rglob("*.yaml"))
        for line, length in _comment_blocks(path.read_text().splitlines())
        if length > MAX_COMMENT_BLOCK
    ]
    assert not long_blocks, (
        f"{len(long_blocks)} comment blocks longer than {MAX_COMMENT_BLOCK} lines "
        "(move figures and history to docs/results.md):\n" + "\n".join(long_blocks)
    )


def test_a_builder_gets_plain_values_not_the_config():
    """The run's instantiate (train/run/setup.py) hands a `_target_` builder (a target loader,
    a draft's from_target) plain lists and dicts: models/ never sees a DictConfig."""
    node = OmegaConf.create({"_target_": "builtins.dict", "layers": [2, 5], "rope": {"theta": 1}})
    built = instantiate(node, extra=3)
    assert built == {"layers": [2, 5], "rope": {"theta": 1}, "extra": 3}
    assert type(built["layers"]) is list and type(built["rope"]) is dict
