"""Targets beyond Llama: the model's own logits (soft-capping, logit scaling), rope per layer
type, sliding-window layers under speculative decoding, and the whole pipeline (regenerate ->
train -> decode, chain and tree) for every draft kind on tiny Qwen3 and Gemma 3 targets."""

from pathlib import Path

import pytest
import torch
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

from decoding.drafters import make_drafter
from decoding.spec import generate
from decoding.tree import TreeSpec, generate_tree, tree_attention_mask
from models.target import Target
from models.target_loaders import build_tiny_random
from models.tiny_tokenizer import build_char_tokenizer
from tests.helpers import TINY_CPU_RUN, compose_train, write_rows

SMALL = {
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
}


def hf_target(model_cls, config) -> Target:
    torch.manual_seed(0)
    model = model_cls(config)
    with torch.no_grad():  # logits large enough for a transform to show
        model.get_output_embeddings().weight.normal_(0.0, 1.0)
    return Target(model, build_char_tokenizer(128), name=model_cls.__name__)


def with_transform(arch: str) -> Target:
    if arch == "cohere":  # logits * logit_scale
        return hf_target(CohereForCausalLM, CohereConfig(**SMALL, logit_scale=0.25))
    if arch == "granite":  # logits / logits_scaling
        return hf_target(GraniteForCausalLM, GraniteConfig(**SMALL, logits_scaling=4.0))
    return build_tiny_random(arch=arch, tie_word_embeddings=False, device="cpu")  # soft-capped


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "cohere", "granite"])
def test_target_logits_are_the_models_own(arch):
    target = with_transform(arch)
    ids = torch.tensor([[5, 40, 41, 42, 43, 44, 45, 46]])
    out = target(ids, hidden_layers=(-1,))
    torch.testing.assert_close(out.logits, target.model(ids).logits)
    # The transform is live here: the bare head would give another distribution.
    assert (target.lm_head(out.hidden[-1]) - out.logits).abs().max() > 0.1


def test_an_unknown_logit_transform_is_refused():
    class Doubled(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = 2 * out.logits
            return out

    model = Doubled(LlamaConfig(**SMALL))
    with pytest.raises(ValueError, match="transforms its logits.*Target.head_logits"):
        Target(model, build_char_tokenizer(128), name="doubled")


def test_drafts_get_the_rope_of_the_full_attention_layers():
    from models import draft_lm, eagle, mtp

    target = build_tiny_random(arch="gemma3", device="cpu")
    full = target.config.rope_parameters["full_attention"]
    assert full["rope_theta"] == 1e6 and full["rope_type"] == "linear"  # != the sliding layers'
    assert target.rope_kwargs()["rope_parameters"] == full
    configs = {
        "draft_lm": draft_lm.from_target(target, num_layers=1).causal_lm().config,
        "eagle3": eagle.from_target(target, vocab_size="full").config,
        "eagle1": eagle.from_target(target, style="eagle1", layers=[-1]).config,
        "mtp": mtp.from_target(target).block_config,
    }
    for kind, cfg in configs.items():
        assert cfg.rope_parameters["rope_theta"] == 1e6, kind
        assert cfg.rope_parameters["rope_type"] == "linear" and cfg.rope_parameters["factor"] == 2


@pytest.mark.parametrize("arch", ["gemma3", "cohere"])
def test_drafts_copy_the_final_norm_scale_not_gemmas_offset(arch):
    """Gemma's RMSNorm computes x * (1 + weight); Cohere's is a LayerNorm (subtracts the
    mean), so a constant probe would read its scale as zero."""
    from models import draft_lm, eagle, mtp

    if arch == "gemma3":
        target = build_tiny_random(arch="gemma3", device="cpu")
        with torch.no_grad():
            target.final_norm.weight.uniform_(-0.5, 0.5)
        scale = 1 + target.final_norm.weight
    else:
        target = with_transform("cohere")
        with torch.no_grad():
            target.final_norm.weight.uniform_(0.5, 1.5)
        scale = target.final_norm.weight
    torch.testing.assert_close(target.final_norm_weight, scale)
    torch.testing.assert_close(eagle.from_target(target, vocab_size="full").norm.weight, scale)
    torch.testing.assert_close(mtp.from_target(target).depths[0].final_norm.weight, scale)
    lm = draft_lm.from_target(target, num_layers=1).causal_lm()
    torch.testing.assert_close(lm.model.norm.weight, scale)


def test_tree_masks_keep_sliding_layers_inside_their_window():
    """Sliding-window layers (window 4) under a tree forward over a cache longer than the
    window: every node's logits equal a plain forward over the prompt + its root path."""
    target = build_tiny_random(arch="gemma3", sliding_window=4, device="cpu")
    prompt = torch.tensor([[5, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40]])  # [1, 12]
    past = target(prompt[:, :-1])  # the cache holds 11 > 4 positions
    # root = prompt[-1]; nodes 0,1 are its children, 2 is a child of 0, 3 a child of 2
    tokens, parents = torch.tensor([[50, 51, 52, 53]]), torch.tensor([[-1, -1, 0, 2]])
    depth = torch.tensor([[0, 1, 1, 2, 3]])  # root first
    out = target(
        torch.cat([prompt[:, -1:], tokens], 1),
        cache=past.cache,
        attention_mask=tree_attention_mask(parents, 11, None, target.dtype),
        position_ids=11 + depth,
    )
    paths = [[], [50], [51], [50, 52], [50, 52, 53]]
    for i, path in enumerate(paths):
        full = target.model(torch.cat([prompt, torch.tensor([path], dtype=torch.long)], 1))
        torch.testing.assert_close(out.logits[0, i], full.logits[0, -1], atol=1e-5, rtol=1e-5)


# -- the whole pipeline ------------------------------------------------------------------

KINDS = {  # small settings per draft kind; tree: what its drafter proposes (None: chains only)
    "draft_lm": (["draft=draft_lm", "draft.model.num_layers=1"], None),
    "medusa": (["draft=medusa", "draft.model.num_heads=2"], "static"),
    "eagle": (["draft=eagle", "draft.model.ttt_steps=2", "draft.model.vocab_size=64"], "dynamic"),
    "eagle1": (["draft=eagle1"], "dynamic"),
    "mtp": (["draft=mtp", "draft.model.num_depths=2"], None),
}
ARCHS = {  # qwen3 with its tokenizer's template; gemma3 as a base model (no template): plain
    "qwen3": ["target.arch=qwen3"],
    "gemma3": [
        "target.arch=gemma3",
        "target.sliding_window=8",
        "target.tie_word_embeddings=false",  # a tied x8 head only copies its input
        "target.chat_template=false",
        "data.chat_template=plain",
    ],
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """Chats in a local file (smaller than the embedded corpus, so quicker to build) and the
    regeneration cache, shared by the draft kinds: one regeneration per arch."""
    root = tmp_path_factory.mktemp("data")
    topics = ["rivers", "prime numbers", "bread", "the moon", "chess", "rain", "owls", "glass"]
    rows = [
        {"messages": [{"role": "user", "content": f"Tell me about {t} in a few words."},
                      {"role": "assistant", "content": "Ok."}]}
        for t in topics
    ]  # fmt: skip
    write_rows(root / "chats.jsonl", rows)
    return root


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_pipeline_on_other_architectures(tmp_path, data_dir, arch, kind):
    from hydra.utils import instantiate

    from train.core.checkpoint import load_draft
    from train.data.chat import resolve_chat_template
    from train.loop import run

    overrides, tree_kind = KINDS[kind]
    cfg = compose_train(
        *TINY_CPU_RUN, "name=arch",
        f"run_dir={tmp_path}", f"data.source={data_dir / 'chats.jsonl'}",
        f"data.cache_dir={data_dir}", "data.num_eval=0", "data.max_new_tokens=8",
        "train.steps=2", "train.batch_size=2", "train.ckpt_every=2",
        "train.eval_at_ckpt=false", *ARCHS[arch], *overrides,
    )  # fmt: skip
    summary = run(cfg)
    assert summary["steps"] == 2

    target = instantiate(cfg.target)  # the same seeded target the run trained on
    draft = load_draft(summary["last_checkpoint"], target).eval()
    template = resolve_chat_template(target.tokenizer, cfg.data.chat_template)
    msgs = [{"role": "user", "content": "Write a haiku about a sliding window, please."}]
    prompt = torch.tensor(
        [target.tokenizer.apply_chat_template(msgs, chat_template=template, return_dict=False,
                                              add_generation_prompt=True)]
    )  # fmt: skip
    if arch == "gemma3":  # the sliding layers' window is passed during decoding
        assert prompt.shape[1] > 3 * target.config.sliding_window
    want = target.model.generate(prompt, max_new_tokens=16, do_sample=False)[0, prompt.shape[1] :]
    drafter = make_drafter(draft, target)
    chain = generate(target, prompt, drafter, k=3, max_new_tokens=16)
    assert chain.sequences[0] == want.tolist()  # lossless: the model's own greedy output
    if tree_kind is not None:
        spec = TreeSpec(kind=tree_kind, depth=2, top_k=2, num_nodes=4, paths=((0,), (1,), (0, 0)))
        tree = generate_tree(target, prompt, drafter, spec, max_new_tokens=16)
        assert tree.sequences[0] == want.tolist()
