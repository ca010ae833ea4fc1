"""An independent reference for the served EAGLE-3 head: `ServedEagle3` below is written from
the served maths (vLLM / SGLang `llama_eagle3.py`, speculators `Eagle3DraftModel`) in plain
torch, reads only the exported files (model.safetensors + config.json, in the `speculators`
layout as vLLM reads it or the `eagle` layout as SGLang reads it) and the target's own HF
forward, and must reproduce the drafter's distributions step by step:

    g = fc(cat(taps))                                   taps: HF hidden_states[i], raw, in
                                                        ascending layer order (engines capture
                                                        them walking the layers)
    x = cat(input_layernorm(emb(tok)), hidden_norm(g))  embedding first
    h = g + o_proj(attn(q/k/v_proj(x)))                 residual = g (norm_before_residual=false)
    h = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h)) over the draft ids (target id = i + d2t[i]); the next step's g = h
"""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from decoding.drafter import Sampling
from decoding.drafters import make_drafter
from models import eagle
from models.target_loaders import build_tiny_random, load_smollm2
from train.formats.export import export

torch.set_num_threads(1)


# -- the reference: plain torch, nothing from models/eagle.py ------------------------------------
def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x, pos, theta):  # x [heads, P, D], pos [P]: Llama's rotate-half rope
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = (pos[:, None].double() * inv[None]).float()  # [P, D/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    half = torch.cat([-x[..., D // 2 :], x[..., : D // 2]], -1)
    return x * cos + half * sin


class ServedEagle3:
    """One sequence (no batch). `prefill` runs the layer over the prompt's positions,
    `step` one more position; both return the draft-vocabulary logits and keep h and the
    K/V entries, as an engine's draft worker does."""

    def __init__(self, export_dir: Path, hf_model):
        self.cfg = json.loads((export_dir / "config.json").read_text())
        w = load_file(str(export_dir / "model.safetensors"))
        L = hf_model.config.num_hidden_layers
        if "speculators_model_type" in self.cfg:  # vLLM: the layer config nested, ids as-is
            layer = self.cfg["transformer_layer_config"]
            ids = self.cfg.get("eagle_aux_hidden_state_layer_ids")
        else:  # SGLang: a flat config, midlayer.*, ids = output of layer j (captured before j+1)
            layer = self.cfg
            w = {k.replace("midlayer.", "layers.0.", 1): v for k, v in w.items()}
            nested = (self.cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            ids = [j + 1 for j in nested] if nested else None
            assert (self.cfg.get("eagle_aux_hidden_state_layer_ids") or ids) == ids  # vLLM's
        self.w = w
        self.eps, self.theta = layer["rms_norm_eps"], layer["rope_theta"]
        self.nh, self.nkv, self.D = (
            layer["num_attention_heads"],
            layer["num_key_value_heads"],
            layer["head_dim"],
        )
        self.capture = set(ids or [2, L // 2, L - 3])
        self.hf = hf_model
        V = self.w["lm_head.weight"].shape[0]
        self.draft_ids = torch.arange(V) + self.w["d2t"] if "d2t" in self.w else torch.arange(V)
        self.keys, self.values = [], []

    def _layer(self, g, tokens, pos):  # g [P, H], tokens [P] target ids, pos [P]
        w, p = self.w, "layers.0."
        e = self.hf.get_input_embeddings().weight[tokens]
        x = torch.cat(
            [_rms(e, w[p + "input_layernorm.weight"], self.eps),
             _rms(g, w[p + "hidden_norm.weight"], self.eps)], -1,
        )  # fmt: skip
        P = x.shape[0]
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(P, self.nh, self.D).transpose(0, 1)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(P, self.nkv, self.D).transpose(0, 1)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(P, self.nkv, self.D).transpose(0, 1)
        q, k = _rotate(q, pos, self.theta), _rotate(k, pos, self.theta)
        self.keys.append(k)
        self.values.append(v)
        K, Vv = torch.cat(self.keys, 1), torch.cat(self.values, 1)  # [nkv, S, D]
        rep = self.nh // self.nkv
        K, Vv = K.repeat_interleave(rep, 0), Vv.repeat_interleave(rep, 0)
        S = K.shape[1]
        scores = q @ K.transpose(1, 2) / math.sqrt(self.D)  # [nh, P, S]
        causal = torch.arange(S)[None, :] <= torch.arange(S - P, S)[:, None]  # cache order
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ Vv  # [nh, P, D]
        h = g + att.transpose(0, 1).reshape(P, -1) @ w[p + "self_attn.o_proj.weight"].T
        n = _rms(h, w[p + "post_attention_layernorm.weight"], self.eps)
        gate, up = n @ w[p + "mlp.gate_proj.weight"].T, n @ w[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        self.h = h[-1:]
        return _rms(h[-1], w["norm.weight"], self.eps) @ w["lm_head.weight"].T  # [V_draft]

    def prefill(self, prompt, last):  # prompt [P] target ids, last: the token after it
        out = self.hf(prompt[None], output_hidden_states=True)
        # The engines' capture loop: `if i in layers_to_capture` while walking the layers.
        taps = [h[0] for i, h in enumerate(out.hidden_states) if i in self.capture]
        g = torch.cat(taps, -1) @ self.w["fc.weight"].T  # [P, H]
        tokens = torch.cat([prompt[1:], last.view(1)])
        return self._layer(g, tokens, torch.arange(len(prompt)))

    def step(self, token, pos):  # the previous step's h and the drafted token
        return self._layer(self.h, token.view(1), torch.tensor([pos]))


# -- the comparison ------------------------------------------------------------------------------
def _check_against_drafter(draft, target, tmp_path, fmt="speculators", k=4, atol=1e-5):
    served = {"verifier": target.name, "speculative_tokens": k} if fmt == "speculators" else {}
    export(draft, target, fmt, tmp_path / "s", **served)
    ids = torch.randint(6, target.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    prompt, last = ids[:, :-1], ids[:, -1]
    drafter = make_drafter(draft, target)
    drafter.prefill(prompt, target(prompt, hidden_layers=draft.hidden_layers))
    g = torch.Generator().manual_seed(0)
    tokens, q = drafter.propose(last, k, Sampling(temperature=1.0), g)  # [B, k], [B, k, V]
    for b in range(2):
        ref = ServedEagle3(tmp_path / "s", target.model)
        with torch.no_grad():
            logits = [ref.prefill(prompt[b], last[b])]
            for s in range(1, k):
                logits.append(ref.step(tokens[b, s - 1], prompt.shape[1] - 1 + s))
        for s, lg in enumerate(logits):
            torch.testing.assert_close(
                lg.log_softmax(-1),
                q[b, s, ref.draft_ids].log(),
                atol=atol,
                rtol=atol,
                msg=lambda m, s=s, b=b: f"row {b}, draft step {s}: {m}",
            )


def _perturbed(draft, scale):
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * scale)
    return draft.eval()


# Default taps, taps the config names, and taps trained out of order (served ascending).
@pytest.mark.parametrize("layers", [None, [1, 3, 6], [6, 1, 3], [5, 2, 4]])
@pytest.mark.parametrize("fmt", ["speculators", "eagle"])
def test_reference_reproduces_the_drafter_tiny(tmp_path, layers, fmt):
    target = build_tiny_random(seed=0, num_layers=8, device="cpu")
    counts = torch.randint(
        0, 1000, (target.vocab_size,), generator=torch.Generator().manual_seed(0)
    )
    torch.manual_seed(0)
    draft = eagle.from_target(
        target, counts, layers=layers, ttt_steps=3, vocab_size=32, init="random"
    )
    _check_against_drafter(_perturbed(draft, 0.05), target, tmp_path, fmt)


@pytest.mark.slow
def test_reference_reproduces_the_drafter_smollm2(tmp_path):
    target = load_smollm2(dtype="float32", device="cpu")
    counts = torch.ones(target.vocab_size)
    draft = eagle.from_target(target, counts, ttt_steps=3, vocab_size=4096)  # identity init
    _check_against_drafter(_perturbed(draft, 0.01), target, tmp_path, atol=1e-4)
