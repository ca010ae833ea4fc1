"""scripts/evaluate.py on a tiny run: it reproduces the run's own final evaluation exactly,
applies Hydra overrides over the checkpoint's config, renders jsonl prompts as the eval
prompts are rendered, and refuses bad input clearly."""

import importlib.util
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import get_method
from omegaconf import OmegaConf

from tests.helpers import TIMING

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
        [str(run_dir), "decode.k=2", "decode.temperatures=[0]", "decode.num_prompts=2",
         "decode.max_new_tokens=6"]
    )  # fmt: skip
    assert result["step"] == 8
    assert result["k"] == 2 and result["num_prompts"] == 2
    assert len(result["greedy/alpha"]) == 2 and result["greedy/max_new_tokens"] == 6
    assert "T0.7/tau" not in result


def test_compile_overrides_add_the_compiled_path(run_dir):
    """decode.compile=true decodes through the compiled path and the eager one beside it
    (docs/fastpath.md): the same tokens in fp32, the speedup against the fastest AR; a bad
    compile_mode is refused at start-up."""
    args = [str(run_dir), "decode.temperatures=[0]", "decode.num_prompts=2",
            "decode.max_new_tokens=6", "decode.dtype=fp32", "decode.compile=true",
            "decode.compile_mode=aot_eager"]  # fmt: skip
    result = ev.main(args)
    assert result["greedy/tau_eager_spec"] == result["greedy/tau"]
    assert result["decode_path"] == "compiled" and result["greedy/greedy_match_rate"] == 1.0
    assert result["compiled_graphs"] > 0 and result["compile_s"] > 0
    assert result["speedup_best_ar"] == result["greedy/speedup_best_ar"]
    with pytest.raises(ValueError, match="decode.compile_mode"):
        ev.main([*args[:-1], "decode.compile_mode=fastest"])
    eager = ev.main(args[:-2])  # without decode.compile: eager only, no fastest-AR ratio
    assert eager["decode_path"] == "eager" and "speedup_best_ar" not in eager


def test_jsonl_prompts_are_rendered_like_the_eval_prompts(run_dir, tmp_path):
    """The run's decoded eval prompts (decode.num_prompts of them, spread over the eval
    split), given as a jsonl of their user text, decode exactly as the run's own evaluation
    of them did: same chat template, same generation prompt."""
    from models.target_loaders import build_tiny_random
    from train.data.prepare import prepare_data
    from train.data.prompt_file import load_prompt_file, spread

    cfg = OmegaConf.load(run_dir / "config.yaml")
    assert cfg.target._target_ == "models.target_loaders.build_tiny_random" and cfg.target.seed == 0
    data = OmegaConf.to_container(cfg.data, resolve=True)
    prepared = prepare_data(build_tiny_random(seed=0, device="cpu"), **data)
    decoded = spread(prepared.eval_prompts, cfg.decode.num_prompts)  # those the run decoded
    assert len(prepared.eval_prompts) > len(decoded) == 3
    users = [p["messages"] for p in decoded]
    assert all(len(m) == 1 and m[0]["role"] == "user" for m in users)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": m[0]["content"]}) + "\n" for m in users))

    rendered = load_prompt_file(prompts, build_tiny_random(seed=0, device="cpu").tokenizer, None)
    assert [p["input_ids"] for p in rendered] == [p["input_ids"] for p in decoded]

    final = json.loads((run_dir / "summary.json").read_text())["final_eval"]
    from_file = ev.main([str(run_dir), "--prompts", str(prompts)])
    assert from_file["num_prompts"] == 3
    assert deterministic(from_file) == deterministic(final)

    # A target that moved: the same weights from a save_pretrained directory.
    moved = tmp_path / "moved_target"
    target = build_tiny_random(seed=0, device="cpu")
    target.model.save_pretrained(moved)
    target.tokenizer.save_pretrained(moved)
    elsewhere = ev.main([str(run_dir), "--prompts", str(prompts), "target=hf",
                         f"target.path={moved}"])  # fmt: skip
    assert deterministic(elsewhere) == deterministic(final)
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        ev.main([str(run_dir), "--prompts", str(prompts), "target=hf", f"target.path={tmp_path}"])


def test_bad_input_says_what_is_wrong(run_dir, tmp_path):
    ckpt = run_dir / "checkpoints" / "step_00000008"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ev.main([str(tmp_path / "nope")])
    with pytest.raises(FileNotFoundError, match="not a draftlab checkpoint"):
        ev.main([str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="CKPT comes first"):
        ev.main(["decode.k=3", str(ckpt)])
    with pytest.raises(ValueError, match=r"k \(draft tokens per round\) must be >= 1"):
        ev.main([str(ckpt), "decode.k=0"])
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        ev.main([str(ckpt), "decode.temperatures=[0,-0.5]"])
    with pytest.raises(ValueError, match=r"decode=bushy: there is no conf/decode/bushy.yaml"):
        ev.main([str(ckpt), "decode=bushy"])
    with pytest.raises(FileNotFoundError, match="--prompts"):
        ev.main([str(ckpt), "--prompts", str(tmp_path / "missing.jsonl")])
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "def add(a, b):"}\n')
    # The tree applied, and refused before the target loads (train.run.settings.check_draft_decode).
    with pytest.raises(ValueError, match=r"draft=draft_lm cannot draft .*trees \(DraftLMDrafter\)"):
        ev.main([str(ckpt), "decode=tree_static", "--prompts", str(good)])
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
    loaded = ev.checkpoint_config(tmp_path)
    assert loaded.target._target_ == "models.target_loaders.build_tiny_random"
    assert callable(get_method(loaded.target._target_))


def test_the_checkpoints_own_config_comes_first(run_dir, tmp_path):
    """CKPT/config.yaml, else <run_dir>/config.yaml two levels up, else a clear refusal."""
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000008"
    shutil.copytree(run_dir / "checkpoints" / "step_00000008", ckpt)
    (ckpt / "config.yaml").unlink(missing_ok=True)
    with pytest.raises(FileNotFoundError, match="no config.yaml in .*step_00000008 nor in its run"):
        ev.checkpoint_config(ckpt)
    cfg = OmegaConf.load(run_dir / "config.yaml")
    (tmp_path / "run" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    assert ev.checkpoint_config(ckpt).decode.k == 3
    cfg.decode.k = 7
    (ckpt / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    assert ev.checkpoint_config(ckpt).decode.k == 7
    assert ev.find_checkpoint(tmp_path / "run") == ckpt  # a run directory: its newest


def test_overrides_follow_hydras_grammar(run_dir):
    """Over a loaded config: KEY=VALUE changes an existing key, +KEY adds a new one, ++KEY
    either, ~KEY deletes; GROUP=NAME replaces the node with conf/GROUP/NAME.yaml as composed,
    before the keys wherever it stands (as Hydra composes); every misuse is refused with the fix."""
    cfg = lambda: OmegaConf.load(run_dir / "config.yaml")  # noqa: E731
    got = ev.apply_overrides(
        cfg(), ["decode.k=5", "decode.temperatures=[0,1.0]", "+decode.extra=1",
                "++decode.k=6", "~decode.seed", "decode.top_p=0.9"]
    )  # fmt: skip
    assert (got.decode.k, list(got.decode.temperatures), got.decode.extra) == (6, [0, 1.0], 1)
    assert "seed" not in got.decode and got.decode.top_p == 0.9
    tree = ev.apply_overrides(cfg(), ["decode.num_prompts=3", "decode=tree_dynamic"])
    assert tree.decode.tree.kind == "dynamic" and tree.decode.num_prompts == 3
    assert tree.decode.k == 4 and tree.decode.max_new_tokens == 128  # the group's own values
    moved = ev.apply_overrides(cfg(), ["device=cpu", "target=hf", "target.path=/models/x"])
    assert OmegaConf.to_container(moved.target, resolve=True) == {
        "_target_": "models.target_loaders.load_hf_target", "path": "/models/x",
        "dtype": "auto", "device": "cpu"}  # fmt: skip
    refusals = {
        "decode.kk=3": "the config has no decode.kk .* write \\+decode.kk=3 to add it",
        "+decode.k=3": "decode.k is already set",
        "~decode.nope": "no decode.nope to delete",
        "~decode.k=9": "decode.k is 3, not 9",
        "decode.k=2,3": "no sweeps",
        "decode=bushy": "no conf/decode/bushy.yaml; conf/decode has \\['chain'",
        "+experiment=debug": "a recipe over the whole config",
        "~target": "cannot lose its target",
        "/tmp/x": "an override is KEY=VALUE",
    }
    for override, match in refusals.items():
        with pytest.raises(ValueError, match=match):
            ev.apply_overrides(cfg(), [override])


def test_the_runs_stored_eval_prompts_need_no_data_preparation(run_dir, tmp_path, monkeypatch,
                                                               capsys):  # fmt: skip
    """A run stores its eval prompts beside its config (eval_prompts.json) and evaluate.py
    decodes them without preparing the data; it prepares the data, with a one-line notice, for
    a run without the file or data.* settings that choose other prompts."""
    from models.target_loaders import build_tiny_random
    from train.data.prepare import prepare_data

    data = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml").data, resolve=True)
    prepared = prepare_data(build_tiny_random(seed=0, device="cpu"), **data)
    stored = json.loads((run_dir / "eval_prompts.json").read_text())["prompts"]
    assert stored == json.loads(json.dumps(prepared.eval_prompts)) and len(stored) >= 2

    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return prepare_data(*args, **kwargs)

    monkeypatch.setattr(ev, "prepare_data", counted)
    quick = ["decode.temperatures=[0]", "decode.num_prompts=2", "decode.max_new_tokens=6"]
    from_file = ev.main([str(run_dir), *quick, "data.regen_concurrency=3"])  # not a choosing key
    assert not calls and "prompts from " + str(run_dir / "eval_prompts.json") in capsys.readouterr().err  # fmt: skip

    old = tmp_path / "old_run"  # a run from before runs stored their eval prompts
    shutil.copytree(run_dir, old, ignore=shutil.ignore_patterns("eval_prompts.json"))
    assert deterministic(ev.main([str(old), *quick])) == deterministic(from_file)
    assert len(calls) == 1
    assert "(a run from before runs stored their eval prompts): rebuilding the eval prompts" in capsys.readouterr().err  # fmt: skip
    ev.main([str(run_dir), *quick, "data.num_eval=3"])  # other prompts: prepared again
    assert len(calls) == 2 and "data.num_eval not as the run had them" in capsys.readouterr().err


def test_third_party_output_goes_to_the_runs_log(run_dir, monkeypatch, capsys):
    """Inductor's autotuning tables and other packages' warnings printed while evaluate.py
    decodes land in <run_dir>/third_party.log, not on the console (as in training)."""
    import warnings

    from torch._inductor import select_algorithm

    cls = select_algorithm.AlgorithmSelectorCache
    monkeypatch.setattr(cls, "log_results", staticmethod(
        lambda name, *a, **k: sys.stderr.write(f"AUTOTUNE {name}(4x4)\n")))  # fmt: skip
    real = ev.evaluate_checkpoint

    def noisy(*args, **kwargs):
        cls.log_results("mm", [], {}, 0.1, 0.1)
        warnings.warn_explicit("a library's notice", FutureWarning, "/v/site-packages/lib.py", 1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ev, "evaluate_checkpoint", noisy)
    log = run_dir / "third_party.log"
    before = log.read_text() if log.is_file() else ""
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        ev.main([str(run_dir), "decode.temperatures=[0]", "decode.num_prompts=1"])
    captured = capsys.readouterr()
    added = log.read_text()[len(before) :]
    assert "AUTOTUNE mm(4x4)" in added and "a library's notice" in added
    assert "AUTOTUNE" not in captured.err + captured.out
    assert "a library's notice" not in captured.err + captured.out
