"""decode.ood_prompts: prompts of kinds the training data has none of, decoded beside the eval
prompts for tau alone (train/eval/evaluate.py), from train/data/ood_prompts.jsonl or a file."""

import json

import pytest
import torch
from omegaconf import OmegaConf

from models import eagle
from train.data.corpus import CATEGORIES
from train.data.prompt_file import BUILTIN_OOD, load_prompt_file, ood_prompts
from train.eval.evaluate import evaluate_checkpoint, format_eval_table
from train.eval.settings import EvalSettings
from train.run.settings import eval_settings


def test_the_builtin_set_is_of_kinds_the_embedded_pool_lacks(tiny):
    rows = [json.loads(line) for line in BUILTIN_OOD.read_text().splitlines()]
    kinds = [r["category"] for r in rows]
    assert len(rows) == 24 and {kinds.count(c) for c in set(kinds)} == {6}
    assert not set(kinds) & set(CATEGORIES)  # code / prose / qa: the training pool's kinds
    assert len({r["prompt"] for r in rows}) == 24
    prompts = ood_prompts("builtin", tiny.tokenizer, None)
    assert [p["category"] for p in prompts] == kinds and all(p["input_ids"] for p in prompts)
    assert ood_prompts(None, tiny.tokenizer, None) == []


def test_a_bad_file_is_refused_with_its_line(tmp_path, tiny):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match=r"decode.ood_prompts .*p.jsonl line 2: expected"):
        ood_prompts(str(path), tiny.tokenizer, None)
    with pytest.raises(FileNotFoundError, match="decode.ood_prompts"):
        ood_prompts(str(tmp_path / "missing.jsonl"), tiny.tokenizer, None)


def _cfg(ood: str | None, temperatures: tuple = (0.0, 0.9), **decode) -> OmegaConf:
    return OmegaConf.create(
        {
            "seed": 0,
            "decode": {
                "k": 2, "temperatures": list(temperatures), "top_k": 0, "top_p": 1.0,
                "max_new_tokens": 12, "num_prompts": 3, "warmup": 0, "dtype": "float32",
                "draft_dtype": "float32", "ood_prompts": ood, **decode,
            },
        }
    )  # fmt: skip


def _settings(ood: str | None, temperatures: tuple = (0.0, 0.9), **decode) -> EvalSettings:
    return eval_settings(_cfg(ood, temperatures, **decode))


@pytest.mark.parametrize("temperatures", [(0.9, 0.0), (0.9,)])
def test_ood_tau_is_the_tau_of_the_same_decode_on_those_prompts(tmp_path, tiny, temperatures):
    """ood/<tag>/tau equals the tau an evaluation whose eval prompts ARE the ood prompts
    reports (prompt i seeded seed + i in both), at the headline sampling only: greedy where it
    is configured, listed first or not, else the first temperature; ood/tau_ratio is ood/tau
    over the in-domain tau."""
    draft = eagle.from_target(tiny, None, vocab_size="full", ttt_steps=2)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a draft between exact and useless: acceptance differs per prompt
        for p in draft.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    path = tmp_path / "ood.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in ["sum 2+2", "a b c d", "why"])
    )
    ood = load_prompt_file(path, tiny.tokenizer, None)
    in_domain = [{"input_ids": list(range(3, 3 + n))} for n in (5, 9, 7)]

    with_ood = _settings(str(path), temperatures)
    result, _ = evaluate_checkpoint(tiny, draft, in_domain, with_ood, None)
    alone, _ = evaluate_checkpoint(tiny, draft, ood, _settings(None, temperatures), None)
    assert result["ood_num_prompts"] == 3 and "ood/tau" not in alone
    tags = ["greedy", "T0.9"] if 0.0 in temperatures else ["T0.9"]
    headline = tags[0]
    per_sampling = [key for key in result if key.startswith("ood/") and key.count("/") == 2]
    assert sorted(per_sampling) == [f"ood/{headline}/alpha", f"ood/{headline}/tau"]
    assert result[f"ood/{headline}/tau"] == alone[f"{headline}/tau"]
    assert result[f"ood/{headline}/alpha"] == alone[f"{headline}/alpha"]
    for tag in tags:  # other prompts decode other text: the equalities can tell the sets apart
        assert result[f"{tag}/accepted_per_prompt"] != alone[f"{tag}/accepted_per_prompt"]
    assert result["ood/tau"] == result[f"ood/{headline}/tau"]
    ood_alpha = " ".join("-" if a is None else f"{a:.2f}" for a in result[f"ood/{headline}/alpha"])
    assert result["ood/tau_ratio"] == pytest.approx(result["ood/tau"] / result["tau"])
    # the console's table: a row per sampling and one OOD row below the headline, no speeds
    table = format_eval_table([result]).splitlines()
    assert table[-1].startswith("The compiled AR was not decoded")  # decode.compile=false
    rows = table[2:-1]
    assert [row.split(" | ")[1] for row in rows] == [headline, f"ood/{headline}", *tags[1:]]
    assert rows[1].endswith(f"| {result['ood/tau']:.3f} | - | {ood_alpha} |" + " - |" * 6)


def test_ood_num_prompts_takes_prompts_spread_over_the_file(tmp_path, tiny, monkeypatch):
    """decode.ood_num_prompts=2 of a file of 4 (two kinds in blocks, as the builtin's) decodes
    prompts 0 and 2, one of each kind, and reports their count."""
    import train.eval.evaluate

    decoded = []
    real = train.eval.evaluate.decode_spec_only

    def recording(target, drafter, prompts, mine, **kw):
        decoded.extend(p[0].tolist() for p in prompts)
        return real(target, drafter, prompts, mine, **kw)

    monkeypatch.setattr(train.eval.evaluate, "decode_spec_only", recording)
    draft = eagle.from_target(tiny, None, vocab_size="full", ttt_steps=2)
    texts = ["sum 2+2", "sum 3+5", "a b c d", "e f g"]
    path = tmp_path / "ood.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in texts))
    ood = load_prompt_file(path, tiny.tokenizer, None)
    in_domain = [{"input_ids": list(range(3, 3 + n))} for n in (5, 9, 7)]
    settings = _settings(str(path), (0.0,), ood_num_prompts=2)
    result, _ = evaluate_checkpoint(tiny, draft, in_domain, settings, None)
    assert result["ood_num_prompts"] == 2
    assert decoded == [ood[0]["input_ids"], ood[2]["input_ids"]]


def test_num_prompts_takes_eval_prompts_spread_over_their_categories(tiny, monkeypatch):
    """decode.num_prompts=3 of 6 eval prompts in category blocks (as train/data/corpus.py
    gives them: code, then prose, then qa) decodes prompts 0, 2 and 4, one of each category,
    and the context check before training looks at those same prompts."""
    import train.eval.evaluate
    from train.run.settings import check_decode_context

    decoded = []
    real = train.eval.evaluate.decode_prompts

    def recording(passes, prompts, mine, **kw):
        decoded.extend(prompts[i][0].tolist() for i in mine)
        return real(passes, prompts, mine, **kw)

    monkeypatch.setattr(train.eval.evaluate, "decode_prompts", recording)
    draft = eagle.from_target(tiny, None, vocab_size="full", ttt_steps=2)
    eval_prompts = [{"input_ids": list(range(3 + i, 8 + i))} for i in range(6)]
    cfg = _cfg(None, (0.0,), num_prompts=3)
    result, _ = evaluate_checkpoint(tiny, draft, eval_prompts, eval_settings(cfg), None)
    chosen = [eval_prompts[i]["input_ids"] for i in (0, 2, 4)]
    assert result["num_prompts"] == 3 and decoded == chosen
    # the longest of the chosen prompts is checked: prompt 5 (the longest of all) is not one
    eval_prompts[5]["input_ids"] = list(range(3, 3 + tiny.context_length))
    check_decode_context(tiny, cfg.decode, eval_prompts)
    eval_prompts[4]["input_ids"] = eval_prompts[5]["input_ids"]
    with pytest.raises(ValueError, match="max_new_tokens"):
        check_decode_context(tiny, cfg.decode, eval_prompts)


def test_tau_head_is_the_tau_of_the_same_decode_without_prompt_lookup(tmp_path, tiny):
    """With prompt lookup on, every sampling also decodes the trained drafter alone ("head",
    interleaved with the rest): `tau_head` equals the tau an evaluation with lookup off
    reports, in domain and out of domain (`ood/<tag>/tau_head`), and the OOD decode records
    its lookup share."""
    draft = eagle.from_target(tiny, None, vocab_size="full", ttt_steps=2)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in draft.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    path = tmp_path / "ood.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["a b a b a", "why why"]))
    in_domain = [{"input_ids": [3, 4, 5, 3, 4, 5, 3, 4]}, {"input_ids": [7, 8, 9, 7, 8]}]
    lookup_on = _settings(str(path), (0.0, 0.9), lookup_min_match=2)
    looked, _ = evaluate_checkpoint(tiny, draft, in_domain, lookup_on, None)
    lookup_off = _settings(str(path), (0.0, 0.9), lookup_min_match=0)
    alone, _ = evaluate_checkpoint(tiny, draft, in_domain, lookup_off, None)
    assert looked["passes"][-2:] == ["spec", "head"] and "head" not in alone["passes"]
    for tag in ("greedy", "T0.9"):
        assert looked[f"{tag}/tau_head"] == alone[f"{tag}/tau"]
        assert looked[f"{tag}/alpha_head"] == alone[f"{tag}/alpha"]
        assert 0 < looked[f"{tag}/lookup_share"] <= 1 and f"{tag}/tau_head" not in alone
    assert looked["tau_head"] == looked["greedy/tau_head"]
    assert looked["ood/greedy/tau_head"] == alone["ood/greedy/tau"]
    assert 0 <= looked["ood/greedy/lookup_share"] <= 1
