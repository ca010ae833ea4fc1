"""EAGLE exports (train/formats/eagle.py, read back by train/formats/eagle_read.py): each
format's key set and config fields are the anchors' own (vLLM `llama_eagle3.py` /
`llama_eagle.py` / `configs/speculators/`, SGLang `llama_eagle3.py`, speculators
`Eagle3SpeculatorConfig`, SpecForge `LlamaForCausalLMEagle3`), the tap ids follow each
engine's convention and order (ascending, fc blocks permuted to match), export ->
read_eagle_export -> a fresh draft gives identical logits, and every refusal writes nothing.
The real speculators library reading these exports: tests/test_speculators_library.py."""

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from decoding.drafter import Sampling
from decoding.drafters import make_drafter
from models import eagle
from models.target_loaders import SMOLLM2_HUB_ID, SMOLLM2_NAME, build_tiny_random
from train.core.checkpoint import save_checkpoint
from train.formats.eagle import hub_id, target_names
from train.formats.eagle_read import read_eagle_export
from train.formats.export import ExportError, export, load_run_draft
from train.run.init_from import init_draft_from

torch.set_num_threads(1)

# The first decoder layer of EAGLE-3 as vLLM / speculators name it (SGLang / SpecForge /
# the EAGLE repository: `midlayer.` instead of `layers.0.`).
EAGLE3_LAYER = {
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
}
# vLLM llama_eagle.py: input_layernorm is Identity, so the checkpoint has none.
EAGLE1_LAYER = EAGLE3_LAYER - {"input_layernorm.weight", "hidden_norm.weight"}


@pytest.fixture(scope="module")
def target():
    """8 layers: the default taps (2, 4, 5) are servable (1..L-1, distinct)."""
    return build_tiny_random(seed=0, num_layers=8, device="cpu")


def _counts(target):
    return torch.randint(0, 1000, (target.vocab_size,), generator=torch.Generator().manual_seed(0))


def _draft(target, style="eagle3", vocab_size=32, train_head=False, layers=None, seed=0):
    """A draft with every weight moved off its init (the identity init is too easy to match)."""
    torch.manual_seed(seed)
    draft = eagle.from_target(
        target,
        _counts(target),
        style=style,
        layers=layers,
        ttt_steps=3,
        vocab_size=vocab_size,
        train_head=train_head,
        init="random",
    )
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return draft.eval()


def _export(draft, target, fmt, out):
    """speculators also names the served target and the draft length per round."""
    served = {"verifier": target.name, "speculative_tokens": 4} if fmt == "speculators" else {}
    return export(draft, target, fmt, out, **served)


def _nothing_written(out):
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".tmp")]


# -- the anchors' required sets -----------------------------------------------------------------
def test_speculators_layout(target, tmp_path):
    draft = _draft(target)
    _export(draft, target, "speculators", tmp_path / "s")
    weights = load_file(tmp_path / "s" / "model.safetensors")
    assert set(weights) == {
        "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight"
    } | {f"layers.0.{k}" for k in EAGLE3_LAYER}  # fmt: skip
    # The speculators library has no embedding of its own: the target's is written.
    assert torch.equal(weights["embed_tokens.weight"], target.embed_tokens.weight)
    H = target.hidden_size
    assert weights["fc.weight"].shape == (H, 3 * H)
    assert weights["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * H  # [embedding, feature]
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    assert torch.equal(torch.arange(32) + weights["d2t"], draft.vocab_ids())  # offsets
    # fc is served over the raw taps: the tap scale is folded into its columns.
    scale = draft.tap_scale.repeat_interleave(H)
    assert torch.equal(weights["fc.weight"], draft.fc.weight * scale)
    # The frozen head is written as the target's rows at the draft ids.
    assert torch.equal(weights["lm_head.weight"], target.lm_head.weight[draft.vocab_ids()])
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["architectures"] == ["Eagle3Speculator"]
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["proposal_type"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 4  # as given, not ttt_steps (3)
    assert set(spec["verifier"]) == {"name_or_path", "architectures"}
    assert spec["verifier"]["name_or_path"] == target.name  # as given, not a path of this machine
    assert spec["verifier"]["architectures"] == ["LlamaForCausalLM"]
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert (layer["vocab_size"], layer["hidden_size"]) == (target.vocab_size, H)
    assert layer["tie_word_embeddings"] is False
    assert config["draft_vocab_size"] == 32 and config["target_hidden_size"] == H
    # vLLM's speculators reader defaults a missing norm_before_residual to TRUE.
    assert config["norm_before_residual"] is False
    assert config["norm_before_fc"] is False and config["fc_norm"] is False
    assert "eagle_aux_hidden_state_layer_ids" not in config  # default taps (2, 4, 5)


def test_eagle3_layout(target, tmp_path):
    _export(_draft(target), target, "eagle", tmp_path / "e")
    weights = load_file(tmp_path / "e" / "model.safetensors")
    assert set(weights) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
        f"midlayer.{k}" for k in EAGLE3_LAYER
    }
    config = json.loads((tmp_path / "e" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 32 and config["vocab_size"] == target.vocab_size
    assert config["tie_word_embeddings"] is False  # SGLang would use the embedding as lm_head
    assert "eagle_config" not in config and "eagle_aux_hidden_state_layer_ids" not in config


def test_eagle1_layout(target, tmp_path):
    _export(_draft(target, "eagle1", vocab_size="full"), target, "eagle", tmp_path / "e1")
    weights = load_file(tmp_path / "e1" / "model.safetensors")
    assert set(weights) == {"fc.weight"} | {f"layers.0.{k}" for k in EAGLE1_LAYER}
    H = target.hidden_size
    assert weights["fc.weight"].shape == (H, 2 * H)
    assert weights["layers.0.self_attn.q_proj.weight"].shape[1] == H
    config = json.loads((tmp_path / "e1" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 1
    assert config["vocab_size"] == target.vocab_size and "draft_vocab_size" not in config


def test_non_default_taps_in_each_engines_convention(target, tmp_path):
    draft = _draft(target, layers=[1, 3, 6])
    _export(draft, target, "speculators", tmp_path / "s")
    _export(draft, target, "eagle", tmp_path / "e")
    spec = json.loads((tmp_path / "s" / "config.json").read_text())
    assert spec["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]  # vLLM: hidden_states indices
    config = json.loads((tmp_path / "e" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]  # read first by vLLM
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]  # SGLang: +1
    for d in ("s", "e"):
        assert read_eagle_export(tmp_path / d, target)[1]["layers"] == [1, 3, 6]
    # A SpecForge / SGLang config names the taps in eagle_config only.
    del config["eagle_aux_hidden_state_layer_ids"]
    (tmp_path / "e" / "config.json").write_text(json.dumps(config))
    assert read_eagle_export(tmp_path / "e", target)[1]["layers"] == [1, 3, 6]


def test_unsorted_taps_are_served_ascending_with_fc_permuted(target, tmp_path):
    """Engines concatenate the taps in ascending layer order whatever the config lists, so a
    head trained on layers [6, 1, 3] is written as taps [1, 3, 6] with fc's column blocks
    (tap scale folded) permuted to match."""
    draft = _draft(target, layers=[6, 1, 3])
    _export(draft, target, "speculators", tmp_path / "s")
    _export(draft, target, "eagle", tmp_path / "e")
    spec = json.loads((tmp_path / "s" / "config.json").read_text())
    assert spec["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]
    config = json.loads((tmp_path / "e" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]
    H = target.hidden_size
    folded = (draft.fc.weight * draft.tap_scale.repeat_interleave(H)).detach()
    blocks = folded.view(H, 3, H)  # in draft order: taps 6, 1, 3
    for d, key in (("s", "fc.weight"), ("e", "fc.weight")):
        served = load_file(tmp_path / d / "model.safetensors")[key].view(H, 3, H)
        for j, i in enumerate([1, 2, 0]):  # served block j reads tap [1, 3, 6][j]
            assert torch.equal(served[:, j], blocks[:, i])
    # Read back: the taps ascending; a draft built on them computes the same head.
    ids = torch.randint(6, target.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    out = target(ids, hidden_layers=(1, 3, 6))
    with torch.no_grad():
        want = draft(target, ids, out).logits
    for d in ("s", "e"):
        state, settings = read_eagle_export(tmp_path / d, target)
        assert settings["layers"] == [1, 3, 6]
        fresh = eagle.from_target(target, None, layers=[1, 3, 6], ttt_steps=3, vocab_size=32)
        fresh.load_state_dict(state, strict=True)
        with torch.no_grad():
            for a, b in zip(want, fresh.eval()(target, ids, out).logits):
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)  # sums in another order
        # draft.init_from into the config's own order [6, 1, 3]: blocks permuted back, exact.
        same = eagle.from_target(target, None, layers=[6, 1, 3], ttt_steps=3, vocab_size=32)
        init_draft_from(tmp_path / d, same, target)
        with torch.no_grad():
            for a, b in zip(want, same.eval()(target, ids, out).logits):
                torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_reader_refuses_taps_listed_out_of_order(target, tmp_path):
    """An export listing [6, 1, 3] is ambiguous (engines read its fc ascending; one written
    before the taps were sorted holds them in the listed order): refused, not guessed."""
    _export(_draft(target, layers=[1, 3, 6]), target, "speculators", tmp_path / "s")
    config_path = tmp_path / "s" / "config.json"
    config = json.loads(config_path.read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [6, 1, 3]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"taps \[6, 1, 3\] out of ascending order.*re-export"):
        read_eagle_export(tmp_path / "s", target)


def test_served_target_id_and_settings(target, tmp_path):
    """The verifier is the served target's hub id where the run's config names one (never this
    machine's path), else the caller must give one; the draft length is given, not ttt_steps."""
    assert hub_id({"_target_": "models.target_loaders.load_smollm2"}) == SMOLLM2_HUB_ID
    hf = "models.target_loaders.load_hf_target"
    assert hub_id({"_target_": hf, "path": "Qwen/Qwen3-0.6B"}) == "Qwen/Qwen3-0.6B"
    assert hub_id({"_target_": hf, "path": str(tmp_path)}) is None  # a local directory
    assert hub_id({"_target_": hf, "path": "./models/x"}) is None
    assert hub_id({"_target_": "models.target_loaders.build_tiny_random", "seed": 0}) is None
    draft, out = _draft(target), tmp_path / "out"
    with pytest.raises(ExportError, match="pass --verifier ID"):
        export(draft, target, "speculators", out, speculative_tokens=4)
    with pytest.raises(ExportError, match="pass --speculative-tokens K"):
        export(draft, target, "speculators", out, verifier="org/x", speculative_tokens=0)
    with pytest.raises(ExportError, match="--verifier: only --format speculators"):
        export(draft, target, "eagle", out, verifier="org/x")
    _nothing_written(out)
    # An export naming the hub id loads back into the embedded target (a local conversion
    # named smollm2-135m-instruct); another id does not.
    export(draft, target, "speculators", tmp_path / "h", verifier=SMOLLM2_HUB_ID,
           speculative_tokens=4)  # fmt: skip
    with pytest.raises(ValueError, match="verifier 'HuggingFaceTB/SmolLM2-135M-Instruct'"):
        read_eagle_export(tmp_path / "h", target)
    name = target.name
    try:
        target.name = SMOLLM2_NAME
        assert SMOLLM2_HUB_ID.split("/")[1].lower() in target_names(target)
        assert read_eagle_export(tmp_path / "h", target)[1]["layers"] == [2, 4, 5]
    finally:
        target.name = name


def test_reader_refuses_another_embedding(target, tmp_path):
    _export(_draft(target), target, "speculators", tmp_path / "s")
    weights_path = tmp_path / "s" / "model.safetensors"
    weights = load_file(weights_path)
    weights["embed_tokens.weight"][3] += 0.5  # e.g. trained with embed_requires_grad
    save_file(weights, weights_path)
    with pytest.raises(ValueError, match="not the target .* embedding"):
        read_eagle_export(tmp_path / "s", target)
    del weights["embed_tokens.weight"]  # another trainer's export without one: the target's
    save_file(weights, weights_path)
    assert read_eagle_export(tmp_path / "s", target)[1]["style"] == "eagle3"


# -- round trip ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "style,fmt,vocab_size,train_head",
    [
        ("eagle3", "speculators", 32, False),
        ("eagle3", "speculators", "full", True),
        ("eagle3", "eagle", 32, True),
        ("eagle3", "eagle", "full", False),
        ("eagle1", "eagle", "full", False),
    ],
)
def test_export_read_back_gives_identical_logits(
    target, tmp_path, style, fmt, vocab_size, train_head
):
    draft = _draft(target, style, vocab_size, train_head)
    _export(draft, target, fmt, tmp_path / "x")
    state, settings = read_eagle_export(tmp_path / "x", target)
    assert set(state) == set(draft.state_dict())
    assert settings["style"] == style and settings["train_head"] == train_head
    fresh = eagle.from_target(
        target,
        None,
        style=settings["style"],
        layers=settings["layers"],
        ttt_steps=3,
        vocab_size=settings["draft_vocab_size"],
        train_head=settings["train_head"],
        intermediate_size=settings["intermediate_size"],
    ).eval()
    fresh.load_state_dict(state, strict=True)
    ids = torch.randint(6, target.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    out = target(ids, hidden_layers=draft.hidden_layers)
    with torch.no_grad():
        for a, b in zip(draft(target, ids, out).logits, fresh(target, ids, out).logits):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # the tap-scale fold is exact
    proposals = []
    for d in (draft, fresh):
        drafter = make_drafter(d, target)
        drafter.prefill(ids[:, :-1], target(ids[:, :-1], hidden_layers=d.hidden_layers))
        g = torch.Generator().manual_seed(0)
        proposals.append(drafter.propose(ids[:, -1], 4, Sampling(temperature=1.0), g))
    assert torch.equal(proposals[0][0], proposals[1][0])
    torch.testing.assert_close(proposals[0][1], proposals[1][1], rtol=0, atol=0)


# -- refusals: a clear error and nothing on disk ------------------------------------------------
def test_export_refusals_write_nothing(target, tmp_path):
    out = tmp_path / "out"
    other = build_tiny_random(seed=1, num_layers=8, vocab_size=120, device="cpu")
    with pytest.raises(ExportError, match="must be the same"):  # vocabulary mismatch
        _export(_draft(target), other, "speculators", out)
    no_map = eagle.from_target(target, None, ttt_steps=3, vocab_size=32)  # no token_counts
    with pytest.raises(ExportError, match="d2t/t2d"):
        _export(no_map, target, "speculators", out)
    nan = _draft(target)
    with torch.no_grad():
        nan.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(ExportError, match="NaN"):
        _export(nan, target, "eagle", out)
    with pytest.raises(ExportError, match="3 distinct taps"):  # -1 is after the final norm
        _export(_draft(target, layers=[2, 4, -1]), target, "speculators", out)
    eagle1 = _draft(target, "eagle1", vocab_size="full")
    with pytest.raises(ExportError, match="no EAGLE-1 format"):
        _export(eagle1, target, "speculators", out)
    with pytest.raises(ExportError, match="full vocabulary"):
        _export(_draft(target, "eagle1", vocab_size=32), target, "eagle", out)
    _nothing_written(out)


def test_reader_refuses_a_wrong_target_or_keys(target, tmp_path):
    _export(_draft(target), target, "speculators", tmp_path / "s")
    narrow = build_tiny_random(seed=0, num_layers=8, hidden_size=32, device="cpu")
    with pytest.raises(ValueError, match="64-wide target features"):
        read_eagle_export(tmp_path / "s", narrow)
    small_vocab = build_tiny_random(seed=0, num_layers=8, vocab_size=120, device="cpu")
    with pytest.raises(ValueError, match="vocab_size"):
        read_eagle_export(tmp_path / "s", small_vocab)
    config_path = tmp_path / "s" / "config.json"
    config = json.loads(config_path.read_text())
    bad = json.loads(json.dumps(config))
    bad["speculators_config"]["verifier"]["name_or_path"] = "meta-llama/Llama-3.1-8B-Instruct"
    config_path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="verifier"):
        read_eagle_export(tmp_path / "s", target)
    del config["norm_before_residual"]  # vLLM would assume true
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="norm_before_residual"):
        read_eagle_export(tmp_path / "s", target)
    config["norm_before_residual"] = False
    config_path.write_text(json.dumps(config))
    weights_path = tmp_path / "s" / "model.safetensors"
    weights = load_file(weights_path)
    save_file(weights | {"embed_norm.weight": torch.ones(target.hidden_size)}, weights_path)
    with pytest.raises(ValueError, match="unknown keys \\['embed_norm.weight'\\]"):
        read_eagle_export(tmp_path / "s", target)
    del weights["layers.0.hidden_norm.weight"]
    save_file(weights, weights_path)
    with pytest.raises(ValueError, match="missing keys \\['layers.0.hidden_norm.weight'\\]"):
        read_eagle_export(tmp_path / "s", target)


def test_a_head_of_a_bfloat16_run_exports_the_stored_embedding_and_imports_anywhere(tmp_path):
    """A run that held its float32 target in bfloat16: scripts/export.py's load_run_draft loads
    the target as stored, so the speculators export holds the float32 embedding exactly, and
    the head imports into the float32 target and into a bfloat16 copy. The bfloat16 copy itself
    is refused as an export's target, and an export holding the rounded embedding is refused
    on import with the fix."""
    node = {"_target_": "models.target_loaders.build_tiny_random", "seed": 0, "num_layers": 8}
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(OmegaConf.to_yaml({"target": {**node, "dtype": "bfloat16"}}))
    held = build_tiny_random(seed=0, num_layers=8, dtype="bfloat16", device="cpu")
    stored = build_tiny_random(seed=0, num_layers=8, device="cpu")
    table = stored.embed_tokens.weight
    assert not torch.equal(held.embed_tokens.weight.float(), table)  # bf16 rounds this table
    draft = _draft(held, vocab_size="full")
    model = {"_target_": "models.eagle.from_target", "ttt_steps": 3, "vocab_size": "full",
             "init": "random"}  # fmt: skip
    ckpt = save_checkpoint(run, 1, draft.state_dict(),
                           OmegaConf.to_yaml({"kind": "eagle", "model": model}), {}, 1)  # fmt: skip
    with pytest.raises(ExportError, match=r"held in torch.bfloat16 but stored in torch.float32"):
        _export(draft, held, "speculators", tmp_path / "rounded")
    _nothing_written(tmp_path / "rounded")
    loaded, target = load_run_draft(ckpt)
    assert target.dtype == torch.float32 and target.fingerprint == held.fingerprint
    _export(loaded, target, "speculators", tmp_path / "s")
    weights = load_file(tmp_path / "s" / "model.safetensors")
    assert torch.equal(weights["embed_tokens.weight"], table)  # the stored values, not rounded
    for into in (stored, held):
        fresh = eagle.from_target(into, None, ttt_steps=3, vocab_size="full")  # the target's head
        init_draft_from(tmp_path / "s", fresh, into)
    weights["embed_tokens.weight"] = table.to(torch.bfloat16).float()  # an earlier export's
    save_file(weights, tmp_path / "s" / "model.safetensors")
    with pytest.raises(ValueError, match="rounded to bfloat16 .* re-export its checkpoint"):
        read_eagle_export(tmp_path / "s", stored)
    read_eagle_export(tmp_path / "s", held)  # the copy it was rounded for reads it
