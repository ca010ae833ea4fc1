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
    selfspec.py  the target's own first layers through a trained exit (models/selfspec.py), one KV cache
    ngram.py     prompt lookup, no model (the training-free baseline)
    lookup.py    prompt lookup in front of a trained drafter (decode.lookup_min_match)
    cache.py     the KV-cache bookkeeping the EAGLE and MTP drafters share
    vocab.py     a reduced draft vocabulary's ids and q back to the target's (EAGLE, DFlash, Domino)
"""

from __future__ import annotations

from decoding.drafter import Drafter
from decoding.drafters.dflash import DFlashDrafter
from decoding.drafters.domino import DominoDrafter
from decoding.drafters.draft_lm import DraftLMDrafter
from decoding.drafters.eagle import EagleDrafter
from decoding.drafters.medusa import MedusaDrafter
from decoding.drafters.mtp import MTPDrafter
from decoding.drafters.selfspec import SelfSpecDrafter
from models.protocol import DraftModel
from models.target import Target

# draft.kind -> its drafter class. A new draft kind adds its line (or, for a kind defined
# outside the project, an entry at run time before training starts).
DRAFTERS: dict[str, type[Drafter]] = {
    "eagle": EagleDrafter,
    "medusa": MedusaDrafter,
    "mtp": MTPDrafter,
    "dflash": DFlashDrafter,
    "domino": DominoDrafter,
    "draft_lm": DraftLMDrafter,
    "selfspec": SelfSpecDrafter,
}


def drafter_class(kind: str) -> type[Drafter]:
    """The drafter class of a draft kind; a ValueError that lists the known kinds."""
    if kind not in DRAFTERS:
        raise ValueError(
            f"no drafter for draft kind {kind!r}: known kinds are {sorted(DRAFTERS)}; a new "
            "kind registers its drafter in decoding.drafters.DRAFTERS"
        )
    return DRAFTERS[kind]


def make_drafter(draft: DraftModel, target: Target) -> Drafter:
    """The decoder's adapter for a draft module of models/ (`draft.kind`), sharing the
    module's weights and taking frozen pieces from `target` (which may be a bf16 copy used
    for decoding)."""
    return drafter_class(draft.kind)(draft, target)
