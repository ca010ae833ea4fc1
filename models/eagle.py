"""EAGLE feature heads in the layout serving engines load: EAGLE-3 (Li et al., 2025; vLLM
`llama_eagle3.py`, SGLang `llama_eagle3.py`, speculators `Eagle3DraftModel`, SpecForge
`LlamaForCausalLMEagle3`) and EAGLE-1 (Li et al., 2024; vLLM `llama_eagle.py`).

One decoder layer that runs autoregressively in the target's feature space. Inputs at
position t: a feature g_t and the embedding e = emb(x_{t+1}) of the NEXT token.

EAGLE-3 (`style="eagle3"`, draft=eagle):
    g   = fc(cat(h_low, h_mid, h_high))                 # Linear(3H->H), no bias, raw taps
    x   = cat(input_layernorm(e), hidden_norm(g))       # [.., 2H], embedding FIRST
    h   = g + o_proj(attn(q/k/v_proj(x)))               # q/k/v take 2H; residual = raw g
    h   = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))                           # over the draft vocabulary (d2t/t2d)
  `norm_before_residual` = false (the residual is g, not hidden_norm(g)). The next step's
  feature is h itself (pre-norm), as in every engine. EAGLE-3.1 (speculators' and
  SpecForge's options, served by speculators and recent vLLM): `norm_before_fc` (one RMSNorm
  over cat(taps), `input_norm`), `fc_norm` (one per tap, `fc_norm.i`), `norm_output` (the
  next step's feature is norm(h), and logits = lm_head(that)); with a norm before fc the
  tap scale below stays 1 (a norm undoes any scale).
EAGLE-1 (`style="eagle1"`, draft=eagle1):
    x   = fc(cat(e, f_t))                               # Linear(2H->H), no bias, embedding first
    h   = x + o_proj(attn(x))                           # no input_layernorm (vLLM: Identity)
    h   = h + mlp(post_attention_layernorm(h))
    logits = target lm_head(h)                          # no final norm, full vocabulary
  f_t is the target's last hidden state after the final norm (layer -1); aux loss =
  feature_loss_weight * SmoothL1(h, f_{t+1}).
Parameter names follow the served state_dict: `fc`, `layers.0.{input_layernorm, hidden_norm,
self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}`, `norm`,
`lm_head` (train_head only), `d2t`, `t2d` (train/formats/ writes and reads them).

Tap scale (EAGLE-3). The taps are raw residual streams of very different sizes (SmolLM2:
per-token RMS 3.0 / 6.7 / 21 at hidden_states 2 / 15 / 27) and engines fuse them raw, so
`fc` sees each tap times a FIXED power of two `tap_scale[i]` ~ 1 / its median RMS
(models/eagle_init.py: measure_tap_scale), folded into the served fc weight at export: unit
taps in training, the plain layout served.

Training-time test (unroll `ttt_steps` = n): step s at anchor t sits at position t+s,
reads the draft's OWN hidden of step s-1 at t and the true token emb(x_{t+s+1}) (teacher
forcing), predicts x_{t+s+2} (offset s+1), and attends to step-0 keys at positions <= t plus
the keys of steps 1..s at t: the draft's KV cache at decode time after t was verified and s
tokens drafted. Built with HF's DynamicCache (all steps' keys, [B, kv, (s+1)T, D]) and a
boolean mask [B, 1, T, (s+1)T]: causal block for step 0, identity blocks for steps 1..s.

Reduced vocabulary (EAGLE-3): the N most frequent trained target tokens, `d2t` / `t2d`
buffers (models/vocab.py, "offsets" layout); `vocab_size="full"` keeps the full head.

Frozen pieces: embedding and output head are read from `target` at call time (not trained,
not in the checkpoint); the reduced head is the target's lm_head rows at the draft ids.
`train_head=True` gives a trained copy of those rows instead. The layer's config copies
hidden size, heads, intermediate size, rope settings and max_position_embeddings from the
target. The default taps, tap scale and identity init are in models/eagle_init.py, the
vocabulary map in models/vocab.py; the decoder's drafter is decoding/drafters/eagle.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from models import vocab
from models.eagle_init import (
    default_eagle3_layers,
    identity_init,
    measure_tap_scale,
    target_layer_init,
)
from models.eagle_layer import EagleLayer
from models.protocol import DraftOutput
from models.target import Target, TargetOutput

STYLES = ("eagle1", "eagle3")
# Top-level names of the layout before the served one (issue #16): such a checkpoint cannot
# be mapped onto this module (q/k/v had H inputs after an `input_proj`).
INITS = ("identity", "target_layer", "random")
PRE_SERVED_KEYS = ("fuse", "input_proj", "layer", "feature_norm", "embed_norm")


class EagleDraft(nn.Module):
    kind = "eagle"

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        intermediate_size: int,
        target_vocab_size: int,
        max_position_embeddings: int,
        rope_parameters: dict,
        rms_norm_eps: float = 1e-5,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        hidden_layers: tuple[int, ...] = (-1,),
        style: str = "eagle3",
        ttt_steps: int = 7,
        draft_vocab_size: int | None = None,  # None = full target vocabulary
        feature_loss_weight: float = 0.0,
        train_head: bool = False,
        norm_before_fc: bool = False,  # EAGLE-3.1 options (module docstring)
        fc_norm: bool = False,
        norm_output: bool = False,
    ):
        super().__init__()
        if norm_before_fc and fc_norm:  # as speculators refuses them together
            raise ValueError("norm_before_fc and fc_norm exclude each other: set one")
        if style != "eagle3" and (norm_before_fc or fc_norm or norm_output):
            raise ValueError("norm_before_fc / fc_norm / norm_output are EAGLE-3(.1) options; "
                             f"style={style!r} has none")  # fmt: skip
        if style not in STYLES:
            raise ValueError(f"EAGLE style must be one of {STYLES}, got {style!r}")
        if ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1 (1 = no training-time test), got {ttt_steps}")
        if style == "eagle1" and len(hidden_layers) != 1:
            raise ValueError(
                f"EAGLE-1 reads one target feature (fc over [embedding, feature]); got "
                f"layers={list(hidden_layers)}. Use layers=[-1], or style=eagle3 for several taps"
            )
        if feature_loss_weight > 0 and tuple(hidden_layers) != (-1,):
            raise ValueError(
                "feature regression needs the draft to predict the target's last feature: use "
                f"hidden_layers=[-1] (EAGLE-1), or feature_loss_weight=0 (got {list(hidden_layers)})"
            )
        self.style = style
        self.hidden_layers = tuple(hidden_layers)
        self.ttt_steps = ttt_steps
        self.feature_loss_weight = feature_loss_weight
        self.target_vocab_size = target_vocab_size
        self.draft_vocab_size = draft_vocab_size or target_vocab_size
        self.reduced_vocab = self.draft_vocab_size < target_vocab_size
        self.config = LlamaConfig(
            hidden_size=hidden_size,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim or hidden_size // num_heads,
            intermediate_size=intermediate_size,
            num_hidden_layers=1,
            vocab_size=target_vocab_size,
            max_position_embeddings=max_position_embeddings,
            rope_parameters=dict(rope_parameters),
            rms_norm_eps=rms_norm_eps,
            hidden_act=hidden_act,
        )
        # SDPA with our own boolean masks (the eager path would add a bool mask as numbers).
        self.config._attn_implementation = "sdpa"
        H = hidden_size
        self.norm_output = norm_output
        if style == "eagle3":
            self.fc = nn.Linear(len(self.hidden_layers) * H, H, bias=False)  # over the taps
            # Fixed per-tap input scale, folded into fc.weight at export (module docstring).
            self.register_buffer("tap_scale", torch.ones(len(self.hidden_layers)))
            self.norm = LlamaRMSNorm(H, eps=rms_norm_eps)  # before the head (EAGLE-1 has none)
            n = len(self.hidden_layers)
            self.input_norm = LlamaRMSNorm(n * H, eps=rms_norm_eps) if norm_before_fc else None
            self.fc_norm = None
            if fc_norm:
                self.fc_norm = nn.ModuleList(LlamaRMSNorm(H, eps=rms_norm_eps) for _ in range(n))
        else:
            self.fc = nn.Linear(2 * H, H, bias=False)  # over [embedding, feature]
        self.layers = nn.ModuleList([EagleLayer(self.config, style)])
        # In the module tree, so `.to(device)` moves inv_freq with the draft (kept outside, it
        # stayed on the CPU: a host copy per draft step on a GPU). Non-persistent buffers:
        # state dicts and exports do not see them. Kept float32 under any cast (`_apply`).
        self.rotary = LlamaRotaryEmbedding(self.config)
        self.lm_head = nn.Linear(H, self.draft_vocab_size, bias=False) if train_head else None
        # d2t / t2d, vocab_ready, vocab_coverage (models/vocab.py)
        vocab.attach(
            self, "offsets", draft_vocab_size if self.reduced_vocab else None, target_vocab_size
        )

    def _apply(self, fn, recurse=True):
        """`.to(device)` moves the rotary frequencies; `.to(bfloat16)` leaves them float32 (a
        bf16 inv_freq moves every rotary angle: models.dtypes.cast_keep_rotary)."""
        rotary = dict(self.rotary.named_buffers())
        super()._apply(fn, recurse)
        for name, buf in rotary.items():  # the float32 values, on the device fn moved to
            setattr(self.rotary, name, buf.to(getattr(self.rotary, name).device))
        return self

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        old = sorted({key.split(".")[0] for key in state_dict} & set(PRE_SERVED_KEYS))
        if old:
            raise ValueError(
                f"this EAGLE checkpoint was trained with the pre-served layout (keys {old}: "
                "input_proj after per-tap RMS norms, H-wide q/k/v); the served layout "
                "(models/eagle.py) cannot load it. Retrain the draft."
            )
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    # -- vocabulary (models/vocab.py) ----------------------------------------------
    def vocab_ids(self) -> Tensor | None:
        """Draft id -> target id [V_draft] long (None for the full vocabulary)."""
        return vocab.draft_ids(self)

    def head_weight(self, target: Target) -> Tensor:
        """[V_draft, H]: the trained head, or the target's frozen lm_head rows at the draft ids."""
        if self.lm_head is not None:
            return self.lm_head.weight
        return vocab.head_rows(target.lm_head.weight, self.vocab_ids())

    # -- the blocks shared by training and drafting --------------------------------
    def fuse_features(self, hidden: dict[int, Tensor]) -> Tensor:
        """Target hidden layers -> the draft's step-0 feature [B, T, H]: EAGLE-3's g =
        fc(scaled taps); EAGLE-1's f (the fc over [embedding, f] runs in `step`)."""
        missing = [layer for layer in self.hidden_layers if layer not in hidden]
        if missing:
            raise ValueError(
                f"target output lacks hidden layers {missing}; run the target with "
                f"hidden_layers={self.hidden_layers}"
            )
        dtype = self.fc.weight.dtype
        if self.style == "eagle1":
            return hidden[self.hidden_layers[0]].to(dtype)
        taps = [
            (hidden[layer].float() * scale).to(dtype)
            for layer, scale in zip(self.hidden_layers, self.tap_scale.float())
        ]
        x = torch.cat(taps, dim=-1)  # [B, T, n*H]
        if self.input_norm is not None:  # EAGLE-3.1: speculators' order, this norm first
            x = self.input_norm(x)
        if self.fc_norm is not None:
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, x.chunk(len(taps), -1))], -1)
        return self.fc(x)  # [B, T, H]

    def step(
        self,
        feature: Tensor,  # [B, P, H]: step-0 feature, or the draft's previous hidden
        token_embeds: Tensor,  # [B, P, H]: embedding of the token after each position
        positions: Tensor,  # [P] or [B, P] long
        cache: DynamicCache,
        attention_mask: Tensor | None = None,  # [B|1, 1, P, kv] bool, True = attend
    ) -> Tensor:
        """One pass of the decoder layer -> the draft's hidden output [B, P, H], the next
        step's feature: pre-norm, or with norm_output the normed one."""
        token_embeds = token_embeds.to(feature.dtype)
        rope = self.rotary(feature, positions if positions.dim() == 2 else positions[None])
        if self.style == "eagle3":
            h = self.layers[0](feature, token_embeds, attention_mask, rope, cache)
            return self.norm(h) if self.norm_output else h
        x = self.fc(torch.cat([token_embeds, feature], dim=-1))  # [B, P, H]
        return self.layers[0](x, None, attention_mask, rope, cache)

    def logits(self, h: Tensor, head_weight: Tensor) -> Tensor:
        """Draft hidden [B, P, H] -> logits over the draft vocabulary [B, P, V_draft]."""
        if self.style == "eagle3" and not self.norm_output:  # else `step` normed it
            h = self.norm(h)
        return F.linear(h, head_weight.to(h.dtype))

    # -- training ----------------------------------------------------------------------
    def set_progress(self, progress: float) -> None:
        """No schedule of its own: training progress changes nothing here."""

    def decoding_target(self, target: Target) -> Target:
        """The decoder verifies with the frozen target itself."""
        return target

    def forward(
        self,
        target: Target,
        input_ids: Tensor,  # [B, T]
        target_out: TargetOutput,
        attention_mask: Tensor | None = None,  # [B, T]
        loss_mask: Tensor | None = None,  # unused: every position trains
    ) -> DraftOutput:
        vocab.require(self)  # the mapping was checked when built or loaded
        B, T = input_ids.shape
        n = self.ttt_steps
        device = input_ids.device
        feature = self.fuse_features(target_out.hidden)  # [B, T, H]
        head = self.head_weight(target)  # [V_draft, H]
        # Teacher-forced token after each step's position; beyond T: pad (those logits are
        # dropped by the loop since t + offset >= T).
        future = torch.cat([input_ids, input_ids.new_zeros(B, n)], dim=1)  # [B, T+n]
        with torch.no_grad():
            embeds = target.embed_tokens(future)  # [B, T+n, H]
        valid = torch.ones(B, T, dtype=torch.bool, device=device)
        if attention_mask is not None:
            valid = attention_mask.bool()
        mask = ttt_attention_mask(valid, n)  # [B, 1, T, nT]
        positions = torch.arange(T, device=device)
        cache = DynamicCache(config=self.config)
        all_logits, hiddens = [], []
        for s in range(n):
            feature = self.step(
                feature,
                embeds[:, s + 1 : s + 1 + T],
                positions + s,
                cache,
                mask[..., : (s + 1) * T],
            )  # [B, T, H]
            hiddens.append(feature)
            all_logits.append(self.logits(feature, head))  # [B, T, V_draft]
        aux, extras = None, vocab.extras(self)
        if self.feature_loss_weight > 0:
            aux = self.feature_loss(hiddens, target_out.hidden[-1], valid)
            extras["feature_loss"] = (aux / valid.sum().clamp_min(1)).detach()  # per token
            aux = self.feature_loss_weight * aux
        return DraftOutput(
            logits=all_logits,
            offsets=list(range(1, n + 1)),
            aux_loss=aux,
            vocab_ids=self.vocab_ids(),
            extras=extras,
        )

    def feature_loss(self, hiddens: list[Tensor], target_feature: Tensor, valid: Tensor) -> Tensor:
        """SmoothL1 between step s's hidden at anchor t and the target's f_{t+s+1}, summed over
        real positions (EAGLE-1 regresses on every token, prompt included); mean over steps.
        The training step divides it by the global batch's real tokens (train/core/step.py), so
        ranks and micro-batches split the batch without changing the loss."""
        T = target_feature.shape[1]
        losses = []
        for s, h in enumerate(hiddens):
            if s + 1 >= T:
                break
            err = F.smooth_l1_loss(
                h[:, : T - s - 1].float(), target_feature[:, s + 1 :].float(), reduction="none"
            ).mean(-1)  # [B, T-s-1]
            m = valid[:, s + 1 :].float()
            losses.append((err * m).sum())
        return torch.stack(losses).mean()


def ttt_attention_mask(valid: Tensor, steps: int) -> Tensor:
    """valid [B, T] bool -> [B, 1, T, steps*T] bool (True = attend) for the unrolled steps.
    Block 0 (step-0 keys): causal, skipping padding keys (a query always sees itself).
    Block j >= 1: the key of step j at the same anchor only (identity)."""
    B, T = valid.shape
    idx = torch.arange(T, device=valid.device)
    causal = idx[None, :] <= idx[:, None]  # [T, T]
    block0 = causal[None] & (
        valid[:, None, :] | torch.eye(T, dtype=torch.bool, device=valid.device)
    )
    eye = torch.eye(T, dtype=torch.bool, device=valid.device).expand(B, T, T)
    return torch.cat([block0] + [eye] * (steps - 1), dim=-1)[:, None]


def from_target(
    target: Target,
    token_counts: Tensor | None = None,
    style: str = "eagle3",
    layers: list[int] | None = None,
    ttt_steps: int = 7,
    vocab_size: int | str = 8192,
    feature_loss_weight: float = 0.0,
    train_head: bool = False,
    intermediate_size: int | None = None,
    init: str = "identity",
    norm_before_fc: bool = False,
    fc_norm: bool = False,
    norm_output: bool = False,
) -> EagleDraft:
    """Build an EAGLE draft sized from `target`. `layers`: target hidden_states indices to
    read (default: [-1] for EAGLE-1, low/mid/high for EAGLE-3). `vocab_size`: "full" or N
    (the N most frequent trained tokens; needs `token_counts` or a checkpoint's d2t/t2d).
    `init`: "identity" starts the head as a logit lens of the deepest tapped feature (see
    `models.eagle_init.identity_init`), "target_layer" (EAGLE-3) as the target layer that
    tap enters (`target_layer_init`), "random" is plain random init. EAGLE-3's tap scale
    is measured on the target here (one short forward, `measure_tap_scale`), unless a norm
    before fc (EAGLE-3.1) makes it moot."""
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    normed = norm_before_fc or fc_norm
    if normed and init == "target_layer":
        raise ValueError("init=target_layer maps the target's raw taps into fc; with "
                         "norm_before_fc / fc_norm use init=identity or random")  # fmt: skip
    if init == "target_layer" and style != "eagle3":
        raise ValueError(
            "init=target_layer copies a target layer into EAGLE-3's 2H-wide q/k/v; for "
            f"style={style!r} use init=identity or random"
        )
    cfg = target.config
    if layers is None:
        layers = [-1] if style == "eagle1" else list(default_eagle3_layers(target.num_layers))
    bad = [la for la in layers if not -1 <= la <= target.num_layers]
    if bad:
        raise ValueError(
            f"layers {bad} out of range: the target has hidden_states 0..{target.num_layers} (-1 = last)"
        )
    draft_vocab = vocab.reduced_size(vocab_size, target.vocab_size)
    rope = target.rope_kwargs()
    rope_parameters = rope.get("rope_parameters") or {
        "rope_type": "default",
        "rope_theta": rope.get("rope_theta", 10000.0),
    }
    draft = EagleDraft(
        hidden_size=target.hidden_size,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        intermediate_size=intermediate_size or cfg.intermediate_size,
        target_vocab_size=target.vocab_size,
        max_position_embeddings=rope["max_position_embeddings"],
        rope_parameters=rope_parameters,
        rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-5),
        head_dim=getattr(cfg, "head_dim", None),
        hidden_act=getattr(cfg, "hidden_act", "silu"),
        hidden_layers=tuple(layers),
        style=style,
        ttt_steps=ttt_steps,
        draft_vocab_size=draft_vocab,
        feature_loss_weight=feature_loss_weight,
        train_head=train_head,
        norm_before_fc=norm_before_fc,
        fc_norm=fc_norm,
        norm_output=norm_output,
    )
    if draft.reduced_vocab and token_counts is not None:
        vocab.build(draft, token_counts, target.eos_token_ids)
    with torch.no_grad():  # start from the target's own output geometry
        if style == "eagle3" and not normed:
            draft.tap_scale.copy_(measure_tap_scale(target, draft.hidden_layers))
        if style == "eagle3":
            draft.norm.weight.copy_(target.final_norm_weight)
        if init == "identity":
            identity_init(draft.fc, draft.hidden_layers, draft.layers[0], style)
        elif init == "target_layer":
            target_layer_init(
                target, draft.hidden_layers, draft.tap_scale, draft.fc, draft.layers[0]
            )
        if draft.lm_head is not None:
            draft.lm_head.weight.copy_(vocab.head_rows(target.lm_head.weight, draft.vocab_ids()))
    return draft.to(device=target.device)
