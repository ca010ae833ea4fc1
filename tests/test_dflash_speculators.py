"""The served DFlash variant (models/dflash.py: `mask_token_id` + `qk_norm`) as speculators'
`dflash` (train/formats/dflash.py), read by the real library: `scripts/export.py CKPT --format
speculators`, then `SpeculatorModel.from_pretrained(DIR)` and its anchored-block forward
(`_backbone_forward`, the logits before its loss) on the target's taps captured as vLLM does
(ascending), at chosen anchors, equals our blocks' logits at every block slot within max
|Δ log-softmax| <= 1e-4, full and reduced vocabulary, taps listed out of order, eager and
sdpa attention. The learned-mask-vector layout is refused before the target loads."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from speculators import SpeculatorModel, SpeculatorModelConfig

from models import dflash, vocab
from models.target_loaders import build_tiny_random
from tests.helpers import export_script
from train.core.checkpoint import save_checkpoint

torch.set_num_threads(1)
TOL = 1e-4
TARGET = {"_target_": "models.target_loaders.build_tiny_random", "seed": 0, "num_layers": 8,
          "device": "cpu"}  # fmt: skip
B = 4  # block size


@pytest.fixture(scope="module")
def target():
    return build_tiny_random(seed=0, num_layers=8, device="cpu")


def _checkpoint(run: Path, target, model: dict):
    """A run's checkpoint of a DFlash draft with every weight moved off its init."""
    counts = torch.randint(
        0, 1000, (target.vocab_size,), generator=torch.Generator().manual_seed(0)
    )
    torch.manual_seed(0)
    draft = dflash.from_target(
        target, counts, **{k: v for k, v in model.items() if k != "_target_"}
    )
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    run.mkdir()
    (run / "config.yaml").write_text(OmegaConf.to_yaml({"target": TARGET, "decode": {"k": 3}}))
    draft_yaml = OmegaConf.to_yaml({"kind": "dflash", "model": model})
    return save_checkpoint(run, 1, draft.state_dict(), draft_yaml, {}, 1), draft.eval()


def _ours(draft, target, seq: torch.Tensor, anchors: list[int]) -> torch.Tensor:
    """Our blocks at anchors a (the block reads the context j < a) -> logits [N, B, V_draft]."""
    T = seq.shape[0]
    with torch.no_grad():
        ctx = draft.context(target(seq[None], hidden_layers=draft.hidden_layers).hidden)
        kv = draft.context_kv(ctx, torch.arange(T)[None])
        a = torch.tensor([anchors])  # [1, N]
        embeds = target.embed_tokens(seq[None].gather(1, a))  # [1, N, H]
        ctx_mask = torch.arange(T)[None, None, :] < a[..., None]  # [1, N, T]
        h = draft.blocks(embeds, a, kv, ctx_mask)  # [1, N, B, H]
        return draft.logits(h, vocab.head_rows(target.lm_head.weight, draft.vocab_ids))[0]


def _library(out: Path, attn: str, target, seq: torch.Tensor, anchors: list[int]) -> torch.Tensor:
    """The library's own loader and anchored-block forward -> logits [N, B, V_draft]."""
    config = SpeculatorModelConfig.from_pretrained(str(out))
    config.transformer_layer_config._attn_implementation = attn  # its default is for GPUs
    model = SpeculatorModel.from_pretrained(str(out), config=config).eval()
    T = seq.shape[0]
    with torch.no_grad():
        o = target.model(seq[None], output_hidden_states=True)
        ids = sorted(model.target_layer_ids)  # captured walking the layers
        hidden = torch.cat([o.hidden_states[i] for i in ids], dim=-1)
        loss_mask = torch.zeros(1, T)
        loss_mask[0, anchors] = 1  # every valid position an anchor: all of them, in order
        _, logits, *_ = model._backbone_forward(
            hidden, seq[None], loss_mask, o.hidden_states[-1], torch.zeros(1, T, dtype=torch.long),
            torch.arange(T)[None], max_anchors=len(anchors),
        )  # fmt: skip
    return logits.view(len(anchors), B, -1)


@pytest.mark.parametrize("vocab_size", ["full", 32])
def test_speculators_library_gives_our_dflash_logits(target, verifier_dir, tmp_path, vocab_size):
    model = {"_target_": "models.dflash.from_target", "block_size": B, "num_layers": 2,
             "layers": [6, 1, 3], "num_anchors": None, "vocab_size": vocab_size,
             "mask_token_id": 5, "qk_norm": True}  # fmt: skip
    ckpt, draft = _checkpoint(tmp_path / "run", target, model)
    assert torch.equal(draft.mask_vector, target.embed_tokens.weight[5])  # frozen, the target's
    out = tmp_path / "s"
    export_script().main([str(ckpt), "--format", "speculators", "--out", str(out),
                           "--verifier", str(verifier_dir)])  # fmt: skip
    seq = torch.randint(6, target.vocab_size, (20,), generator=torch.Generator().manual_seed(3))
    anchors = [2, 7, 11, 15]  # the library leaves the last B positions out
    ours = _ours(draft, target, seq, anchors)
    for attn in ("eager", "sdpa"):
        lib = _library(out, attn, target, seq, anchors)
        assert lib.shape == ours.shape, (lib.shape, ours.shape)
        delta = (lib.log_softmax(-1) - ours.log_softmax(-1)).abs().max()
        assert delta <= TOL, f"{attn}: max |Δ log-softmax| {delta:.2e}"


def test_the_learned_mask_layout_is_refused_before_the_target_loads(target, tmp_path):
    model = {"_target_": "models.dflash.from_target", "block_size": B, "num_layers": 1,
             "layers": [3], "num_anchors": None}  # fmt: skip
    ckpt, _ = _checkpoint(tmp_path / "run", target, model)
    with pytest.raises(SystemExit, match="learned mask vector.*experiment=dflash_served_kl"):
        export_script().main([str(ckpt), "--format", "speculators", "--out", str(tmp_path / "x"),
                               "--verifier", "x"])  # fmt: skip
    assert not (tmp_path / "x").exists()
