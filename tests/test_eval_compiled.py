"""The compiled path as evaluation's decode (train/eval/plan.py, train/eval/compiled.py,
train/eval/evaluate.py): `decode.compile=only` decodes the eager AR, the compiled AR and the compiled
speculative decode at every sampling, and nothing else;
`decode.compile=auto` takes the faster of the eager and compiled verify forward on this
machine where compiling pays, from what `only` recorded per machine. Tiny random target,
float32, aot_eager (no code generation), timings faked where a verdict is asserted."""

from __future__ import annotations

import json
import os

import pytest
import torch

import decoding.metrics
import models.dtype_choice
import models.few_rows
import train.eval.compiled
import train.eval.plan
from decoding.compiled import CompiledTarget
from decoding.inductor import counts_recordings
from models import draft_lm
from models.dtype_choice import DtypeChoice
from models.target import Target
from tests.helpers import untied_target
from tests.test_compiled import eval_cfg, prompts
from train.eval.evaluate import evaluate_checkpoint
from train.eval.settings import EvalSettings
from train.run.settings import eval_settings


@pytest.fixture(scope="module")
def target() -> Target:
    return untied_target(device="cpu")


@pytest.fixture(autouse=True)
def fresh_graphs():
    """Dynamo's graphs outlive a test and serve any module of the same code and shapes: drop
    them after each test, so a later test that counts the graphs it compiles counts them.
    The reset also drops dynamo's callbacks, so the recording counter registers again."""
    yield
    torch._dynamo.reset()
    counts_recordings.cache_clear()


def recorded_decodes(monkeypatch) -> list[tuple[str, bool]]:
    """(path, speculative?) of every decode evaluation runs, appended as they run."""
    calls = []
    real_generate = decoding.metrics.generate

    def recording_generate(decode_target, prompt, drafter, **kwargs):
        path = "compiled" if isinstance(decode_target, CompiledTarget) else "eager"
        calls.append((path, drafter is not None))
        return real_generate(decode_target, prompt, drafter, **kwargs)

    monkeypatch.setattr(decoding.metrics, "generate", recording_generate)
    return calls


def eval_prompts() -> list[dict]:
    return [{"input_ids": p[0].tolist()} for p in prompts(2, seed=11)]


def test_compile_only_is_the_evaluation_against_both_ars(target, monkeypatch, tmp_path):
    """decode.compile=only: per prompt the eager AR, the compiled AR and the compiled
    speculative decode, and nothing else (no eager speculative pass); `speedup` is against the
    compiled AR, `speedup_eager_ar` against the eager one, `speedup_best_ar` against the
    faster of the two; `loop_efficiency` is the speedup over the predicted one."""
    calls = recorded_decodes(monkeypatch)
    draft = draft_lm.from_target(target, num_layers=2, init="random")
    settings = auto_settings(tmp_path, "only")
    result, _ = evaluate_checkpoint(target, draft, eval_prompts(), settings, None)
    timed = calls[-6:]  # after the warm-up prompt: 2 prompts x 3 decodes
    assert sorted(set(calls)) == [("compiled", False), ("compiled", True), ("eager", False)]
    assert timed == [("eager", False), ("compiled", False), ("compiled", True)] * 2
    g = {key.removeprefix("greedy/"): v for key, v in result.items() if key.startswith("greedy/")}
    assert result["decode_path"] == "compiled" and g["greedy_match_rate"] == 1.0
    assert g["entropy_alpha"] is not None  # the compiled decode is probed like the eager one
    assert (
        g["speedup"]
        == g["speedup_compiled_ar"]
        == pytest.approx(g["tokens_per_s"] / g["compiled_ar_tokens_per_s"])
    )
    assert g["speedup_eager_ar"] == pytest.approx(g["tokens_per_s"] / g["eager_ar_tokens_per_s"])
    faster = max(g["compiled_ar_tokens_per_s"], g["eager_ar_tokens_per_s"])
    assert g["speedup_best_ar"] == pytest.approx(g["tokens_per_s"] / faster)
    assert g["best_ar"].split()[0] == (
        "compiled" if faster == g["compiled_ar_tokens_per_s"] else "eager"
    )
    assert result["speedup_eager_ar"] == g["speedup_eager_ar"]
    assert result["speedup_best_ar"] == g["speedup_best_ar"]
    assert g["loop_efficiency"] == pytest.approx(g["speedup"] / g["predicted_speedup"])
    assert g["path"] == "compiled" and result["passes"] == ["ar_eager", "ar", "spec"]


def fake_forward_seconds(monkeypatch, eager_s: float, compiled_s: float) -> list[str]:
    """forward_seconds answering fixed times per path; returns the paths it was asked for."""
    asked = []

    def fake(decode_target, width, cached, hidden_layers, repeats=5):
        path = "compiled" if isinstance(decode_target, CompiledTarget) else "eager"
        asked.append(path)
        return compiled_s if path == "compiled" else eager_s

    monkeypatch.setattr(train.eval.compiled, "forward_seconds", fake)
    return asked


def auto_settings(cache_dir, compile="auto", **decode) -> EvalSettings:
    """`eval_cfg`'s settings with verdicts cached in `cache_dir` (data.cache_dir)."""
    cfg = eval_cfg(compile=compile, **decode)
    cfg.data = {"cache_dir": str(cache_dir)}
    return eval_settings(cfg)


def records(cache_dir, use: str) -> list[dict]:
    files = (cache_dir / "dtype").glob("*.json")
    return [r for r in (json.loads(f.read_text()) for f in files) if r["key"]["use"] == use]


@pytest.mark.parametrize("faster", ["compiled", "eager"])
def test_compile_auto_decodes_what_only_recorded(target, monkeypatch, tmp_path, faster):
    """On a CPU that never compiled this decode, auto decodes eagerly and compiles nothing
    ("unmeasured"). decode.compile=only compiles whatever the verdict, times both verify
    forwards and records the verdict and what compiling cost; auto then decodes the faster
    path from the record without measuring (compiled: as `only`; eager: no graphs kept);
    another machine has no record."""
    asked = fake_forward_seconds(monkeypatch, *((0.2, 0.1) if faster == "compiled" else (0.1, 0.2)))
    calls = recorded_decodes(monkeypatch)
    draft = draft_lm.from_target(target, num_layers=2, init="random")
    auto, only = auto_settings(tmp_path), auto_settings(tmp_path, "only")
    first, copies = evaluate_checkpoint(target, draft, eval_prompts(), auto, None)
    assert (first["dtypes"]["compile"]["dtype"], first["dtypes"]["compile"]["source"]) == (
        "eager", "unmeasured")  # fmt: skip
    assert asked == [] and {p for p, _ in calls} == {"eager"} and copies.compiled is None
    assert records(tmp_path, "compile") == records(tmp_path, "compile_s") == []

    compiled, _ = evaluate_checkpoint(target, draft, eval_prompts(), only, None)
    assert compiled["decode_path"] == "compiled"
    choice = compiled["dtypes"]["compile"]
    assert (choice["dtype"], choice["source"]) == (faster, "measured")
    assert choice["seconds"] == ({"eager": 0.2, "compiled": 0.1} if faster == "compiled"
                                 else {"eager": 0.1, "compiled": 0.2})  # fmt: skip
    assert sorted(asked) == ["compiled", "eager"]
    (verdict,) = records(tmp_path, "compile")
    assert verdict["dtype"] == faster
    (cost,) = records(tmp_path, "compile_s")  # what compiling cost
    assert cost["seconds"] > 0
    for f in (tmp_path / "dtype").glob("*.json"):  # compiling repaid (the weighing: below)
        if json.loads(f.read_text())["key"]["use"] == "compile_s":
            f.write_text(json.dumps(cost | {"seconds": 0.0}))
    asked.clear()  # a later run on this machine: the recorded verdict, nothing measured
    calls.clear()
    torch._dynamo.reset()
    again, copies = evaluate_checkpoint(target, draft, eval_prompts(), auto, None)
    assert again["dtypes"]["compile"]["source"] == "cached" and asked == []
    assert again["dtypes"]["compile"]["dtype"] == faster
    assert {path for path, speculative in calls if speculative} == {faster}
    assert again["decode_path"] == faster
    assert ("speedup_best_ar" in again) == (faster == "compiled")  # no compiled AR: absent
    assert (copies.compiled is not None) == (faster == "compiled")

    other = {**models.dtype_choice.machine_key(), "cpu": "another CPU"}
    monkeypatch.setattr(models.dtype_choice, "machine_key", lambda: other)
    third, _ = evaluate_checkpoint(target, draft, eval_prompts(), auto, None)
    assert third["dtypes"]["compile"]["source"] == "unmeasured" and asked == []


@pytest.mark.parametrize(
    "path, want", [("auto", "bfloat16"), ("only", "float32"), (False, "bfloat16")]
)
def test_decode_dtype_is_timed_on_the_path_it_decodes(target, monkeypatch, tmp_path, path, want):
    """decode.dtype=auto with decode.compile=only: the dtype whose verify runs fastest
    compiled, not by eager timings. Here bf16 wins eagerly and float32 compiled (as on a CPU
    with AVX2 only): a compiled decode takes float32, an eager one bf16; auto times eagerly
    (its path is chosen after the dtype) unless `only` recorded the compiled verdict on this
    machine, which it then reads. The AR dtype stays the fastest eager one."""
    eager = {torch.float32: 0.30, torch.bfloat16: 0.20}
    compiled = {torch.float32: 0.10, torch.bfloat16: 0.15}
    asked = []

    def fake_compiled(target_, dtype, width, cached, mode, layers, max_len):
        assert target_ is target and mode == "aot_eager" and max_len >= cached + width
        asked.append((dtype, width, layers))
        return compiled[dtype]

    monkeypatch.setattr(train.eval.plan, "time_forward", lambda t, dtype, *a, **kw: eager[dtype])
    monkeypatch.setattr(models.few_rows, "time_forward", lambda t, dtype, *a, **kw: eager[dtype])
    monkeypatch.setattr(train.eval.plan, "compiled_forward_seconds", fake_compiled)
    settings = auto_settings(tmp_path, path, dtype="auto")
    copies = train.eval.plan.decode_copies(target, settings, eval_prompts())
    assert copies.dtypes["decode"]["dtype"] == want
    assert copies.dtypes["ar"]["dtype"] == "bfloat16"
    width, layers = settings.k + 1, train.eval.plan.PROXY_LAYERS
    assert asked == (
        [] if path != "only" else [(torch.float32, width, layers), (torch.bfloat16, width, layers)]
    )
    if path == "only":  # auto on this machine now reads the compiled verdict, timing nothing
        auto = auto_settings(tmp_path, "auto", dtype="auto")
        again = train.eval.plan.decode_copies(target, auto, eval_prompts())
        assert (again.dtypes["decode"]["dtype"], again.dtypes["decode"]["source"]) == (
            "float32", "cached")  # fmt: skip
        assert len(asked) == 2


def test_the_compiled_dtype_proxy_has_the_decodes_cache_length(target, monkeypatch, tmp_path):
    """The decode dtype's compiled proxy is built for the cache length and the verify width
    of the target graph the decode compiles next, so that graph finds the proxy's C++ kernels
    in inductor's on-disk cache."""
    asked = []

    def fake_compiled(target_, dtype, width, cached, mode, layers, max_len):
        asked.append((width, max_len))
        return {torch.float32: 0.1, torch.bfloat16: 0.2}[dtype]

    monkeypatch.setattr(train.eval.plan, "compiled_forward_seconds", fake_compiled)
    draft = draft_lm.from_target(target, num_layers=2, init="random")
    settings = auto_settings(tmp_path, "only", dtype="auto")
    _, copies = evaluate_checkpoint(target, draft, eval_prompts(), settings, None)
    assert copies.compiled.widths == (1, settings.k + 1)
    assert asked == [(settings.k + 1, copies.compiled.max_len)] * 2


def test_compiled_forward_seconds_times_a_copy_and_leaves_the_target_alone(target, monkeypatch):
    """The proxy compiles a copy of the first layers in the dtype asked and scales its time by
    the target's layers over the copy's; the target keeps its layers, dtype and weights."""
    import decoding.timing

    before = {n: p.clone() for n, p in target.model.state_dict().items()}
    timed = []

    def fake_forward_seconds(compiled, width, cached, hidden_layers, repeats=5):
        timed.append((compiled.num_layers, compiled.dtype, width, cached))
        return 0.5

    monkeypatch.setattr(decoding.timing, "forward_seconds", fake_forward_seconds)
    seconds = train.eval.plan.compiled_forward_seconds(target, torch.bfloat16, 4, 8, "aot_eager", 1)
    assert timed == [(1, torch.bfloat16, 4, 8)]
    assert seconds == 0.5 * target.num_layers
    after = target.model.state_dict()
    assert target.dtype == torch.float32 and len(target.model.model.layers) == target.num_layers
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_compile_auto_weighs_the_recorded_compile_seconds(target, monkeypatch, tmp_path):
    """A machine that compiled before knows the compiled verify's saving per forward and what
    compiling cost: an evaluation whose forwards cannot repay it decodes eagerly and compiles
    nothing ("weighed"), one that can compiles; the bound counts the AR's steps at the headline
    sampling and one verify per new token at every sampling."""
    fake_forward_seconds(monkeypatch, 0.2, 0.1)
    draft = draft_lm.from_target(target, num_layers=2, init="random")
    only = auto_settings(tmp_path, "only")
    evaluate_checkpoint(target, draft, eval_prompts(), only, None)  # records
    (cost_file,) = [f for f in (tmp_path / "dtype").glob("*.json")
                    if json.loads(f.read_text())["key"]["use"] == "compile_s"]  # fmt: skip
    forwards = 12 * 3 * 1 * 2  # max_new_tokens x (two ARs + a verify) x temperatures x prompts
    for compile_s, want in ((forwards * 0.1 + 1.0, "eager"), (forwards * 0.1 - 1.0, "compiled")):
        cost_file.write_text(json.dumps({"key": {"use": "compile_s"}, "seconds": compile_s}))
        torch._dynamo.reset()
        calls = recorded_decodes(monkeypatch)
        result, copies = evaluate_checkpoint(
            target, draft, eval_prompts(), auto_settings(tmp_path), None
        )  # fmt: skip
        choice = result["dtypes"]["compile"]
        assert choice["dtype"] == want
        assert choice["source"] == ("weighed" if want == "eager" else "cached")
        assert {path for path, speculative in calls if speculative} == {want}
        assert (
            ("compiled", False) in calls
            if want == "compiled"
            else {p for p, _ in calls} == {"eager"}
        )  # compiled: its AR too; eager: nothing compiled
        assert (copies.compiled is None) == (want == "eager")
        if want == "eager":
            assert choice["seconds"]["compile"] == compile_s
            assert choice["seconds"]["saved at most"] == pytest.approx(forwards * 0.1)


def test_every_sampling_decodes_its_own_ars_prompt_by_prompt(target, monkeypatch, tmp_path):
    """With two temperatures each is decoded with both ARs, compiled and eager, interleaved
    with its speculative decode prompt by prompt (warm-up prompt first), greedy first: no
    speedup divides by an AR decoded at another sampling or another time."""
    calls = recorded_decodes(monkeypatch)
    draft = draft_lm.from_target(target, num_layers=2, init="random")
    settings = auto_settings(tmp_path, "only", temperatures=[0.9, 0.0])
    result, _ = evaluate_checkpoint(target, draft, eval_prompts(), settings, None)
    per_prompt = [("eager", False), ("compiled", False), ("compiled", True)]
    assert calls == per_prompt * 3 * 2  # (warm-up + 2 prompts) x 2 samplings
    for tag in ("greedy", "T0.9"):
        for ar in ("eager_ar", "compiled_ar"):
            assert result[f"{tag}/speedup_{ar}"] == pytest.approx(
                result[f"{tag}/tokens_per_s"] / result[f"{tag}/{ar}_tokens_per_s"]
            )
    assert result["T0.9/compiled_ar_tokens_per_s"] != result["greedy/compiled_ar_tokens_per_s"]
    assert result["T0.9/greedy_match_rate"] is None and result["greedy/greedy_match_rate"] == 1.0


def test_eager_path_decodes_an_ar_at_every_sampling(target, monkeypatch):
    """The eager evaluation the same, its AR at each sampling; without a compiled AR there is
    no speedup against the fastest AR (the key is absent; the table says so) and the eager
    ratio has its own name."""
    from train.eval.evaluate import format_eval_table

    calls = recorded_decodes(monkeypatch)
    draft = draft_lm.from_target(target, num_layers=2, init="random")
    settings = eval_settings(eval_cfg(compile=False, temperatures=[0.9, 0.0]))
    result, _ = evaluate_checkpoint(target, draft, eval_prompts(), settings, None)
    assert calls == [("eager", False), ("eager", True)] * 3 * 2
    assert result["T0.9/speedup"] == pytest.approx(
        result["T0.9/tokens_per_s"] / result["T0.9/ar_tokens_per_s"]
    )
    assert result["speedup_eager_ar"] == result["greedy/speedup"]
    assert "speedup_best_ar" not in result and "greedy/speedup_best_ar" not in result
    assert result["greedy/greedy_match_rate"] == 1.0
    assert "compiled AR was not decoded" in format_eval_table([result])


def test_compile_cache_is_kept_under_the_cache_root_unless_the_user_set_one(tmp_path, monkeypatch):
    """Inductor's cache goes to <cache root>/inductor, replacing inductor's own temporary
    default (which importing parts of torch sets); a directory the user set stays."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from decoding.inductor import use_compile_cache

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert use_compile_cache(str(tmp_path)) == str(tmp_path / "inductor")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    assert use_compile_cache(str(tmp_path / "b")) == str(tmp_path / "b" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_compile_cache(str(tmp_path / "c")) == str(tmp_path / "mine")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


@pytest.mark.parametrize("faster", ["float32", "bfloat16"])
def test_compiled_draft_dtype_is_timed_on_the_compiled_drafter(
    target, faster, monkeypatch, tmp_path
):
    """decode.draft_dtype=auto on the compiled path: both dtypes' drafters are timed beside
    the compiled target (their draft seconds per round, faked here so that `faster` wins
    where the eager verdict chose the other), the faster one's drafter replaces the kept one
    and is the speculative decode's, still lossless, and the verdict is
    recorded apart from the eager one (`draft_compiled`); a later evaluation on the machine
    reads it and times nothing."""
    timed = []  # (compiled target?, the drafter's dtype) of every timing decode
    real_generate = train.eval.compiled.generate

    def fake_draft_seconds(spec_target, prompt, drafter, **kwargs):
        result = real_generate(spec_target, prompt, drafter, **kwargs)
        dtype = str(next(drafter.model.parameters()).dtype).removeprefix("torch.")
        timed.append((isinstance(spec_target, CompiledTarget), dtype))
        result.draft_s = len(result.round_tokens) * (0.01 if dtype == faster else 0.02)
        return result

    monkeypatch.setattr(train.eval.compiled, "generate", fake_draft_seconds)
    slower = "bfloat16" if faster == "float32" else "float32"  # the eager verdict: the other
    monkeypatch.setattr(train.eval.plan, "draft_dtype_choice", lambda *a: DtypeChoice(
        "draft", slower, "measured", {faster: 0.2, slower: 0.1}))  # fmt: skip
    calls = recorded_decodes(monkeypatch)
    drafters = []  # the drafter of every speculative decode the evaluation timed
    real_metrics_generate = decoding.metrics.generate

    def keep_drafter(decode_target, prompt, drafter, **kwargs):
        drafters.append(drafter)
        return real_metrics_generate(decode_target, prompt, drafter, **kwargs)

    monkeypatch.setattr(decoding.metrics, "generate", keep_drafter)
    draft = draft_lm.from_target(target, num_layers=2, init="random")
    settings = auto_settings(tmp_path, "only", draft_dtype="auto")
    result, copies = evaluate_checkpoint(target, draft, eval_prompts(), settings, None)
    assert len(timed) == 2 * 4  # both dtypes, a warm-up and 3 repeats each, alternating
    assert {path for path, _ in timed} == {True}  # timed where it decodes: compiled
    assert [dtype for _, dtype in timed[:2]] in (["float32", "bfloat16"], ["bfloat16", "float32"])
    record = result["dtypes"]["draft_compiled"]
    assert (record["dtype"], record["source"]) == (faster, "measured")
    assert record["seconds"][faster] == pytest.approx(0.01)
    assert str(next(copies.draft.parameters()).dtype) == f"torch.{faster}"
    spec = [d for d in drafters if d is not None]
    assert spec and all(d is copies.drafter for d in spec)  # the kept, faster drafter decodes
    assert result["greedy/greedy_match_rate"] == 1.0 and calls  # lossless in either dtype
    timed.clear()
    again, _ = evaluate_checkpoint(target, draft, eval_prompts(), settings, None)
    assert timed == [] and again["dtypes"]["draft_compiled"]["source"] == "cached"
    assert again["dtypes"]["draft_compiled"]["dtype"] == faster


def test_compiled_draft_dtype_a_drafter_cannot_run_in_loses(target, monkeypatch, tmp_path):
    """A dtype whose compiled drafter cannot decode (here: its copy raises, as a dtype
    mismatch inside a drafter would) times as infinite and the other one decodes."""
    real_copy = train.eval.compiled.draft_decode_copy

    def no_bf16(draft, dtype):
        if dtype == torch.bfloat16:
            raise RuntimeError("expected scalar type BFloat16 but found Float")
        return real_copy(draft, dtype)

    monkeypatch.setattr(train.eval.compiled, "draft_decode_copy", no_bf16)
    monkeypatch.setattr(train.eval.plan, "draft_dtype_choice", lambda *a: DtypeChoice(
        "draft", "float32", "measured", {"float32": 0.1, "bfloat16": 0.2}))  # fmt: skip
    draft = draft_lm.from_target(target, num_layers=2, init="random")
    settings = auto_settings(tmp_path, "only", draft_dtype="auto")
    result, copies = evaluate_checkpoint(target, draft, eval_prompts(), settings, None)
    record = result["dtypes"]["draft_compiled"]
    assert record["dtype"] == "float32" and record["seconds"]["bfloat16"] == float("inf")
    assert str(next(copies.draft.parameters()).dtype) == "torch.float32"
    assert result["greedy/greedy_match_rate"] == 1.0


def test_compiled_draft_verdict_holds_at_later_checkpoints(target, monkeypatch, tmp_path):
    """The eager verdict bf16, the compiled one float32: a later checkpoint's weights reach
    the kept float32 drafter unrounded (not through the bf16 eager copy). And a dtype whose
    timing decode fails after timed repeats keeps its infinite time."""
    monkeypatch.setattr(train.eval.plan, "draft_dtype_choice", lambda *a: DtypeChoice(
        "draft", "bfloat16", "measured", {"float32": 0.2, "bfloat16": 0.1}))  # fmt: skip
    real_generate, bf16_calls = train.eval.compiled.generate, []

    def bf16_fails_late(spec_target, prompt, drafter, **kwargs):
        bf16 = next(drafter.model.parameters()).dtype == torch.bfloat16
        if bf16:
            bf16_calls.append(1)
            if len(bf16_calls) == 3:  # after the warm-up and one timed repeat
                raise RuntimeError("expected scalar type BFloat16 but found Float")
        result = real_generate(spec_target, prompt, drafter, **kwargs)
        result.draft_s = len(result.round_tokens) * (0.01 if bf16 else 0.02)  # bf16 faster
        return result

    monkeypatch.setattr(train.eval.compiled, "generate", bf16_fails_late)
    settings = auto_settings(tmp_path, "only", draft_dtype="auto")
    torch.manual_seed(1)
    first = draft_lm.from_target(target, num_layers=2, init="random")
    result, copies = evaluate_checkpoint(target, first, eval_prompts(), settings, None)
    record = result["dtypes"]["draft_compiled"]
    assert record["dtype"] == "float32" and record["seconds"]["bfloat16"] == float("inf")
    torch.manual_seed(2)
    later = draft_lm.from_target(target, num_layers=2, init="random")
    evaluate_checkpoint(target, later, eval_prompts(), settings, None, copies)
    kept = dict(copies.draft.named_parameters())
    for name, weight in later.named_parameters():
        assert kept[name].dtype == torch.float32 and torch.equal(kept[name], weight), name
