"""Which draft kind exports as which format (train/formats/kinds.py), and MTP as speculators'
`mtp` (train/formats/mtp.py).

- The kind / format table covers every draft kind, its kind read from a checkpoint's
  draft.yaml is the one the built module reports, and a mismatch is refused by
  scripts/export.py before the target loads, nothing written.
- draftlab's default MTP (a Llama module per depth) against the real speculators library (0.9,
  `mtp` type): it refuses a Llama layer config and more than one next-n layer; mapped onto its
  Qwen3 MTP layer every weight of a 1-depth MTP has its slot (only q_norm / k_norm are left),
  and with those two norms taken out the library's step-0 logits equal our depth-1 logits,
  with them in (weights 1) they do not: the refusal's claims hold.
- The served variant (`one_layer` + `qk_norm`) exported by scripts/export.py is loaded by the
  library's own `from_pretrained` (its embedding and head reloaded from the verifier), and its
  teacher-forced forward equals ours at every step and position (max |Δ log-softmax| <= 1e-4),
  eager and sdpa attention."""

from pathlib import Path

import hydra.utils
import pytest
import torch
from omegaconf import OmegaConf
from speculators import SpeculatorModel, SpeculatorModelConfig
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.mtp import MTPDraftModel, MTPSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from torch import nn
from transformers import LlamaConfig, Qwen3Config

from decoding.drafters import DRAFTERS
from models import mtp
from models.target_loaders import build_tiny_random
from tests.helpers import compose_train, export_script
from train.core.checkpoint import save_checkpoint
from train.formats.checks import ExportError
from train.formats.export import export
from train.formats.kinds import (
    EXPORT_FORMATS,
    FORMATS,
    REFUSED,
    check_kind_format,
    config_export_kind,
    module_export_kind,
)

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4  # max |Δ log-softmax|
STEPS = 3  # the library's num_speculative_steps


@pytest.fixture(scope="module")
def target():
    return build_tiny_random(seed=0, num_layers=2, device="cpu")


def _moved(draft: nn.Module, seed: int = 1) -> nn.Module:
    """Every weight off its init, so a swapped or dropped weight shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return draft.eval()


# -- the kind / format table -----------------------------------------------------------------
def test_every_kind_has_a_row_and_every_refusal_a_reason():
    assert set(DRAFTERS) <= set(EXPORT_FORMATS)  # a new kind adds its row
    assert {f for fmts in EXPORT_FORMATS.values() for f in fmts} == set(FORMATS)
    assert {k for k, fmts in EXPORT_FORMATS.items() if not fmts} == set(REFUSED)


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "conf" / "draft").glob("*.yaml")))
def test_checkpoint_kind_is_the_module_kind(target, name):
    """conf/draft/<name>.yaml, composed as a run does, read as a checkpoint's draft.yaml."""
    if name == "medusa2":
        pytest.importorskip("peft")
    draft_cfg = compose_train("target=tiny_random", f"draft={name}").draft
    draft = hydra.utils.instantiate(draft_cfg.model, target=target, token_counts=None)
    kind = config_export_kind(OmegaConf.to_container(draft_cfg, resolve=True))
    assert kind == module_export_kind(draft) == name


def test_mismatch_refused_before_the_target_loads(target, tmp_path, monkeypatch):
    script = export_script()

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded before the refusal")

    monkeypatch.setattr(script, "load_run_draft", no_target)
    run = tmp_path / "run"
    run.mkdir()
    target_cfg = {"_target_": "models.target_loaders.build_tiny_random", "seed": 0}
    (run / "config.yaml").write_text(OmegaConf.to_yaml({"target": target_cfg, "decode": {"k": 3}}))
    draft = mtp.from_target(target, num_depths=1)
    model = {"_target_": "models.mtp.from_target", "num_depths": 1}
    ckpt = save_checkpoint(run, 1, draft.state_dict(),
                           OmegaConf.to_yaml({"kind": "mtp", "model": model}), {}, 1)  # fmt: skip
    for fmt in FORMATS:
        out = tmp_path / f"out_{fmt}"
        extra = ["--verifier", "org/x"] if fmt == "speculators" else []
        with pytest.raises(
            SystemExit, match="nothing written: this MTP checkpoint is not exported"
        ):
            script.main([str(ckpt), "--format", fmt, "--out", str(out), *extra])
        assert not out.exists()
    medusa_yaml = {"kind": "medusa", "model": {"_target_": "models.medusa.from_target"}}
    (ckpt / "draft.yaml").write_text(OmegaConf.to_yaml(medusa_yaml))  # read before the weights
    with pytest.raises(SystemExit, match="medusa draft is written as medusa or vllm-medusa"):
        script.main([str(ckpt), "--format", "speculators", "--out", str(tmp_path / "s")])
    with pytest.raises(SystemExit):  # not a format at all: argparse's own refusal
        script.main([str(ckpt), "--format", "mtp", "--out", str(tmp_path / "m")])
    with pytest.raises(ExportError, match="eagle1 draft is written as eagle, not --format"):
        check_kind_format("eagle1", "speculators")
    with pytest.raises(ExportError, match="draft kind 'toy' has no export format"):
        check_kind_format("toy", "hf")
    with pytest.raises(
        ExportError, match="MTP checkpoint is not exported"
    ):  # the library entry too
        export(draft, target, "speculators", tmp_path / "x", verifier="org/x",
               speculative_tokens=3)  # fmt: skip
    assert not (tmp_path / "x").exists()


# -- speculators 0.9's `mtp` type against draftlab's MTP ---------------------------------------
def _library_config(layer_config) -> MTPSpeculatorConfig:
    return MTPSpeculatorConfig(
        transformer_layer_config=layer_config,
        speculators_config=SpeculatorsConfig(
            algorithm="mtp",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=STEPS)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
    )


def _qwen3_config(block: LlamaConfig) -> Qwen3Config:
    """The library's layer at the sizes and rope of draftlab's block."""
    return Qwen3Config(
        vocab_size=block.vocab_size,
        hidden_size=block.hidden_size,
        num_hidden_layers=1,
        num_attention_heads=block.num_attention_heads,
        num_key_value_heads=block.num_key_value_heads,
        head_dim=block.head_dim,
        intermediate_size=block.intermediate_size,
        rms_norm_eps=block.rms_norm_eps,
        max_position_embeddings=block.max_position_embeddings,
        rope_parameters=dict(block.rope_parameters),
    )


def library_state(draft: mtp.MTP) -> dict[str, torch.Tensor]:
    """Depth 1 of draftlab's MTP under the library's names. The library concatenates
    [embedding ; hidden] before input_proj, draftlab [hidden ; embedding]: the column blocks
    swap. final_norm is the layer's final_layernorm (the library applies it inside the layer,
    before lm_head)."""
    module, H = draft.depths[0], draft.block_config.hidden_size
    state = {
        "hidden_layernorm.weight": module.hidden_norm.weight,
        "token_layernorm.weight": module.embed_norm.weight,
        "input_proj.weight": torch.cat([module.proj.weight[:, H:], module.proj.weight[:, :H]], 1),
        "final_layernorm.weight": module.final_norm.weight,
        **module.block.state_dict(),
    }
    return {f"mtp_layers.0.{k}": v for k, v in state.items()}


def test_library_refuses_what_draftlab_mtp_is(target):
    block = mtp.from_target(target, num_depths=1).block_config
    with pytest.raises(ValueError, match="Unsupported MTP model type 'llama'"):
        MTPDraftModel(_library_config(LlamaConfig(**block.to_diff_dict())))
    with pytest.raises(ValueError, match="supports 1 layer, got 2"):
        MTPSpeculatorConfig(num_nextn_predict_layers=2)


def test_only_the_qk_norms_are_missing(target):
    draft = _moved(mtp.from_target(target, num_depths=1))
    lib = MTPDraftModel(_library_config(_qwen3_config(draft.block_config))).eval()
    ours = library_state(draft)
    verifier_owned = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight"}
    qk_norms = {"mtp_layers.0.self_attn.q_norm.weight", "mtp_layers.0.self_attn.k_norm.weight"}
    assert set(lib.state_dict()) - verifier_owned - set(ours) == qk_norms
    assert set(ours) - set(lib.state_dict()) == set()
    for key, tensor in ours.items():  # and each weight fits its slot
        assert tensor.shape == lib.state_dict()[key].shape, key
    lib.load_state_dict(ours, strict=False)
    with torch.no_grad():
        lib.embed_tokens.weight.copy_(target.embed_tokens.weight)
        lib.lm_head.weight.copy_(target.lm_head.weight)

    seqs = torch.randint(6, target.vocab_size, (2, 14), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = target(seqs, hidden_layers=draft.hidden_layers)
        depth1 = draft(target, seqs, out).logits[0]  # [B, T, V]: predicts x_{t+2}

    def step0(model):  # the library's step 0 reads h_t and emb(x_{t+1}), predicts x_{t+2}
        with torch.no_grad():
            logits, _, _ = model(input_ids=seqs, hidden_states=out.hidden[-1])
        return logits[0]  # [B, T - STEPS - 1, V]

    with_norms = step0(lib)
    n = with_norms.shape[1]
    assert n == seqs.shape[1] - STEPS - 1
    attention = lib.mtp_layers[0].self_attn
    attention.q_norm, attention.k_norm = nn.Identity(), nn.Identity()
    without_norms = step0(lib)
    delta = (without_norms.log_softmax(-1) - depth1[:, :n].log_softmax(-1)).abs().max()
    assert delta <= TOL, f"without q/k norms: max |Δ log-softmax| {delta:.2e}"
    gap = (with_norms.log_softmax(-1) - depth1[:, :n].log_softmax(-1)).abs().max()
    assert gap > 100 * TOL, f"the q/k norms changed nothing ({gap:.2e}): the refusal is wrong"


# -- the served variant, exported and read back by the library ---------------------------------
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_served_mtp_export_is_what_the_library_computes(
    target, verifier_dir, tmp_path, capsys, attn
):
    """scripts/export.py CKPT --format speculators on a one_layer + qk_norm draft of STEPS
    depths; the library's from_pretrained + forward: its step k equals our depth k+1 at every
    position it predicts (step k reads row t's fed state and emb(x_{t+k+1}): x_{t+k+2}). The
    file proposes the depths trained, whatever the run decoded with, and the script says so."""
    torch.manual_seed(0)
    draft = _moved(mtp.from_target(target, num_depths=STEPS, one_layer=True, qk_norm=True))
    run = tmp_path / "run"
    run.mkdir()
    target_cfg = {"_target_": "models.target_loaders.build_tiny_random", "seed": 0,
                  "num_layers": 2, "device": "cpu"}  # fmt: skip
    (run / "config.yaml").write_text(OmegaConf.to_yaml({"target": target_cfg, "decode": {"k": 2}}))
    model = {"_target_": "models.mtp.from_target", "num_depths": STEPS, "one_layer": True,
             "qk_norm": True}  # fmt: skip
    ckpt = save_checkpoint(run, 1, draft.state_dict(),
                           OmegaConf.to_yaml({"kind": "mtp", "model": model}), {}, 1)  # fmt: skip
    out = tmp_path / "export"
    export_script().main([str(ckpt), "--format", "speculators", "--out", str(out),
                          "--verifier", str(verifier_dir)])  # fmt: skip
    assert f"{STEPS} speculative tokens" in capsys.readouterr().out
    config = SpeculatorModelConfig.from_pretrained(str(out))
    assert (config.speculators_model_type, config.num_nextn_predict_layers) == ("mtp", 1)
    assert config.speculators_config.proposal_methods[0].speculative_tokens == STEPS
    config.transformer_layer_config._attn_implementation = attn
    lib = SpeculatorModel.from_pretrained(str(out), config=config).eval()
    assert torch.equal(lib.embed_tokens.weight, target.embed_tokens.weight)  # the verifier's

    seqs = torch.randint(6, target.vocab_size, (2, 14), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hidden = target(seqs, hidden_layers=draft.hidden_layers)
        ours = draft(target, seqs, hidden).logits  # depth d: [B, T, V], predicts x_{t+d+1}
        steps, _, _ = lib(input_ids=seqs, hidden_states=hidden.hidden[-1])
    assert len(steps) == STEPS
    n = seqs.shape[1] - STEPS - 1
    for k, logits in enumerate(steps):
        delta = (logits.log_softmax(-1) - ours[k][:, :n].log_softmax(-1)).abs().max()
        assert delta <= TOL, f"step {k}: max |Δ log-softmax| {delta:.2e}"


def test_the_default_mtp_layout_is_refused_with_the_variant_to_train(target, tmp_path):
    from train.formats.mtp import check_servable

    for kw in ({}, {"one_layer": True}, {"qk_norm": True}):
        with pytest.raises(ExportError, match=r"\+experiment=mtp_served_kl"):
            check_servable(mtp.from_target(target, num_depths=2, **kw), target)
