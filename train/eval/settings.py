"""What an evaluation decodes with: `EvalSettings`, the values of cfg.decode and the few run
values the evaluation reads besides (the seed, the data's cache and chat template). The set-up
builds it once from a checked config (train/run/settings.py: eval_settings), as do the scripts
that evaluate a saved checkpoint; train/eval/ never reads the config itself."""

from __future__ import annotations

from dataclasses import dataclass

from decoding.drafter import Sampling
from decoding.tree import TreeSpec
from train.core.step_stats import decode_samplings


@dataclass(frozen=True)
class EvalSettings:
    """cfg.decode's settings (conf/decode/chain.yaml says what each does), each as the
    evaluation reads it; `None` where a key's absence means something of its own."""

    k: int  # decode.k: draft tokens per round (a chain; a tree drafts its own size)
    temperatures: tuple[float, ...]  # decode.temperatures: one evaluation each, 0 = greedy
    top_k: int  # decode.top_k, 0 = off
    top_p: float  # decode.top_p
    max_new_tokens: int  # decode.max_new_tokens
    num_prompts: int | None  # decode.num_prompts; None: every eval prompt
    warmup: int  # decode.warmup: prompts decoded first and not timed
    seed: int  # decode.seed, else the run's seed
    dtype: str  # decode.dtype: the target's decoding dtype, or "auto" (measured)
    draft_dtype: str | None  # decode.draft_dtype; None (a config from before it): the target's
    same_dtype_ar: bool  # decode.same_dtype_ar: the AR in decode.dtype beside the fastest one
    compile: bool | str  # decode.compile: False, True, "only" or "auto" (train/eval/compiled.py)
    compile_mode: str  # decode.compile_mode
    adaptive_k: bool  # decode.adaptive_k
    lookup_min_match: int  # decode.lookup_min_match: prompt lookup, 0 = off
    linear_layout: str  # decode.linear_layout: plain, transposed or auto (models/few_rows.py)
    tree: TreeSpec | None  # decode.tree: draft trees (decoding/tree.py); None: a chain
    ood_prompts: str | None  # decode.ood_prompts: builtin or a .jsonl; None: none decoded
    ood_num_prompts: int | None  # decode.ood_num_prompts; None: as many as num_prompts
    cache_dir: str | None  # data.cache_dir: compiled code and dtype verdicts, per machine
    chat_template: str | None  # data.chat_template: how the OOD prompts are rendered

    @property
    def samplings(self) -> dict[str, Sampling]:
        """tag ("greedy", "T0.7") -> the decode sampling of each temperature."""
        return decode_samplings(self.temperatures, self.top_k, self.top_p)
