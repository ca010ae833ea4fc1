"""The Domino drafter (models/domino.py): the DFlash drafter's one block forward, then one
cheap step per draft token (a GRU step over the previous token's embedding and the
correction projection; no draft layer runs again).

Draft i is drawn from q_i = softmax(base_i + correction(z_i, s_i)), where s_i is the GRU
state after the anchor `last` and the drafts d_1..d_{i-1} actually drawn: q_i is the
conditional the draft came from given its prefix, as verification requires (the training
forward teacher-forces the true tokens in the same slots). Trees (decoding/drafters/
dflash.py: `propose_tree`) carry one GRU state per node, so every node's children come
from its own path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from decoding.drafter import Sampling
from decoding.drafters.dflash import DFlashDrafter
from decoding.drafters.vocab import full_vocab_q, to_target_ids
from decoding.verify import sampling_probs


class DominoDrafter(DFlashDrafter):
    def _draw(
        self, h: Tensor, last_tokens: Tensor, k: int, sampling: Sampling, generator
    ) -> tuple[Tensor, Tensor | None]:
        model = self.model
        z = h[:, 1 : k + 1]  # [B, k, H]
        base = model.logits(z, self.head)  # [B, k, V_draft]
        state, prev = None, last_tokens
        tokens, qs = [], []
        for i in range(k):
            s = model.prefix_states(self.embed(prev)[:, None], state)  # [B, 1, G]
            state = s.transpose(0, 1)  # [1, B, G]: the GRU's state after prev
            logits = model.corrected(base[:, i], z[:, i], s[:, 0])  # [B, V_draft]
            if sampling.greedy:
                choice = logits.argmax(-1)
            else:
                q = sampling_probs(logits, sampling)  # [B, V_draft] float32
                choice = torch.multinomial(q, 1, generator=generator)[:, 0]
                qs.append(q)
            prev = to_target_ids(choice, self.vocab_ids)  # [B] target ids: the next GRU input
            tokens.append(prev)
        drafted = torch.stack(tokens, dim=1)  # [B, k]
        if not qs:
            return drafted, None
        return drafted, full_vocab_q(torch.stack(qs, dim=1), self.vocab_ids, self.vocab_size)

    def _child_logp(
        self, h: Tensor, d: int, parents: Tensor, states: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """One GRU step per parent (its token, from its own state) and the corrected
        log-probabilities of block position d + 1 below it; returns them [B, m, V] and the
        parents' new states [B, m, G] (the state of their children)."""
        model, (B, m) = self.model, parents.shape
        init = None if states is None else states.reshape(1, B * m, -1)
        s = model.prefix_states(self.embed(parents).reshape(B * m, 1, -1), init).view(B, m, -1)
        z = h[:, d + 1][:, None].expand(B, m, -1)  # [B, m, H]
        base = model.logits(h[:, d + 1], self.head)[:, None].expand(B, m, -1)  # [B, m, V_draft]
        return model.corrected(base, z, s).float().log_softmax(-1), s
