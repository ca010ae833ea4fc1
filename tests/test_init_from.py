"""draft.init_from (train/run/init_from.py): every format train/formats/ writes loads back
into a fresh draft with identical logits; a training run warm-starts from the imported weights
and a resumed run ignores init_from; scripts/evaluate.py --init-from evaluates an imported draft
as its checkpoint; every refusal says what to change and leaves the draft as it was."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file, save_file

from models import draft_lm, eagle, medusa, mtp
from models.target_loaders import build_tiny_random
from train.core.checkpoint import save_checkpoint, save_tensors
from train.formats.export import export, load_run_draft
from train.run import init_from
from train.run.init_from import InitError, detect_format, init_draft_from

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def target():
    return build_tiny_random(seed=0, device="cpu")


def _perturbed(module, seed=0, only=None):
    """Random non-zero weights (fresh Medusa blocks are the identity: too easy to match)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if only is None or only in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return module.eval()


def _heads(target, seed=0, **kw):
    return _perturbed(medusa.from_target(target, **{"num_heads": 2, **kw}), seed)


def _ids(target, seed=1):
    return torch.randint(
        6, target.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed)
    )


@torch.no_grad()
def _logits(draft, target, ids):
    out = target(ids, hidden_layers=tuple(draft.hidden_layers), use_cache=False)
    return torch.stack(draft(target, ids, out, torch.ones_like(ids)).logits)


def _snapshot(draft):
    return {k: v.clone() for k, v in draft.state_dict().items()}


def _unchanged(draft, before):
    return all(torch.equal(v, before[k]) for k, v in draft.state_dict().items())


def _checkpoint(run_dir, draft, model_cfg, kind):
    cfg = f"kind: {kind}\nmodel:\n" + "".join(f"  {k}: {v}\n" for k, v in model_cfg.items())
    return save_checkpoint(run_dir, 3, draft.state_dict(), cfg, {}, keep_last=1)


# -- every format round-trips: export -> init_draft_from into a fresh draft -> same logits -------
CASES = {
    "ours": (lambda t: _heads(t, num_layers=2, head_init="copy"),
             lambda t: medusa.from_target(t, num_heads=2, num_layers=2, head_init="copy")),
    "hf": (lambda t: _perturbed(draft_lm.from_target(t, num_layers=1), only="layers"),
           lambda t: draft_lm.from_target(t, num_layers=1, init="random")),
    "medusa": (lambda t: _heads(t), lambda t: medusa.from_target(t, num_heads=2)),
    "vllm-medusa": (lambda t: _heads(t, num_layers=2),
                    lambda t: medusa.from_target(t, num_heads=2, num_layers=2)),
}  # fmt: skip


@pytest.mark.parametrize("fmt", list(CASES))
def test_export_then_import_gives_identical_logits(fmt, target, tmp_path):
    make, fresh = CASES[fmt]
    source, draft = make(target), fresh(target)
    if fmt == "ours":
        model = {"_target_": "models.medusa.from_target", "num_heads": 2, "num_layers": 2,
                 "head_init": "copy"}  # fmt: skip
        _checkpoint(tmp_path / "run", source, model, "medusa")
        (tmp_path / "run" / "config.yaml").write_text("seed: 0\n")
        path = tmp_path / "run"  # a run directory stands for its newest checkpoint
    else:
        path = export(source, target, fmt, tmp_path / fmt)
    ids = _ids(target)
    assert not torch.equal(_logits(draft, target, ids), _logits(source, target, ids))
    assert detect_format(path) == fmt
    assert init_draft_from(path, draft, target) == fmt
    torch.testing.assert_close(
        _logits(draft, target, ids), _logits(source, target, ids), rtol=0, atol=0
    )


def test_medusa_repository_pt_and_vllm_variants(target, tmp_path):
    """The Medusa repository's loader reads medusa_lm_head.pt (one block repeated L times:
    L equal copies in the file); vLLM's blocks have no bias unless medusa_fc_bias, and
    original_lm_head keeps one output layer for all heads."""
    source = _heads(target, num_layers=2)
    with torch.no_grad():  # the repository's heads repeat one block
        for head in source.blocks:
            head[1].load_state_dict(head[0].state_dict())
    export(source, target, "medusa", tmp_path / "m")
    w = load_file(tmp_path / "m" / "medusa_lm_head.safetensors")
    (tmp_path / "m" / "medusa_lm_head.safetensors").unlink()
    torch.save(
        {k: v.to(torch.bfloat16) for k, v in w.items()}, tmp_path / "m" / "medusa_lm_head.pt"
    )
    draft, ids = medusa.from_target(target, num_heads=2, num_layers=2), _ids(target)
    init_draft_from(tmp_path / "m", draft, target)
    bf16 = medusa.from_target(target, num_heads=2, num_layers=2)
    bf16.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in source.state_dict().items()})
    torch.testing.assert_close(
        _logits(draft, target, ids), _logits(bf16, target, ids), rtol=0, atol=0
    )

    # vLLM without block bias, one shared output layer under vLLM's own name
    with torch.no_grad():
        for head in source.blocks:
            for block in head:
                block.linear.bias.zero_()
    export(source, target, "vllm-medusa", tmp_path / "v")
    file = tmp_path / "v" / "model.safetensors"
    w = {k: v for k, v in load_file(file).items() if not k.endswith(".bias")}
    w = {k: v for k, v in w.items() if not k.startswith("lm_heads.")}
    save_file(w | {"lm_head.weight": target.lm_head.weight.detach().clone()}, str(file))
    config = json.loads((tmp_path / "v" / "config.json").read_text())
    config |= {"medusa_fc_bias": False, "original_lm_head": True}
    (tmp_path / "v" / "config.json").write_text(json.dumps(config))
    draft = medusa.from_target(target, num_heads=2, num_layers=2)
    init_draft_from(tmp_path / "v", draft, target)
    torch.testing.assert_close(
        _logits(draft, target, ids), _logits(source, target, ids), rtol=0, atol=0
    )


# -- training: warm start from the imported weights; resume wins ---------------------------------
def _compose(run_dir, *overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=["+experiment=debug", f"run_dir={run_dir}",
                                           "train.eval_at_ckpt=false", *overrides])  # fmt: skip


def _first_loss(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return next(json.loads(x)["loss"] for x in lines if json.loads(x)["kind"] == "train")


@pytest.fixture(scope="module")
def source_run(tmp_path_factory):
    """An 8-step debug run (a draft LM) and its checkpoint."""
    from train.loop import run

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's many small ops crawl on busy cores
    run_dir = tmp_path_factory.mktemp("init_from") / "src"
    run(_compose(run_dir, "train.steps=8", "train.ckpt_every=8"))
    yield run_dir
    torch.set_num_threads(threads)


def test_loop_warm_starts_from_import_and_resume_wins(source_run, tmp_path):
    from train.loop import run

    ckpt = tmp_path / "step_00000008"  # a copy: this test deletes it
    shutil.copytree(source_run / "checkpoints" / "step_00000008", ckpt)
    # The same weights by an independent route: hf export -> draft.model.init_from (HF loader)
    export(*load_run_draft(source_run / "checkpoints" / "step_00000008"), "hf", tmp_path / "hf")
    run(_compose(tmp_path / "via_hf", "train.steps=1", f"draft.model.init_from={tmp_path / 'hf'}"))
    warm = tmp_path / "warm"
    run(_compose(warm, "train.steps=2", "train.ckpt_every=1", f"draft.init_from={ckpt}"))
    # Step 1's loss is the first batch's before any update: the imported draft's, not a fresh
    # one's (same seed, so the same batch as the source run's step 1).
    assert _first_loss(warm) == pytest.approx(_first_loss(tmp_path / "via_hf"), rel=1e-5)
    assert _first_loss(warm) < 0.9 * _first_loss(source_run)
    # A resumed run continues from its own checkpoint and never reads init_from again (here
    # it no longer exists).
    shutil.rmtree(ckpt)
    summary = run(_compose(warm, "train.steps=3", f"draft.init_from={ckpt}", "resume=true"))
    assert summary["resumed_from"].endswith("step_00000002") and summary["steps"] == 3


def test_evaluate_script_evaluates_an_imported_draft(source_run, tmp_path, capsys):
    """--init-from an hf export of a checkpoint decodes exactly as the checkpoint does."""
    spec = importlib.util.spec_from_file_location(
        "evaluate_script", ROOT / "scripts" / "evaluate.py"
    )
    ev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ev)
    ckpt = source_run / "checkpoints" / "step_00000008"
    draft, target = load_run_draft(ckpt)
    export(draft, target, "hf", tmp_path / "hf")
    flags = ["decode.temperatures=[0,1]", "decode.num_prompts=2", "decode.max_new_tokens=12"]
    own = ev.main([str(ckpt), *flags])
    capsys.readouterr()
    imported = ev.main(["--init-from", str(tmp_path / "hf"), "+experiment=debug", *flags])
    assert "| greedy |" in capsys.readouterr().out and imported["step"] is None
    # At T=1 acceptance depends on every draft probability (greedy is trivial on this target).
    assert own["T1/tau"] > 1.0
    for key in ("tau", "alpha", "accept_hist"):
        assert imported[f"T1/{key}"] == own[f"T1/{key}"]
        assert imported[f"greedy/{key}"] == own[f"greedy/{key}"]
    export(_heads(target), target, "medusa", tmp_path / "m")
    with pytest.raises(InitError, match="config builds draft=draft_lm .* set draft=medusa"):
        ev.main(["--init-from", str(tmp_path / "m"), "+experiment=debug", *flags])
    with pytest.raises(ValueError, match="compose a config from conf/ with --init-from DIR"):
        ev.main([str(ckpt), "+experiment=debug"])  # a recipe needs --init-from


# -- refusals: what was wrong, which setting to change, and the draft untouched ------------------
def _refused(path, draft, target, match, error=InitError):
    before = _snapshot(draft)
    with pytest.raises(error, match=match):
        init_draft_from(path, draft, target)
    assert _unchanged(draft, before)


def test_wrong_target_is_refused(target, tmp_path):
    export(_heads(target), target, "medusa", tmp_path / "m")
    export(_heads(target), target, "vllm-medusa", tmp_path / "v")
    small_vocab = build_tiny_random(seed=0, vocab_size=112, device="cpu")
    _refused(tmp_path / "m", medusa.from_target(small_vocab, num_heads=2), small_vocab,
             "made for a target with a vocabulary of 128, but target .*v112.* has 112")  # fmt: skip
    narrow = build_tiny_random(seed=0, hidden_size=32, device="cpu")
    _refused(tmp_path / "v", medusa.from_target(narrow, num_heads=2), narrow,
             "made for a target with hidden size 64, but target .*h32.* has 32")  # fmt: skip
    ckpt = _checkpoint(tmp_path / "run", _heads(target), {"_target_": "models.medusa.from_target",
                                                          "num_heads": 2}, "medusa")  # fmt: skip
    _refused(ckpt, medusa.from_target(narrow, num_heads=2), narrow,
             r"blocks.0.0.linear.weight is \[64, 64\] in the files but \[32, 32\] .* hidden "
             "size is 64, target .*h32.*'s 32: they were made for another target")  # fmt: skip
    export(_perturbed(draft_lm.from_target(target, num_layers=1)), target, "hf", tmp_path / "h")
    _refused(tmp_path / "h", draft_lm.from_target(small_vocab, num_layers=1), small_vocab,
             "vocabulary of 128, but target")  # fmt: skip
    # the verifier the heads were trained for, when the files record it
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["base_model_name_or_path"] = "/models/some-org/other-model"
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    _refused(tmp_path / "m", medusa.from_target(target, num_heads=2), target,
             "trained for the verifier '/models/some-org/other-model' but the target is "
             "'tiny_random-s0-v128-h64-l2': load that model as the target")  # fmt: skip
    config["base_model_name_or_path"] = "/elsewhere/tiny_random-s0-v128-h64-l2/"
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    init_draft_from(tmp_path / "m", medusa.from_target(target, num_heads=2), target)  # same name


def test_wrong_draft_kind_is_refused(target, tmp_path):
    export(_heads(target), target, "medusa", tmp_path / "m")
    _refused(tmp_path / "m", draft_lm.from_target(target, num_layers=1), target,
             r"holds a medusa draft \(medusa format\) but the config builds draft=draft_lm "
             r"\(DraftLM\): set draft=medusa")  # fmt: skip
    export(_perturbed(draft_lm.from_target(target, num_layers=1)), target, "hf", tmp_path / "h")
    _refused(tmp_path / "h", _heads(target), target, "set draft=draft_lm")
    _checkpoint(tmp_path / "run", _heads(target), {"_target_": "models.medusa.from_target",
                                                   "num_heads": 2}, "medusa")  # fmt: skip
    _refused(tmp_path / "run" / "checkpoints" / "step_00000003",
             mtp.from_target(target, num_depths=1), target, "config builds draft=mtp .* set draft=medusa")  # fmt: skip
    lora = medusa.from_target(target, num_heads=2, medusa2=True, lora_rank=2)
    _refused(tmp_path / "m", lora, target, "without Medusa-2's LoRA adapter")


def test_eagle_formats_are_detected_and_checked(target, tmp_path, monkeypatch):
    """Hand-written tiny directories: detection, the kind check before any reading, and the
    hand-over to train/formats/eagle_read.py's reader (stubbed here)."""
    spec = tmp_path / "spec"
    spec.mkdir()
    (spec / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3",
                                                  "architectures": ["Eagle3Speculator"]}))  # fmt: skip
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    keys = tmp_path / "keys"
    keys.mkdir()
    save_file({"midlayer.mlp.up_proj.weight": torch.zeros(2, 2)}, str(keys / "model.safetensors"))
    (keys / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert [detect_format(p) for p in (spec, repo, keys)] == ["speculators", "eagle", "eagle"]
    _refused(
        spec,
        _heads(target),
        target,
        r"holds a eagle draft \(speculators format\) .* set draft=eagle",
    )
    _refused(keys, draft_lm.from_target(target, num_layers=1), target, "set draft=eagle")

    source = _perturbed(eagle.from_target(target, vocab_size="full"), seed=4)
    settings = {"style": "eagle3", "layers": list(source.hidden_layers)}
    # train/formats/eagle_read.py's reader (its own tests cover it) hands over a state and settings
    monkeypatch.setattr(
        init_from, "read_eagle_export", lambda path, t: (source.state_dict(), settings)
    )
    draft, ids = eagle.from_target(target, vocab_size="full"), _ids(target)
    assert init_draft_from(spec, draft, target) == "speculators"
    torch.testing.assert_close(
        _logits(draft, target, ids), _logits(source, target, ids), rtol=0, atol=0
    )
    settings["layers"] = [0, 1, -1]  # same shapes, other taps
    _refused(repo, eagle.from_target(target, vocab_size="full"), target,
             r"reads target layers \[0, 1, -1\], the draft built from the config .* set "
             r"draft.model.layers=\[0, 1, -1\]")  # fmt: skip


def test_shapes_counts_and_keys_name_the_setting(target, tmp_path):
    ckpt = _checkpoint(tmp_path / "run", _perturbed(draft_lm.from_target(target, num_layers=1)),
                       {"_target_": "models.draft_lm.from_target", "num_layers": 1,
                        "intermediate_size": 128}, "draft_lm")  # fmt: skip
    _refused(ckpt, draft_lm.from_target(target, num_layers=1, intermediate_size=96), target,
             r"model.model.layers.0.mlp.\w+_proj.weight is \[\d+, \d+\] in the files but "
             r"\[\d+, \d+\] in the draft built from the config; set draft.model.intermediate_size=128")  # fmt: skip
    _refused(
        ckpt,
        draft_lm.from_target(target, num_layers=2),
        target,
        r"lack 9 tensors .*'model.model.layers.1.* set draft.model.num_layers=1",
    )
    export(_heads(target), target, "medusa", tmp_path / "m")
    _refused(tmp_path / "m", medusa.from_target(target, num_heads=3), target,
             "holds 2 heads of 1 blocks, the draft built from the config 3 of 1: set "
             "draft.model.num_heads=2 and draft.model.num_layers=1")  # fmt: skip
    # trained per-head output layers need heads of their own
    export(_heads(target, head_init="copy"), target, "medusa", tmp_path / "c")
    _refused(
        tmp_path / "c",
        medusa.from_target(target, num_heads=2),
        target,
        r"output layers of heads \[0, 1\] are trained copies.* set draft.model.head_init=copy",
    )
    init_draft_from(
        tmp_path / "c", medusa.from_target(target, num_heads=2, head_init="copy"), target
    )
    # unknown keys: in the format's namespace, and in a checkpoint
    w = load_file(tmp_path / "m" / "medusa_lm_head.safetensors")
    save_file(w | {"0.9.extra": torch.zeros(1)}, str(tmp_path / "m" / "medusa_lm_head.safetensors"))
    _refused(tmp_path / "m", medusa.from_target(target, num_heads=2), target,
             r"missing \[\], unknown \['0.9.extra'\]")  # fmt: skip
    heads = _heads(target)  # a checkpoint with a tensor the draft does not have
    ckpt = _checkpoint(tmp_path / "r2", heads, {"_target_": "models.medusa.from_target"}, "medusa")
    state = heads.state_dict() | {"out.0.weight": target.lm_head.weight.detach()}
    save_tensors(state, ckpt / "draft.safetensors")
    _refused(ckpt, medusa.from_target(target, num_heads=2), target,
             r"lack 0 tensors .* hold 1 unknown ones \['out.0.weight'\]; set draft.model.head_init")  # fmt: skip


def test_other_bad_input(target, tmp_path):
    heads = medusa.from_target(target, num_heads=2)
    _refused(tmp_path / "nope", heads, target, "is not a directory", FileNotFoundError)
    (tmp_path / "empty").mkdir()
    _refused(tmp_path / "empty", heads, target,
             r"holds no draft format .* looked for draft.yaml \+ draft.safetensors .* medusa_num_heads")  # fmt: skip
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "config.yaml").write_text("seed: 0\n")
    _refused(tmp_path / "run", heads, target, "holds no checkpoint")
    # vLLM's truncated vocabulary (token_map) has no draftlab counterpart
    export(_heads(target), target, "vllm-medusa", tmp_path / "v")
    config = json.loads((tmp_path / "v" / "config.json").read_text())
    (tmp_path / "v" / "config.json").write_text(json.dumps(config | {"truncated_vocab_size": 64}))
    _refused(tmp_path / "v", heads, target, "truncated vocabulary")
    # an hf draft LM whose maths differ in a setting no tensor shows
    export(_perturbed(draft_lm.from_target(target, num_layers=1)), target, "hf", tmp_path / "h")
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    (tmp_path / "h" / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 0.1}))
    _refused(tmp_path / "h", draft_lm.from_target(target, num_layers=1), target,
             r"rms_norm_eps=0.1, not 1e-0?\d.* draft.model.init_from=DIR")  # fmt: skip


def test_a_failing_load_leaves_the_draft_unchanged(target, tmp_path):
    """The draft's own load checks (a post-hook, as EAGLE's vocabulary map check) run on a
    copy first: when they refuse, the draft keeps its weights."""
    export(_heads(target), target, "medusa", tmp_path / "m")
    draft = medusa.from_target(target, num_heads=2)

    def refuse(module, incompatible):
        raise ValueError("the draft's own check refused the weights")

    draft.register_load_state_dict_post_hook(refuse)
    _refused(tmp_path / "m", draft, target, "own check refused", ValueError)
