"""Device placement without a GPU: every draft kind is built, trains (forward, the training
step's losses, backward) and decodes (every drafter's prefill, propose and commit, chain and
tree where it drafts trees, greedy and sampled, one prompt and a left-padded batch) with
target and draft on a device other than the CPU, `tests/fake_device.py`: a device that
computes with the CPU, where an operation mixing it with CPU tensors raises as on CUDA and,
inside a training step or a decode, so does any copy of a CPU tensor to it (a tensor left on
the CPU: a host copy per step on CUDA). Its values are the CPU's, so each run must also give
exactly the CPU run's gradients and tokens: the harness changes placement, nothing else.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from omegaconf import OmegaConf

from decoding.drafter import Sampling
from decoding.drafters import make_drafter
from decoding.drafters.ngram import NgramDrafter
from decoding.spec import generate
from decoding.tree import TreeSpec
from models import dflash, domino, draft_lm, eagle, medusa, mtp
from tests.fake_device import DEVICE, OnDevice, fake_device
from tests.helpers import TINY_CPU_RUN, V, compose_train, left_pad, untied_target
from train.core.step import StepStats, aux_loss, offset_losses
from train.core.step_stats import decode_samplings
from train.run import setup as run_setup
from train.run.settings import gpu_index, tracking_settings

torch.set_num_threads(1)  # tiny models crawl with more threads than free cores (design.md §6)

DYNAMIC = TreeSpec(kind="dynamic", depth=3, top_k=2, num_nodes=5)
STATIC = TreeSpec(paths=((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))
COUNTS = torch.arange(V, 0, -1).float()  # training label counts: the reduced vocabularies
DRAFTS = {  # kind -> (build from a target, the tree its drafter drafts or None)
    "draft_lm": (lambda t: draft_lm.from_target(t, num_layers=1), None),
    "eagle3": (lambda t: eagle.from_target(t, COUNTS, ttt_steps=2, vocab_size=32), DYNAMIC),
    "eagle1": (
        lambda t: eagle.from_target(
            t, None, style="eagle1", ttt_steps=2, vocab_size="full", feature_loss_weight=0.5
        ),
        DYNAMIC,
    ),
    "medusa": (lambda t: medusa.from_target(t, num_heads=3, head_init="copy"), STATIC),
    "medusa2": (lambda t: medusa.from_target(t, num_heads=2, medusa2=True, lora_rank=2), STATIC),
    "mtp": (lambda t: mtp.from_target(t, num_depths=2), None),
    "dflash": (
        lambda t: dflash.from_target(t, COUNTS, block_size=4, layers=[1, 2], vocab_size=48),
        DYNAMIC,
    ),
    "domino": (
        lambda t: domino.from_target(
            t, block_size=4, layers=[1, 2], gru_hidden_size=16, correction_size=16
        ),
        DYNAMIC,
    ),
}


def build(kind: str, device: torch.device):
    """The tiny target and a seeded draft of `kind`, both on `device` before the draft is
    built (as the loop builds it: from a target already placed)."""
    target = untied_target(device="cpu").to(device)
    torch.manual_seed(0)
    return target, DRAFTS[kind][0](target)


def batch() -> dict:
    """Two rows, the second right-padded, answers from position 4 on."""
    ids = torch.randint(3, V, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    loss_mask = mask.clone()
    loss_mask[:, :4] = 0
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}


def train_grads(kind: str, device: torch.device, strict) -> dict:
    """One training step's forward and backward as train/core/step.py's train_step runs them
    (its autocast aside) -> the gradient of every trained parameter, on the CPU."""
    target, draft = build(kind, device)
    b = {key: x.to(device) for key, x in batch().items()}
    cfg = OmegaConf.create({
        "train": {"offset_decay": 0.8}, "loss": {"name": "kl", "temperature": 1.0},
        "decode": {"temperatures": [0.0, 0.7], "top_k": 0, "top_p": 1.0},
    })  # fmt: skip
    with strict():
        torch.manual_seed(2)  # DFlash / Domino sample their anchors
        with torch.no_grad():
            t_out = target(b["input_ids"], attention_mask=b["attention_mask"],
                           hidden_layers=tuple(draft.hidden_layers), use_cache=False)  # fmt: skip
        out = draft(target, b["input_ids"], t_out, b["attention_mask"], b["loss_mask"])
        setup = run_setup.step_setup(cfg, out.offsets, decode_samplings(**cfg.decode))
        counts = torch.stack([b["loss_mask"][:, off:].sum() for off in out.offsets]).float()
        stats = StepStats.zeros(len(out.offsets), len(setup.samplings), device)
        loss = offset_losses(out, t_out.logits, b, counts, setup, stats)
        aux = aux_loss(out, t_out.logits, b["attention_mask"])
        (loss if aux is None else loss + aux).backward()
    grads = {n: p.grad for n, p in draft.named_parameters() if p.requires_grad}
    assert grads and all(g is not None and g.device == device for g in grads.values())
    return {n: g.to("cpu") for n, g in grads.items()}


def decode(kind: str | None, device: torch.device, strict) -> list:
    """The decodes of one drafter: a chain greedy on one prompt and sampled on a left-padded
    batch of two, the same for a tree if it drafts trees (sampled on the prompt, greedy on
    the batch) -> their tokens, accept counts and draft lengths."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, V, (1, n), generator=g) for n in (7, 10)]
    if kind is None:  # prompt lookup, no model
        target, tree = untied_target(device="cpu").to(device), None
        drafter = NgramDrafter(max_ngram=2, vocab_size=V)
    else:
        (target, draft), tree = build(kind, device), DRAFTS[kind][1]
        target = draft.eval().decoding_target(target)  # Medusa-2: its adapted target
        drafter = make_drafter(draft, target)
    one, batch = (prompts[0], None), left_pad(prompts, 0, "cpu")
    cases = [(None, 0.0, one), (None, 1.0, batch)]
    if tree is not None:
        cases += [(tree, 1.0, one), (tree, 0.0, batch)]
    results = []
    for shape, temperature, (ids, mask) in cases:
        ids, mask = ids.to(device), None if mask is None else mask.to(device)
        torch.manual_seed(4)  # sampled decodes draw from the default generator
        with strict(), torch.no_grad():
            out = generate(
                target, ids, drafter, k=3, sampling=Sampling(temperature=temperature),
                max_new_tokens=10, eos_token_ids=[], attention_mask=mask, tree=shape,
            )  # fmt: skip
        results.append((out.sequences, out.accept_counts, out.draft_lens))
    return results


@pytest.mark.parametrize("kind", list(DRAFTS))
def test_training_step_on_a_device(kind):
    """The draft is built from a target on the device, its training forward, losses and
    backward run there without touching a CPU tensor, and the gradients equal the CPU run's."""
    cpu = train_grads(kind, torch.device("cpu"), nullcontext)
    with fake_device() as dev:
        on_device = train_grads(kind, DEVICE, dev.strict)
    assert on_device.keys() == cpu.keys()
    for name, grad in cpu.items():  # the attention kernel is chosen per device: not bitwise
        scale = float(grad.abs().max())  # float32 rounding, relative to the gradient's size
        torch.testing.assert_close(on_device[name], grad, rtol=0, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize("kind", [*DRAFTS, None])
def test_drafter_steps_on_a_device(kind):
    """Every drafter's prefill / propose / commit (trees too) and the decoding loops run on
    the device without touching a CPU tensor, and decode exactly the CPU run's tokens."""
    cpu = decode(kind, torch.device("cpu"), nullcontext)
    with fake_device() as dev:
        assert decode(kind, DEVICE, dev.strict) == cpu


def test_the_fake_device_raises_where_cuda_does():
    """The harness itself: mixing with a CPU tensor raises, a CPU 0-dim tensor does not, a
    host copy raises in strict mode only, and values are the CPU's."""
    with fake_device() as dev:
        x = torch.arange(6.0).to(DEVICE)
        assert isinstance(x, OnDevice) and x.device == DEVICE
        assert (x * torch.tensor(2.0)).tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
        with pytest.raises(RuntimeError, match="same device"):
            x + torch.ones(6)
        with pytest.raises(RuntimeError, match="same device"):
            torch.randn(6) * x.sum()  # a CPU tensor times a device scalar
        with dev.strict():
            assert torch.zeros(2, device=DEVICE).sum().item() == 0.0  # made there: fine
            with pytest.raises(RuntimeError, match="host-to-device copy"):
                torch.ones(3).to(DEVICE)
        assert x[torch.tensor([1, 2])].tolist() == [1.0, 2.0]  # CPU indices, as on CUDA


def test_device_cuda_n_is_honoured_or_refused(monkeypatch):
    """accelerate puts a single process on "cuda", the current GPU: device=cuda:N makes GPU N
    current before the Accelerator exists; a GPU this machine lacks, CUDA missing, or cuda:N
    under a multi-process launch (rank i runs on cuda:i) is refused with the reason."""
    set_to = []
    monkeypatch.setattr(torch.cuda, "set_device", set_to.append)
    monkeypatch.setattr(run_setup, "Accelerator", lambda **kwargs: kwargs)  # no CUDA here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run = [o for o in TINY_CPU_RUN if not o.startswith("device=")]
    cfg = compose_train(*run, "device=cuda:1")
    run_setup.make_accelerator(cfg, tracking_settings(cfg))
    assert set_to == [1]
    assert gpu_index("cuda", 1) is None and gpu_index("cpu", 1) is None
    with pytest.raises(ValueError, match="has 2 GPU"):
        gpu_index("cuda:2", 1)
    with pytest.raises(ValueError, match="launch runs 2 processes"):
        gpu_index("cuda:1", 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        gpu_index("cuda:0", 1)
