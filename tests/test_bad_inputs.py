"""Bad input is refused before any work, with one message that says what to change, and
nothing is left half-written (docs/bad_inputs.md lists each case and its message): a k the
draft cannot draft, unusable data sources, prompts beyond the target's context window, a
second run into a run directory, a refused start's run directory, Ctrl-C in regeneration or
in a checkpoint write, torch or transformers below the version floors."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import train.data.prepare
import train.loop
from decoding.spec import generate
from models.versions import check_versions
from tests.helpers import ROOT, compose_debug, openai_row, sharegpt_row, write_rows
from train.core.checkpoint import checkpoint_damage, list_checkpoints, save_checkpoint
from train.data import answer_batch
from train.data.prepare import prepare_data
from train.data.regenerate import regenerate
from train.disk import write_atomic
from train.run.settings import check_settings


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_script", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ev, export_script, compare_script, regenerate_script = map(
    load_script, ("evaluate", "export", "compare", "regenerate")
)


def no_loading(*args, **kwargs):
    raise AssertionError("a model was loaded before the input was checked")


# -- decode.k beyond what one round of the draft drafts ---------------------------------


def dflash_checkpoint(tmp_path: Path) -> Path:
    """A checkpoint directory of a block-8 DFlash run as scripts/evaluate.py finds it (its
    weights are never read: the refusal comes first)."""
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    cfg = compose_debug(tmp_path / "run", "draft=dflash", "decode.k=7")
    (ckpt / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    (ckpt / "draft.yaml").write_text(OmegaConf.to_yaml(cfg.draft, resolve=True))
    (ckpt / "draft.safetensors").write_bytes(b"")
    return ckpt


def test_evaluate_refuses_a_k_the_block_draft_cannot_draft(tmp_path, monkeypatch):
    # A block-8 DFlash draft drafts 7 tokens per round; k=12 used to draft 7 and report 12.
    monkeypatch.setattr(ev, "load_target", no_loading)
    ckpt = dflash_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"decode.k=12 drafts per round .* at most 7 tokens"):
        ev.main([str(ckpt), "decode.k=12"])
    with pytest.raises(ValueError, match=r"decode.k=12 drafts per round .* at most 7 tokens"):
        ev.main(["--init-from", str(ckpt), "+experiment=debug", "draft=dflash", "decode.k=12"])


def test_a_missing_init_from_is_refused_before_the_target_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(train.loop, "load_target", no_loading)
    monkeypatch.setattr(ev, "load_target", no_loading)
    nope = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=r"draft.init_from=.*nope' is not a directory"):
        train.loop.run(compose_debug(tmp_path / "run", f"draft.init_from={nope}"))
    with pytest.raises(FileNotFoundError, match=r"draft.init_from=.*nope' is not a directory"):
        ev.main(["--init-from", str(nope), "+experiment=debug"])
    assert not (tmp_path / "run").exists()


# -- data sources ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, content, error, message",
    [
        ("empty.jsonl", "", ValueError, r"empty\.jsonl' is empty"),
        ("blank.jsonl", "\n  \n", ValueError, r"blank\.jsonl' is empty"),
        ("chats.txt", "hello\n", ValueError, r"unsupported file type '\.txt'"),
        ("missing.jsonl", None, FileNotFoundError, r"missing\.jsonl' does not exist"),
    ],
)
def test_unusable_source_is_refused_before_the_target_loads(
    tmp_path, monkeypatch, name, content, error, message
):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    monkeypatch.setattr(train.loop, "load_target", no_loading)
    run_dir = tmp_path / "run"
    cfg = compose_debug(run_dir, "data=local", f"data.source={path}")
    with pytest.raises(error, match=message):
        train.loop.run(cfg)
    assert not run_dir.exists()


def test_unset_values_are_refused_by_name(tmp_path):
    # data=local without data.source used to train on the embedded corpus (??? does not
    # replace a value in Hydra's merge).
    with pytest.raises(ValueError, match=r"data.source is not set; data=local needs data.source="):
        check_settings(compose_debug(tmp_path, "data=local"))
    with pytest.raises(ValueError, match=r"target.path must be set"):
        check_settings(compose_debug(tmp_path, "target=hf"))


@pytest.mark.parametrize(
    "setting, message",
    [
        ("data.bad_rows=ignore", r"data.bad_rows='ignore': use skip or refuse"),
        ("data.regenerate_turns=first", r"data.regenerate_turns='first': use last or all"),
        ("data.num_proc=0", r"data.num_proc=0: a number of processes >= 1, or null"),
    ],
)
def test_data_reading_settings_are_refused_before_the_target_loads(tmp_path, setting, message):
    with pytest.raises(ValueError, match=message):
        check_settings(compose_debug(tmp_path, setting))


def test_sources_without_usable_conversations_fail_clearly(tiny, tmp_path):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"messages": [\nnot json\n')
    with pytest.raises(
        ValueError, match=r"bad\.jsonl' holds no readable conversation .*line 1: not JSON"
    ):
        prepare_data(tiny, source=str(bad_json), regenerate=False, progress=False)
    odd_turns = write_rows(tmp_path / "turns.jsonl", [{"messages": ["hi", "there"]}])
    with pytest.raises(ValueError, match=r"line 1: a turn is not a \{role, content\}"):
        prepare_data(tiny, source=str(odd_turns), regenerate=False, progress=False)
    # One answered row: it becomes the eval prompt, so nothing is left to train on.
    one = write_rows(tmp_path / "one.jsonl", [sharegpt_row(0, "an answer")])
    with pytest.raises(ValueError, match=r"1 held out as eval prompts, data.num_eval=6"):
        prepare_data(tiny, source=str(one), num_eval=6, regenerate=False, progress=False)


# -- the target's context window ---------------------------------------------------------


def test_decoding_refuses_positions_beyond_the_context_window(tiny):
    assert tiny.context_length == 512
    prompt = torch.zeros(1, 500, dtype=torch.long)
    with pytest.raises(ValueError, match=r"500 prompt tokens \+ 13 new tokens = 513 positions"):
        generate(tiny, prompt, None, max_new_tokens=13)
    assert len(generate(tiny, prompt, None, max_new_tokens=12).sequences[0]) >= 1


def test_data_refuses_rows_and_answers_beyond_the_context_window(tiny, tmp_path, monkeypatch):
    path = write_rows(tmp_path / "chats.jsonl", [openai_row(i, "yes") for i in range(4)])
    with pytest.raises(ValueError, match=r"data.max_len=1024 .* \(512 positions"):
        prepare_data(tiny, source=str(path), num_eval=0, max_len=1024, progress=False)
    monkeypatch.setattr(train.data.prepare, "regenerate_responses", no_loading)
    with pytest.raises(ValueError, match=r"regeneration .* \+ 500 new tokens .* set data.max_new"):
        prepare_data(tiny, source=str(path), num_eval=0, max_new_tokens=500, progress=False)


def test_run_refuses_an_evaluation_beyond_the_context_window(tmp_path, monkeypatch):
    monkeypatch.setattr(train.loop, "train_step", no_loading)
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match=r"decode.max_new_tokens after the longest eval prompt"):
        train.loop.run(compose_debug(run_dir, "decode.max_new_tokens=600"))
    assert not run_dir.exists()


# -- run directories -----------------------------------------------------------------------


def test_a_second_run_into_a_run_dir_with_records_is_refused(tmp_path, monkeypatch):
    # A run stopped before its first checkpoint leaves records and no checkpoint: the next
    # run into the same directory used to append its records to them.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record = json.dumps({"kind": "train", "step": 1, "loss": 3.0}) + "\n"
    (run_dir / "metrics.jsonl").write_text(record)
    monkeypatch.setattr(train.loop, "load_target", no_loading)
    with pytest.raises(FileExistsError, match=r"already holds a run's records \(metrics.jsonl\)"):
        train.loop.run(compose_debug(run_dir))
    assert (run_dir / "metrics.jsonl").read_text() == record


def test_a_refused_overwrite_leaves_the_earlier_run_alone(tmp_path):
    run_dir = tmp_path / "run"
    train.loop.run(compose_debug(run_dir, "train.eval_at_ckpt=false"))
    before = (list_checkpoints(run_dir), (run_dir / "metrics.jsonl").read_text())
    with pytest.raises(ValueError, match="decode.max_new_tokens after the longest eval prompt"):
        train.loop.run(compose_debug(run_dir, "overwrite=true", "decode.max_new_tokens=600"))
    assert (list_checkpoints(run_dir), (run_dir / "metrics.jsonl").read_text()) == before


def test_a_refused_start_leaves_no_run_dir(tmp_path):
    # Through train.py: Hydra used to create run_dir/.hydra (and train.log) at launch.
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "+experiment=debug", f"run_dir={run_dir}",
         "data=local", f"data.source={empty}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
    )  # fmt: skip
    assert proc.returncode != 0 and "is empty" in proc.stderr, proc.stderr[-2000:]
    assert not run_dir.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl"]


# -- Ctrl-C: nothing half-written ----------------------------------------------------------


def test_ctrl_c_in_regeneration_keeps_the_finished_answers(tiny_target, tmp_path, monkeypatch):
    prompts = [[1, 2, 3 + i] for i in range(5)]
    kw = {"max_new_tokens": 4, "dtype": "float32", "batch_size": 2, "progress": False}
    whole, _ = regenerate(tiny_target, prompts, cache_dir=tmp_path / "a", **kw)
    real, calls = answer_batch.decode_step, []

    def interrupted(*args, **kwargs):  # 2 slots, 4-token answers: 2 end by step 3
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(answer_batch, "decode_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        regenerate(tiny_target, prompts, cache_dir=tmp_path / "b", **kw)
    monkeypatch.setattr(answer_batch, "decode_step", real)
    again, stats = regenerate(tiny_target, prompts, cache_dir=tmp_path / "b", **kw)
    # The answers that ended before the interrupt were kept (2 or 3: an answer may end early
    # at an EOS), the rest answered now.
    assert 2 <= stats["cached"] < 5 and stats["cached"] + stats["generated"] == 5
    assert again == whole
    settings = Path(stats["cache"]).parent / "settings.json"
    assert json.loads(settings.read_text())["max_new_tokens"] == 4
    assert [p.name for p in settings.parent.iterdir() if p.name.startswith(".tmp")] == []


def checkpoint(run_dir: Path, step: int, keep_last: int = 0) -> Path:
    state = {"step": step, "rng": [], "world_size": 1}
    return save_checkpoint(run_dir, step, {"w": torch.full((2,), float(step))}, "kind: x\n",
                           state, keep_last)  # fmt: skip


def test_ctrl_c_in_a_checkpoint_write_leaves_whole_checkpoints(tmp_path, monkeypatch):
    checkpoint(tmp_path, 1)
    real_save = torch.save

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoint(tmp_path, 2)
    monkeypatch.setattr(torch, "save", real_save)
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step_00000001"]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000001"]

    # Re-saving a step swaps two directories: Ctrl-C between the renames keeps the old one.
    real_rename, calls = os.rename, []

    def rename_then_interrupt(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        checkpoint(tmp_path, 1)
    monkeypatch.setattr(os, "rename", real_rename)
    assert [checkpoint_damage(c) for c in list_checkpoints(tmp_path)] == [None]

    # Pruning to keep_last cut short: no step_* directory with files missing.
    checkpoint(tmp_path, 2)
    real_rmtree = shutil.rmtree

    def rmtree_one_file_then_interrupt(path, *args, **kwargs):
        if "step_00000001" not in Path(path).name or not Path(path).exists():
            return real_rmtree(path, *args, **kwargs)
        next(Path(path).iterdir()).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", rmtree_one_file_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        checkpoint(tmp_path, 3, keep_last=1)
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    for ckpt in list_checkpoints(tmp_path):
        assert checkpoint_damage(ckpt) is None, ckpt


def test_write_atomic_keeps_the_old_file_on_ctrl_c(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    write_atomic(path, "old")

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]


# -- torch / transformers below the floors (models/versions.py) --------------------------


@pytest.mark.parametrize(
    "torch_version, transformers_version, named",
    [
        ("2.6.0+cu124", "5.24.0", ["torch >= 2.7 (found 2.6.0+cu124"]),
        ("2.7.1", "5.23.0", ["transformers >= 5.24 (found 5.23.0"]),
        ("2.5.1", "5.0.0", ["torch >= 2.7 (found 2.5.1", "transformers >= 5.24 (found 5.0.0"]),
    ],
)
def test_versions_below_the_floors_are_refused(torch_version, transformers_version, named):
    with pytest.raises(ImportError) as err:
        check_versions(torch_version, transformers_version)
    message = str(err.value)
    assert all(n in message for n in named), message
    assert "pip install 'torch>=2.7' 'transformers>=5.24,<6'" in message


@pytest.mark.parametrize("versions", [("2.7.0", "5.24.0"), ("2.13.0+cpu", "5.24.0"),
                                      ("2.8.0a0+git1234", "5.30.0.dev0")])  # fmt: skip
def test_versions_at_or_above_the_floors_pass(versions):
    check_versions(*versions)


def test_the_check_runs_when_models_is_imported():
    # A fresh interpreter with torch claiming 2.6: `import models.target` refuses, naming it.
    code = "import torch; torch.__version__ = '2.6.0'; import models.target"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "ImportError: draftlab needs torch >= 2.7 (found 2.6.0" in proc.stderr, proc.stderr


# -- the scripts' own arguments (docs/bad_inputs.md, Scripts) ------------------------------


def test_script_outputs_in_the_way_are_refused_before_any_work(tmp_path, monkeypatch):
    # A non-empty --out used to be found only after the target and draft loaded (export), a
    # file in the report's place after every run was read (compare), and evaluate.py's --out
    # after the whole decoding; compare and export ended in a raw FileExistsError traceback.
    monkeypatch.setattr(export_script, "load_run_draft", no_loading)
    monkeypatch.setattr(compare_script, "find_runs", no_loading)
    monkeypatch.setattr(ev, "find_checkpoint", no_loading)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    file = tmp_path / "full" / "f"
    export = [str(tmp_path / "ckpt"), "--format", "hf", "--out"]
    with pytest.raises(FileExistsError, match=r"full exists and is not empty; pass --overwrite"):
        export_script.main([*export, str(tmp_path / "full")])
    with pytest.raises(FileExistsError, match=r"full/f is a file, not a directory"):
        export_script.main([*export, str(file / "draft")])
    with pytest.raises(ValueError, match=r"--out .*full/f is a file; give a directory"):
        compare_script.main([str(tmp_path), "--out", str(file)])
    with pytest.raises(ValueError, match=r"--out .*full is a directory; give a file path"):
        ev.main([str(tmp_path / "ckpt"), "--out", str(tmp_path / "full")])
    with pytest.raises(ValueError, match=r"full/f is a file, not a directory"):
        ev.main([str(tmp_path / "ckpt"), "--out", str(file / "ev.json")])
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["ckpt", "f", "full"]


def test_compare_names_a_damaged_run_file(tmp_path):
    # A cut summary.json used to end in json's bare "Expecting value: line 1 column 1".
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("name: x\n")
    (run / "summary.json").write_text('{"final": ')
    with pytest.raises(ValueError, match=r"run/summary.json is damaged, not JSON"):
        compare_script.main([str(run), "--out", str(tmp_path / "report")])
    assert not (tmp_path / "report").exists()


def test_regenerate_refuses_an_unknown_group_or_target_path_in_one_line(tmp_path):
    # Hydra's message for target=nope listed its whole search path; a missing target.path
    # ended in Hydra's InstantiationException traceback around the loader's own message.
    with pytest.raises(ValueError, match=r"target=nope: there is no conf/target/nope.yaml; "
                                         r"conf/target has \[.*'tiny_random'"):  # fmt: skip
        regenerate_script.main(["target=nope", "data=tiny"])
    with pytest.raises(FileNotFoundError, match=r"target.path='.*nope' does not exist"):
        regenerate_script.main(["target=hf", f"target.path={tmp_path / 'nope'}", "data=tiny"])


def test_a_setting_the_draft_builder_does_not_take_is_named(tmp_path):
    """+experiment=debug sets draft_lm's keys; with another kind they were a raw TypeError."""
    with pytest.raises(ValueError, match=r"takes no setting 'num_layers'.*~draft.model.num_layers"):
        train.loop.run(compose_debug(tmp_path / "run", "draft=eagle"))
    assert not (tmp_path / "run").exists()
