"""Third-party output goes to the run's third_party.log, not the console
(train/run_files.py: route_third_party_output): inductor's AUTOTUNE tables, which its
select_algorithm writes to stderr, and Python warnings; the console says once where."""

import sys
import warnings

import pytest

from train.run_files import THIRD_PARTY_LOG, route_third_party_output

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
