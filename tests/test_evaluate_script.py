"""scripts/evaluate.py on a tiny run: it reproduces the run's own final evaluation exactly,
renders jsonl prompts as the eval prompts are rendered, and refuses bad input clearly."""

import argparse
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import get_method
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("evaluate_script", ROOT / "scripts" / "evaluate.py")
ev = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ev)

# Decoding settings of the tiny run (and so of its final evaluation).
DECODE = [
    "decode.temperatures=[0.0,0.7]",
    "decode.num_prompts=3",
    "decode.max_new_tokens=16",
    "decode.k=3",
    "decode.seed=5",
]
# Wall-clock figures (tokens/s, speedups, per-round ms, time shares) differ between any two
# evaluations; every other metric must not.
TIMING = ("tokens_per_s", "speedup", "_ratio", "_ms", "_share")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Iterator[Path]:
    from train.loop import run

    # One thread: the tiny model's many small ops crawl when threads outnumber free cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    run_dir = tmp_path_factory.mktemp("evaluate") / "run"
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=["+experiment=debug", f"run_dir={run_dir}", "train.steps=8",
                       "train.ckpt_every=8", *DECODE],
        )  # fmt: skip
    torch.manual_seed(0)
    run(cfg)
    yield run_dir
    torch.set_num_threads(threads)


def deterministic(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.endswith(TIMING) and "proxy" not in k}


def test_reproduces_the_runs_final_evaluation(run_dir, tmp_path, capsys):
    final = json.loads((run_dir / "summary.json").read_text())["final_eval"]
    assert final["step"] == 8
    # The draft learned something: equal τ is not the trivial τ = 1 of a useless draft.
    assert final["greedy/tau"] > 1.2 and final["T0.7/tau"] > 1.0

    out = tmp_path / "ev.json"
    result = ev.main([str(run_dir / "checkpoints" / "step_00000008"), "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    # The same keys as the run's evaluation record, less the training proxy's prediction.
    assert set(result) == {k for k in final if "proxy" not in k}
    for tag in ("greedy", "T0.7"):
        assert result[f"{tag}/tau"] == final[f"{tag}/tau"]
        assert result[f"{tag}/alpha"] == final[f"{tag}/alpha"]
        assert result[f"{tag}/accept_hist"] == final[f"{tag}/accept_hist"]
    assert deterministic(result) == deterministic(final)
    assert "| 8 | greedy |" in capsys.readouterr().out


def test_overrides_reach_the_decoder(run_dir):
    # A run directory stands for its newest checkpoint.
    result = ev.main(
        [str(run_dir), "--k", "2", "--temperatures", "0", "--num-prompts", "2",
         "--max-new-tokens", "6"]
    )  # fmt: skip
    assert result["step"] == 8
    assert result["k"] == 2 and result["num_prompts"] == 2
    assert len(result["greedy/alpha"]) == 2 and result["greedy/max_new_tokens"] == 6
    assert "T0.7/tau" not in result


def test_compile_flags_add_the_compiled_path(run_dir):
    """--compile decodes through the compiled path too (docs/fastpath.md): its keys beside the
    eager ones, the same tokens in fp32; a bad --compile-mode is refused at start-up."""
    flags = [str(run_dir), "--temperatures", "0", "--num-prompts", "2", "--max-new-tokens", "6",
             "--dtype", "fp32", "--compile", "--compile-mode", "aot_eager"]  # fmt: skip
    result = ev.main(flags)
    assert result["greedy/compiled_tau"] == result["greedy/tau"]
    assert result["compiled_graphs"] > 0 and result["compile_s"] > 0
    assert result["speedup_compiled"] == result["greedy/compiled_speedup"]
    with pytest.raises(ValueError, match="decode.compile_mode"):
        ev.main([*flags[:-1], "fastest"])
    assert "speedup_compiled" not in ev.main(flags[:-3])  # without --compile: eager only


def test_jsonl_prompts_are_rendered_like_the_eval_prompts(run_dir, tmp_path):
    """The run's eval prompts, given as a jsonl of their user text, decode exactly as the
    run's own evaluation of them did: same chat template, same generation prompt."""
    from models.target_loaders import build_tiny_random
    from train.data.prepare import prepare_data

    cfg = OmegaConf.load(run_dir / "config.yaml")
    assert cfg.target._target_ == "models.target_loaders.build_tiny_random" and cfg.target.seed == 0
    data = OmegaConf.to_container(cfg.data, resolve=True)
    prepared = prepare_data(build_tiny_random(seed=0, device="cpu"), **data)
    users = [p["messages"] for p in prepared.eval_prompts[:3]]
    assert all(len(m) == 1 and m[0]["role"] == "user" for m in users)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": m[0]["content"]}) + "\n" for m in users))

    rendered = ev.load_prompts(prompts, build_tiny_random(seed=0, device="cpu"), None)
    assert [p["input_ids"] for p in rendered] == [p["input_ids"] for p in prepared.eval_prompts[:3]]

    final = json.loads((run_dir / "summary.json").read_text())["final_eval"]
    from_file = ev.main([str(run_dir), "--prompts", str(prompts)])
    assert from_file["num_prompts"] == 3
    assert deterministic(from_file) == deterministic(final)

    # A target that moved: the same weights from a save_pretrained directory.
    moved = tmp_path / "moved_target"
    target = build_tiny_random(seed=0, device="cpu")
    target.model.save_pretrained(moved)
    target.tokenizer.save_pretrained(moved)
    elsewhere = ev.main([str(run_dir), "--prompts", str(prompts), "--target-path", str(moved)])
    assert deterministic(elsewhere) == deterministic(final)
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        ev.main([str(run_dir), "--prompts", str(prompts), "--target-path", str(tmp_path)])


def test_bad_input_says_what_is_wrong(run_dir, tmp_path):
    ckpt = run_dir / "checkpoints" / "step_00000008"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ev.main([str(tmp_path / "nope")])
    with pytest.raises(FileNotFoundError, match="not a draftlab checkpoint"):
        ev.main([str(tmp_path)])
    with pytest.raises(ValueError, match=r"k \(draft tokens per round\) must be >= 1"):
        ev.main([str(ckpt), "--k", "0"])
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        ev.main([str(ckpt), "--temperatures", "0", "-0.5"])
    with pytest.raises(ValueError, match="--tree 'bushy'"):
        ev.main([str(ckpt), "--tree", "bushy"])
    with pytest.raises(FileNotFoundError, match="--prompts"):
        ev.main([str(ckpt), "--prompts", str(tmp_path / "missing.jsonl")])
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "def add(a, b):"}\n')
    with pytest.raises(ValueError, match="DraftLMDrafter cannot draft trees"):  # --tree applied
        ev.main([str(ckpt), "--tree", "static", "--prompts", str(good)])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n\n{"prompt": "also fine"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 4: expected an object with a \"prompt\""):
        ev.main([str(ckpt), "--prompts", str(bad)])
    bad.write_text('{"prompt": "fine"}\n{"prompt": "unterminated\n')
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        ev.main([str(ckpt), "--prompts", str(bad)])


def test_a_run_naming_the_target_loaders_old_place_still_evaluates(run_dir, tmp_path):
    """Run configs written before the loaders moved to models/ name `train.target.*`."""
    cfg = OmegaConf.load(run_dir / "config.yaml")
    cfg.target._target_ = "train.target.build_tiny_random"
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    flags = ("k", "temperatures", "top_p", "top_k", "max_new_tokens", "num_prompts", "seed")
    flags += ("dtype", "compile", "compile_mode", "tree", "target_path", "device")
    loaded = ev.run_config(tmp_path, argparse.Namespace(**dict.fromkeys(flags)))
    assert loaded.target._target_ == "models.target_loaders.build_tiny_random"
    assert callable(get_method(loaded.target._target_))
