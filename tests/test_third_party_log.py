"""The console: third-party output goes to the run's third_party.log, not the console
(train/run/files.py: route_third_party_output): inductor's AUTOTUNE tables, which its
select_algorithm writes to stderr, and Python warnings; the console says once where. W&B's
end-of-run tables stay off it; training and evaluation end with one stage line."""

import sys
import warnings

import pytest

from train.run.files import THIRD_PARTY_LOG, route_third_party_output

select_algorithm = pytest.importorskip("torch._inductor.select_algorithm")


def test_autotune_tables_and_warnings_go_to_the_log(tmp_path, monkeypatch, capsys):
    def fake_log_results(name, *args, **kwargs):  # what inductor does with its timings
        sys.stderr.write(f"AUTOTUNE {name}(4x4, 4x4)\n  cpp_mm 0.01 ms 100.0%\n")

    cls = select_algorithm.AlgorithmSelectorCache
    monkeypatch.setattr(cls, "log_results", staticmethod(fake_log_results))

    def console(message, category, filename, lineno, file=None, line=None):  # Python's own
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = console  # (pytest records warnings instead of showing them)
        path = route_third_party_output(tmp_path)
        cls.log_results("mm", [], {}, 0.1, 0.1)
        warnings.warn_explicit(
            "`is_gradient_checkpointing` is deprecated",
            FutureWarning,
            "/venv/site-packages/transformers/modeling_utils.py",
            3312,
        )
        warnings.warn("a damaged feature cache", UserWarning, stacklevel=1)  # ours: shown
        cls.log_results("addmm", [], {}, 0.1, 0.1)
        captured = capsys.readouterr()
    assert path == tmp_path / THIRD_PARTY_LOG
    text = path.read_text()
    assert "AUTOTUNE mm(4x4, 4x4)" in text and "AUTOTUNE addmm" in text
    assert "FutureWarning: `is_gradient_checkpointing` is deprecated" in text
    assert "AUTOTUNE" not in captured.err and "is_gradient_checkpointing" not in captured.err
    assert "a damaged feature cache" in captured.err and "damaged" not in text
    assert captured.out.count(f"third-party output (autotuning tables, warnings): {path}") == 1
    # A second run in this process writes into its own directory.
    other = tmp_path / "other"
    other.mkdir()
    with warnings.catch_warnings():
        route_third_party_output(other)
        cls.log_results("bmm", [], {}, 0.1, 0.1)
    assert "AUTOTUNE bmm" in (other / THIRD_PARTY_LOG).read_text()
    assert "AUTOTUNE bmm" not in text and "AUTOTUNE bmm" not in path.read_text()


def test_a_wandb_run_keeps_its_history_tables_off_the_console(tmp_path, monkeypatch, capfd):
    """W&B (offline here) prints its run-history and run-summary tables, ~30 lines, at the
    end of a run unless quiet (train/report/tracking.py): with it, the console keeps only
    where the run is saved."""
    from accelerate import Accelerator

    from tests.helpers import compose_debug
    from train.report.tracking import finish_tracking, init_tracking, tracker
    from train.run.settings import tracking_settings

    monkeypatch.setenv("WANDB_MODE", "offline")
    tracking = tracking_settings(compose_debug(tmp_path, "logger=wandb"))
    accelerator = Accelerator(cpu=True, log_with=tracker(tracking))
    init_tracking(accelerator, tracking, tmp_path)
    accelerator.log({"loss": 1.0}, step=1)
    finish_tracking(accelerator, tracking, {"final_eval": {"tau": 2.0, "speedup": 1.5}})
    accelerator.end_training()
    console = capfd.readouterr()
    text = console.out + console.err
    assert "Run history" not in text and "Run summary" not in text, text
    assert str(tmp_path / "wandb") in text  # where the run is saved: still said


def test_the_stage_line_of_training_and_evaluation():
    from train.run.records import stage_line

    summary = {"steps": 358, "train_s": 840.59, "wall_s": 1515.03}
    line = stage_line(summary, {"eval_s": 629.2}, {"heldout/sim_tau_greedy": 1.55059})
    assert line == (
        "[draftlab] training: 358 steps in 841 s (held-out proxy sim τ 1.551 greedy); "
        "evaluation 629 s; 1515 s from the first step to the end"
    )
    assert stage_line(summary | {"wall_s": None}, {}, None) == (
        "[draftlab] training: 358 steps in 841 s"
    )
    compiled = {"eval_s": 660.4, "compile_s": 156.6, "compiled_graphs": 6}
    assert stage_line(summary, compiled, None) == (
        "[draftlab] training: 358 steps in 841 s; evaluation 660 s (compiling 157 s, 6 graphs); "
        "1515 s from the first step to the end"
    )
    # a checkpoint whose graphs were compiled by an earlier one: nothing to say
    assert "compiling" not in stage_line(summary, compiled | {"compiled_graphs": 0}, None)
