"""Helpers shared by the test files (`from tests.helpers import ...`): composing the training
config, reading a run's metrics, the tiny target with an untied head and drafts made from
it, chat prompts, the exact-distribution G-test of speculative sampling, and local chat
data files. Fixtures shared by several files are in tests/conftest.py."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
from pathlib import Path

import datasets
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from scipy.stats import chi2
from transformers import GenerationConfig

from decoding.drafter import Sampling
from decoding.verify import sampling_probs
from models.target import Target
from models.target_loaders import build_tiny_random

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
DEVICE = os.environ.get("DRAFTLAB_TEST_DEVICE", "cpu")  # scripts/gpu_check.sh sets cuda
V = 128  # the tiny target's vocabulary
NO_EOS: list[int] = []
PROMPTS = ["hello there", "write a poem about the sea", "Q: capital of France?"]

# The tiny random target, its tiny data, no logger, on the CPU, decoding in a fixed dtype
# (not auto: a test's outcome must not depend on the machine): a run small enough for a test.
# Fixed dtypes, not auto: the tests' outcomes must not depend on the machine.
TINY_CPU_RUN = ("target=tiny_random", "data=tiny", "logger=none", "device=cpu", "decode.dtype=bf16",
                "decode.draft_dtype=bf16", "decode.same_dtype_ar=true", "train.bf16=false")  # fmt: skip


# -- configs and run directories ---------------------------------------------------------


def export_script():
    """scripts/export.py as a module: its `main(argv)` runs the export as the command does."""
    spec = importlib.util.spec_from_file_location("export_script", ROOT / "scripts" / "export.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def compose_train(*overrides: str) -> DictConfig:
    """conf/train.yaml with `overrides`, as `python train.py <overrides>` composes it."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def compose_debug(run_dir: Path, *overrides: str) -> DictConfig:
    """The debug experiment (conf/experiment/debug.yaml) writing to `run_dir`."""
    return compose_train("+experiment=debug", f"run_dir={run_dir}", *overrides)


def metrics_records(run_dir: Path) -> list[dict]:
    """Every record of a run's metrics.jsonl, in order (train and eval lines)."""
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


# -- the tiny target, drafts made from it, prompts ---------------------------------------


def untied_target(seed: int = 0, device: str = DEVICE) -> Target:
    """build_tiny_random's greedy output is one token repeated (its tied, x8 embeddings make
    it copy its input); an untied random head gives varied text and a spread distribution."""
    target = build_tiny_random(seed=seed, vocab_size=V, device="cpu")
    model = target.model
    g = torch.Generator().manual_seed(1000 + seed)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(
        torch.randn(V, 64, generator=g) * 0.5, requires_grad=False
    )
    with torch.no_grad():
        model.get_input_embeddings().weight.div_(8.0)
    return target.to(device)


def noisy_copy(model: torch.nn.Module, noise: float, seed: int = 7) -> torch.nn.Module:
    """A draft LM that mostly agrees with the target: its head plus Gaussian noise."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = draft.lm_head.weight
        draft.lm_head.weight = torch.nn.Parameter(
            w + noise * torch.randn(w.shape, generator=g).to(w), requires_grad=False
        )
    return draft


def shifted_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A draft whose logits are the target's rolled by one id: its argmax is never the target's."""
    draft = copy.deepcopy(model)
    with torch.no_grad():
        draft.lm_head.weight = torch.nn.Parameter(
            draft.lm_head.weight.roll(1, 0), requires_grad=False
        )
    return draft


def chat_ids(target: Target, text: str) -> list[int]:
    """One user turn in the target's chat template, with the generation prompt."""
    return target.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )["input_ids"]


def prompt_ids(target: Target, text: str) -> torch.Tensor:
    """chat_ids as a [1, T] tensor on the test device."""
    return torch.tensor([chat_ids(target, text)], device=DEVICE)


def hf_greedy(target: Target, ids: torch.Tensor, n: int, eos: list[int]) -> list[int]:
    """Reference: transformers' own greedy decoding of one unpadded prompt."""
    cfg = GenerationConfig(
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=0,
        eos_token_id=eos or None,
        pad_token_id=target.tokenizer.pad_token_id,
    )
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    return out[0, ids.shape[1] :].tolist()


def greedy_tokens(target: Target, prompt: list[int], n: int) -> list[int]:
    """Reference: plain argmax decoding through the Target wrapper, no cache, no batch."""
    ids = list(prompt)
    for _ in range(n):
        nxt = int(target(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax())
        ids.append(nxt)
        if nxt in target.eos_token_ids:
            break
    return ids[len(prompt) :]


def left_pad(
    rows: list[torch.Tensor], pad: int, device: str = DEVICE
) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, T_i] prompts -> left-padded ids [B, T] and attention mask [B, T] (1 = real)."""
    T = max(r.shape[1] for r in rows)
    ids = torch.full((len(rows), T), pad, device=device)
    mask = torch.zeros((len(rows), T), dtype=torch.long, device=device)
    for b, r in enumerate(rows):
        ids[b, T - r.shape[1] :] = r[0]
        mask[b, T - r.shape[1] :] = 1
    return ids, mask


# -- sampling is lossless: G-test of the first three tokens against the exact distribution --

N_SINGLE = 400  # samples drawn one generate call each
P_THRESHOLD = 1e-3  # seeded, so deterministic; a correct sampler fails this 0.1% of seeds


def exact_triples(target: Target, ids: torch.Tensor, sampling: Sampling, min_p: float) -> dict:
    """P(t1, t2, t3) for every triple with probability >= min_p, from batched forwards."""
    p1 = sampling_probs(target(ids).logits[0, -1], sampling)  # [V]
    seq1 = torch.cat([ids.expand(V, -1), torch.arange(V, device=DEVICE)[:, None]], 1)  # [V, T+1]
    pair = p1[:, None] * sampling_probs(target(seq1).logits[:, -1], sampling)  # [V, V]
    idx = (pair >= min_p).nonzero()  # [P, 2]
    seq2 = torch.cat([ids.expand(len(idx), -1), idx], 1)  # [P, T+2]
    p3 = sampling_probs(target(seq2).logits[:, -1], sampling)  # [P, V]
    joint = pair[idx[:, 0], idx[:, 1]][:, None] * p3  # [P, V]
    table = {}
    for (a, b), row in zip(idx.tolist(), joint.tolist()):
        for c, p in enumerate(row):
            if p >= min_p:
                table[(a, b, c)] = p
    return table


def g_test(samples: list[tuple[int, int, int]], table: dict) -> float:
    """p-value of the G-test of `samples` against `table` (exact_triples), the triples below
    its min_p pooled into one bin."""
    counts = dict.fromkeys(table, 0)
    other = 0
    for s in samples:
        if s in counts:
            counts[s] += 1
        else:
            other += 1
    n = len(samples)
    observed = list(counts.values()) + [other]
    expected = [n * p for p in table.values()] + [n * (1 - sum(table.values()))]
    g = 2 * sum(o * torch.tensor(o / e).log().item() for o, e in zip(observed, expected) if o > 0)
    return float(chi2.sf(g, df=len(observed) - 1))


# -- local chat data -----------------------------------------------------------------------


def trained_text(tokenizer, ids: list[int], loss_mask: list[int]) -> str:
    """The tokens position t is trained to predict: input_ids[t+1] where loss_mask[t]."""
    return tokenizer.decode([ids[t + 1] for t in range(len(ids) - 1) if loss_mask[t]])


def write_rows(path: Path, rows: list[dict]) -> Path:
    """Rows as a .parquet file or, for any other suffix, JSON lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sharegpt_row(i: int, answer: str | None) -> dict:
    """A ShareGPT-style row asking "question i?", answered unless `answer` is None."""
    turns = [{"from": "human", "value": f"question {i}?"}]
    return {"conversations": turns + ([{"from": "gpt", "value": answer}] if answer else [])}


def openai_row(i: int, answer: str | None) -> dict:
    """An OpenAI-messages row asking "question i?", answered unless `answer` is None."""
    turns = [{"role": "user", "content": f"question {i}?"}]
    return {"messages": turns + ([{"role": "assistant", "content": answer}] if answer else [])}


# Key endings of an evaluation record that are wall-clock figures (tokens/s, speedups against
# each AR, per-round ms, time shares, the loop's efficiency) or timed verdicts (the ARs' and
# the copies' dtypes), and the seconds of a run: they differ between any two evaluations;
# every other metric must not.
TIMING = ("tokens_per_s", "speedup", "_ratio", "_ms", "_share", "_ar", "_ar_dtype",
          "_efficiency", "dtypes", "eval_s", "train_s")  # fmt: skip
