"""The real speculators library (PyPI `speculators`, pure Python; scripts/setup.sh installs it
with --no-deps so it never replaces our transformers / torch) reads our `speculators` export
as we mean it: `scripts/export.py CKPT --format speculators --out DIR`, then the library's own
loader (`SpeculatorModel.from_pretrained(DIR)`) on DIR, fed the target's taps the way vLLM
captures them (walking the layers, so ascending), gives our draft's logits

  - teacher-forced, at every position and every unroll step (its training-time forward), and
  - along the decoder's own chain (greedy proposals, and the q of a sampled chain),

within max |Δ log-softmax| <= 1e-4, with no argmax flip outside near-ties, for sdpa and eager
attention; one case trains on non-default taps listed out of order. The verifier is the tiny
target saved to a directory (the library reads its config and final norm from there); marked
slow, the embedded SmolLM2 with taps [27, 2, 15] and its converted directory as verifier."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from speculators import SpeculatorModel, SpeculatorModelConfig

from decoding.drafter import Sampling
from decoding.drafters import make_drafter
from models import eagle
from models.target_loaders import build_tiny_random, convert_smollm2, load_smollm2
from tests.helpers import export_script
from train.core.checkpoint import save_checkpoint
from train.formats.export import export

torch.set_num_threads(1)

TOL = 1e-4  # max |Δ log-softmax|, and the log-probability gap below which top tokens tie
TARGET = {"_target_": "models.target_loaders.build_tiny_random", "seed": 0, "num_layers": 8,
          "device": "cpu"}  # fmt: skip
K = 5  # the run's decode.k: the export's speculative_tokens (ttt_steps is 3)


@pytest.fixture(scope="module")
def target():
    return build_tiny_random(seed=0, num_layers=8, device="cpu")


def _checkpoint(run: Path, target, layers, vocab_size, train_head, norms=None):
    """A run's checkpoint of an EAGLE-3 head with every weight moved off its init; `norms`:
    EAGLE-3.1's options."""
    model = {"_target_": "models.eagle.from_target", "layers": layers, "ttt_steps": 3,
             "vocab_size": vocab_size, "train_head": train_head, "init": "random",
             **(norms or {})}  # fmt: skip
    counts = torch.randint(
        0, 1000, (target.vocab_size,), generator=torch.Generator().manual_seed(0)
    )
    torch.manual_seed(0)
    kwargs = {k: v for k, v in model.items() if k != "_target_"}
    draft = eagle.from_target(target, counts, **kwargs)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    run.mkdir()
    (run / "config.yaml").write_text(OmegaConf.to_yaml({"target": TARGET, "decode": {"k": K}}))
    draft_yaml = OmegaConf.to_yaml({"kind": "eagle", "model": model})
    return save_checkpoint(run, 1, draft.state_dict(), draft_yaml, {}, 1), draft.eval()


def _library(out: Path, attn: str) -> SpeculatorModel:
    """The library's own loader; only the attention kernel is chosen (its default,
    flex attention, is for GPUs)."""
    config = SpeculatorModelConfig.from_pretrained(str(out))
    config.transformer_layer_config._attn_implementation = attn
    return SpeculatorModel.from_pretrained(str(out), config=config).eval()


def _library_logits(model, target, seq: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The library's training-time forward over one sequence [T]: step s at position t reads
    the token t + 1 + s (teacher forcing); its logits per step [T, V_draft], caught at lm_head.
    The taps are concatenated as vLLM captures them: walking the layers (ascending)."""
    out = target.model(seq[None], output_hidden_states=True)
    ids = set(model.target_layer_ids)
    hidden = torch.cat([h for i, h in enumerate(out.hidden_states) if i in ids], dim=-1)
    T = seq.shape[0]
    caught = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: caught.append(o[0]))
    try:
        model(
            hidden_states=hidden,
            input_ids=torch.cat([seq[1:], seq.new_zeros(1)])[None],  # the token after each t
            document_ids=torch.zeros(1, T, dtype=torch.long),
            position_ids=torch.arange(T)[None],
            ttt_steps=steps,
        )
    finally:
        hook.remove()
    return caught


def _same_argmax(lib: torch.Tensor, ours: torch.Tensor, what: str) -> None:
    """Where the argmaxes differ, the library's pick is within TOL of our best (a tie)."""
    lo = ours.log_softmax(-1)
    pick = lib.argmax(-1, keepdim=True)
    gap = lo.max(-1).values - lo.gather(-1, pick)[..., 0]
    assert (gap <= TOL).all(), f"{what}: argmax flips with log-prob gaps up to {gap.max():.2e}"


EAGLE31 = ("norm_before_fc", "fc_norm", "norm_output")  # EAGLE-3.1's options


@pytest.mark.parametrize(
    "layers,vocab_size,train_head,norms",
    [
        (None, 32, False, None),  # default taps
        ([6, 1, 3], "full", True, None),  # unsorted non-default taps
        (None, 32, False, {"norm_before_fc": True, "norm_output": True}),  # speculators' default
        ([6, 1, 3], 32, False, {"fc_norm": True, "norm_output": True}),  # the 3.1 paper's
    ],
)
def test_speculators_library_gives_our_logits(
    target, verifier_dir, tmp_path, layers, vocab_size, train_head, norms
):
    script = export_script()
    ckpt, draft = _checkpoint(tmp_path / "run", target, layers, vocab_size, train_head, norms)
    with pytest.raises(SystemExit, match="pass --verifier ID"):  # the tiny target has no hub id
        script.main([str(ckpt), "--format", "speculators", "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()
    out = tmp_path / "s"
    script.main([str(ckpt), "--format", "speculators", "--out", str(out),
                 "--verifier", str(verifier_dir)])  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    spec = config["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == K
    assert spec["verifier"]["name_or_path"] == str(verifier_dir)
    for flag in EAGLE31:  # EAGLE-3.1's options as written
        assert config[flag] is bool((norms or {}).get(flag)), flag
    if norms:  # and read back into a draft built with them: the same weights
        from train.run.init_from import InitError, init_draft_from

        counts = torch.ones(target.vocab_size)
        back = eagle.from_target(target, counts, layers=layers, ttt_steps=3, vocab_size=vocab_size,
                                 init="random", **norms)  # fmt: skip
        served = tmp_path / "served_as_ours"  # its verifier named as our loader names it
        shutil.copytree(out, served)
        config["speculators_config"]["verifier"]["name_or_path"] = target.name
        (served / "config.json").write_text(json.dumps(config))
        init_draft_from(served, back, target)
        mine = draft.state_dict()
        assert all(torch.equal(v, mine[k]) for k, v in back.state_dict().items()), "read back"
        plain = eagle.from_target(target, counts, layers=layers, ttt_steps=3,
                                  vocab_size=vocab_size, init="random")  # fmt: skip
        with pytest.raises(InitError, match="set draft.model.norm_before_fc="):
            init_draft_from(served, plain, target)
        with pytest.raises(SystemExit, match="cannot say: SGLang"):
            script.main([str(ckpt), "--format", "eagle", "--out", str(tmp_path / "e")])

    seqs = torch.randint(6, target.vocab_size, (2, 14), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = draft(target, seqs, target(seqs, hidden_layers=draft.hidden_layers)).logits
    P = 10  # prompt length of the decoder's chain
    prompt, last = seqs[:, :P], seqs[:, P]
    chains = {}
    for name, sampling in (("greedy", Sampling()), ("sampled", Sampling(temperature=1.0))):
        drafter = make_drafter(draft, target)
        drafter.prefill(prompt, target(prompt, hidden_layers=draft.hidden_layers))
        chains[name] = drafter.propose(last, K, sampling, torch.Generator().manual_seed(0))
    ids = draft.vocab_ids()
    draft_ids = ids if ids is not None else torch.arange(target.vocab_size)  # draft id -> target id

    for attn in ("sdpa", "eager"):
        model = _library(out, attn)
        assert torch.equal(model.embed_tokens.weight, target.embed_tokens.weight)
        for b in range(seqs.shape[0]):
            with torch.no_grad():
                lib = _library_logits(model, target, seqs[b], steps=3)
            for s in range(3):  # teacher-forced: every position, every unroll step
                what = f"{attn}, row {b}, step {s}"
                delta = (lib[s].log_softmax(-1) - ours[s][b].log_softmax(-1)).abs().max()
                assert delta <= TOL, f"{what}: max |Δ log-softmax| {delta:.2e}"
                _same_argmax(lib[s], ours[s][b], what)
            for name, (tokens, q) in chains.items():  # the decoder's chain from position P-1
                seq = torch.cat([prompt[b], last[b : b + 1], tokens[b, :-1]])
                with torch.no_grad():
                    lib = [lg[P - 1] for lg in _library_logits(model, target, seq, steps=K)]
                for s in range(K):
                    what = f"{attn}, row {b}, {name} chain step {s}"
                    lib_log = lib[s].log_softmax(-1)
                    if q is None:  # greedy: the library's pick is our proposal, bar ties
                        ours_id = (draft_ids == tokens[b, s]).nonzero()[0, 0]
                        gap = lib_log.max() - lib_log[ours_id]
                        assert gap <= TOL, f"{what}: proposes another token (gap {gap:.2e})"
                    else:  # sampled: the library's distribution is the q we drew from
                        delta = (lib_log - q[b, s, draft_ids].log()).abs().max()
                        assert delta <= TOL, f"{what}: max |Δ log q| {delta:.2e}"


@pytest.mark.slow
def test_speculators_library_gives_our_logits_smollm2(tmp_path):
    """The embedded target, taps trained out of order; its converted directory is the verifier."""
    target = load_smollm2(dtype="float32", device="cpu")
    torch.manual_seed(0)
    draft = eagle.from_target(target, torch.ones(target.vocab_size), layers=[27, 2, 15],
                              ttt_steps=3, vocab_size=4096)  # fmt: skip
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    export(draft.eval(), target, "speculators", tmp_path / "s", verifier=str(convert_smollm2()),
           speculative_tokens=4)  # fmt: skip
    seq = torch.randint(6, target.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = draft(target, seq, target(seq, hidden_layers=draft.hidden_layers)).logits
        lib = _library_logits(_library(tmp_path / "s", "sdpa"), target, seq[0], steps=3)
    for s in range(3):
        delta = (lib[s].log_softmax(-1) - ours[s][0].log_softmax(-1)).abs().max()
        assert delta <= TOL, f"step {s}: max |Δ log-softmax| {delta:.2e}"
        _same_argmax(lib[s], ours[s][0], f"step {s}")
