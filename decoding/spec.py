"""The shared speculative decoding loop (chain drafts), and plain AR through the same loop.

One round, batch B:
    propose k drafts -> ONE target forward over [last, d_1..d_k] with the KV cache
    -> verify (decoding/verify.py) -> keep the common accepted prefix n = min_b n_b
    -> crop the target cache to drop the k - n rejected positions -> drafter.commit(...).
With `drafter=None` every round is a 1-token target forward: the fair AR baseline, paying
the same per-round Python cost as the speculative path.

Batch rows reject at different positions. We keep, for every row, the n common accepted
drafts plus one more token: the row's correction token if it rejected at n+1, or its
accepted draft d_{n+1} otherwise. This is lossless: the token a row emits at position i
is "d_i if accepted else the residual sample", and conditioned on everything decided
before it, that token is an exact sample of p given its prefix (the draft d_i is drawn
afresh given the prefix; u_i is fresh). Cutting the round after any token only changes
where the next round starts, and the next round again samples each token from p given
its prefix, so by the chain rule the joint distribution of every row is the target's.

Prompts of different lengths are left-padded; pass `attention_mask` [B, T] (1 = real).
Position ids are counted over real tokens only. Rows that hit EOS stop emitting (their
slots keep being computed, and ignored) so the batch stays rectangular. The prefill, the
result record and the emitting of tokens are shared with the tree loop (decoding/rounds.py);
`generate(tree=...)` hands over to it (decoding/tree.py).
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from decoding.drafter import Drafter, Sampling
from decoding.entropy import EntropyProbe, chain_positions
from decoding.rounds import (
    GREEDY,
    GenerationResult,
    StreamFn,
    check_inputs,
    count_emitted,
    emit,
    prefill,
    sync,
)
from decoding.tree import TreeSpec, generate_tree
from decoding.verify import sample, verify
from models.target import Target, TargetOutput


def _slice_out(out: TargetOutput, n: int) -> TargetOutput:
    """The verify forward restricted to its first n positions (the kept ones)."""
    return TargetOutput(
        logits=None if out.logits is None else out.logits[:, :n],
        hidden={layer: h[:, :n] for layer, h in out.hidden.items()},
        cache=out.cache,
    )


@torch.inference_mode()
def generate(
    target: Target,
    input_ids: Tensor,  # [B, T], left-padded if rows differ in length
    drafter: Drafter | None = None,
    *,
    k: int = 4,
    sampling: Sampling = GREEDY,
    max_new_tokens: int = 64,
    attention_mask: Tensor | None = None,  # [B, T], 1 = real token
    generator: torch.Generator | None = None,
    stream: StreamFn | None = None,
    adaptive_k: bool = False,
    max_k: int | None = None,  # adaptive-k ceiling (default 2k)
    eos_token_ids: list[int] | None = None,  # default: the target's; [] = never stop early
    tree: TreeSpec | None = None,  # draft a tree instead of a chain (decoding/tree.py)
    probe: EntropyProbe | None = None,  # collects (target entropy, acceptance) per judged draft
) -> GenerationResult:
    """Speculative decoding of `input_ids` with `drafter` (None = plain AR decoding).

    tree: a `decoding.tree.TreeSpec` (static paths or an EAGLE-2 dynamic tree); the drafter
    must then implement `propose_tree`, and `k`/`adaptive_k` are not used.

    adaptive_k: k grows by 2 after a round that accepted every draft and shrinks by 1
    otherwise (transformers' heuristic schedule), within [1, max_k].

    probe: a `decoding.entropy.EntropyProbe` receiving the target entropy and acceptance of
    every draft the verifier judged; its time is left out of `total_s` (a measurement, not
    decoding)."""
    check_inputs(target, input_ids, drafter, k, sampling, max_new_tokens, attention_mask)
    device = target.device
    B = input_ids.shape[0]
    max_k = max_k or 2 * k
    if tree is not None and drafter is not None:
        return generate_tree(
            target,
            input_ids,
            drafter,
            tree,
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            attention_mask=attention_mask,
            generator=generator,
            stream=stream,
            eos_token_ids=eos_token_ids,
            probe=probe,
        )
    hidden_layers = tuple(drafter.hidden_layers) if drafter is not None else ()
    state = prefill(target, input_ids, drafter, sampling, attention_mask, generator, eos_token_ids)
    result, cache, attn, last, next_pos = (
        state.result,
        state.cache,
        state.attn,
        state.last,
        state.next_pos,
    )
    finished, eos_set, eos_ids = state.finished, state.eos, state.eos_ids
    if stream is not None:
        stream([[t] for t in state.first])
    generated = 1
    k_now = k
    probe_s = 0.0

    while generated < max_new_tokens and not all(finished):
        k_round = min(k_now, max_new_tokens - generated - 1)  # never draft past the budget
        # ---- propose -----------------------------------------------------------------
        proposed = drafter is not None and k_round > 0
        if proposed:
            t0 = time.perf_counter()
            drafts, q = drafter.propose(last, k_round, sampling, generator)  # [B, k'], [B, k', V]
            sync(device)
            result.draft_s += time.perf_counter() - t0
            k_round = drafts.shape[1]  # a drafter may propose fewer (n-gram with no match)
            if q is not None:
                q = q[:, :k_round]
        else:
            k_round = 0
        # ---- one target forward over [last, d_1..d_k] ---------------------------------
        step_ids = (
            last[:, None] if k_round == 0 else torch.cat([last[:, None], drafts], 1)
        )  # [B, k+1]
        step_pos = next_pos[:, None] + torch.arange(k_round + 1, device=device)  # [B, k+1]
        if attn is not None:
            attn = torch.cat([attn, attn.new_ones(B, k_round + 1)], 1)
        t0 = time.perf_counter()
        out = target(
            step_ids,
            cache=cache,
            attention_mask=attn,
            position_ids=step_pos,
            hidden_layers=hidden_layers,
        )
        sync(device)
        result.verify_s += time.perf_counter() - t0
        # ---- verify ------------------------------------------------------------------
        if k_round == 0:
            n_common = 0
            next_tok = sample(out.logits[:, 0], sampling, generator)  # [B]
        else:
            res = verify(drafts, q, out.logits, sampling, generator)
            n_rows = res.num_accepted.tolist()
            active = [n_rows[b] for b in range(B) if not finished[b]]
            n_common = min(active)
            # Row's token after the common prefix: its accepted draft, or its correction.
            idx = min(n_common, k_round - 1)
            next_tok = torch.where(res.num_accepted > n_common, drafts[:, idx], res.next_token)
            if probe is not None:
                t0 = time.perf_counter()
                rows = torch.tensor([not f for f in finished], device=device)
                probe.add(*chain_positions(drafts, q, out.logits, res.num_accepted, sampling, rows))
                sync(device)
                probe_s += time.perf_counter() - t0
        emitted = step_ids[:, 1 : n_common + 1]  # [B, n] accepted drafts
        emitted = torch.cat([emitted, next_tok[:, None]], 1)  # [B, n+1]
        # ---- roll back the rejected tail -----------------------------------------------
        drop = k_round - n_common
        if drop > 0:
            cache.crop(-drop)
            if attn is not None:
                attn = attn[:, :-drop]
        next_pos = next_pos + n_common + 1
        last = next_tok
        result.rounds += 1
        result.draft_lens.append(k_round)
        result.accept_counts.append(count_emitted(emitted[:, :n_common], finished, eos_ids))
        if proposed:  # also after an empty proposal, so the drafter sees every kept token
            t0 = time.perf_counter()
            drafter.commit(n_common, emitted, _slice_out(out, n_common + 1))
            sync(device)
            result.draft_s += time.perf_counter() - t0
        del out
        # ---- emit, stop at EOS / budget ----------------------------------------------------
        new = emit(result, emitted, finished, eos_set)
        result.round_tokens.append(max(len(row) for row in new))
        generated += n_common + 1
        if stream is not None:
            stream(new)
        if adaptive_k and k_round > 0:
            k_now = min(k_now + 2, max_k) if n_common == k_round else max(1, k_now - 1)

    sync(device)
    result.total_s = time.perf_counter() - state.t_start - probe_s
    return result
