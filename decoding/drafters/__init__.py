"""One drafter per draft kind, and `make_drafter`, which picks a trained draft's drafter.

A drafter is the decoder's side of a draft (the `Drafter` protocol in decoding/drafter.py):
it shares the draft module's weights, takes frozen pieces (embeddings, output head) from
the target it decodes with, and keeps its own state between rounds. Files:
    eagle.py     EAGLE-1/3 feature heads (models/eagle.py), chains and EAGLE-2 dynamic trees
    medusa.py    Medusa-1/2 heads (models/medusa.py), chains and static trees
    mtp.py       DeepSeek-V3 MTP modules (models/mtp.py), chains
    dflash.py    DFlash block drafts (models/dflash.py): a whole chain from one forward, dynamic trees
    domino.py    Domino (models/domino.py): DFlash's forward plus one cheap causal step per token
    draft_lm.py  a standalone draft LM (models/draft_lm.py) or any HF causal LM
    ngram.py     prompt lookup, no model (the training-free baseline)
    cache.py     the KV-cache bookkeeping the EAGLE and MTP drafters share
"""

from __future__ import annotations

from torch import nn

from decoding.drafter import Drafter
from decoding.drafters.dflash import DFlashDrafter
from decoding.drafters.domino import DominoDrafter
from decoding.drafters.draft_lm import DraftLMDrafter
from decoding.drafters.eagle import EagleDrafter
from decoding.drafters.medusa import MedusaDrafter
from decoding.drafters.mtp import MTPDrafter
from models.dflash import DFlashDraft
from models.domino import DominoDraft
from models.draft_lm import DraftLM
from models.eagle import EagleDraft
from models.medusa import MedusaHeads
from models.mtp import MTP
from models.target import Target


def make_drafter(draft: nn.Module, target: Target) -> Drafter:
    """The decoder's adapter for a draft module of models/, sharing the module's weights and
    taking frozen pieces from `target` (which may be a bf16 copy used for decoding). A new
    draft kind adds its line here."""
    if isinstance(draft, EagleDraft):
        return EagleDrafter(draft, target)
    if isinstance(draft, MedusaHeads):
        return MedusaDrafter(draft, target)
    if isinstance(draft, MTP):
        return MTPDrafter(draft, target)
    if isinstance(draft, DominoDraft):  # before DFlashDraft, its base class
        return DominoDrafter(draft, target)
    if isinstance(draft, DFlashDraft):
        return DFlashDrafter(draft, target)
    if isinstance(draft, DraftLM):
        return DraftLMDrafter(draft.causal_lm(), target)
    raise TypeError(
        f"no drafter for a {type(draft).__name__}: make_drafter knows EagleDraft, MedusaHeads, "
        "MTP, DFlashDraft, DominoDraft and DraftLM; add the new draft kind's drafter to "
        "decoding/drafters/__init__.py"
    )
