"""OmegaConf resolvers that conf/train.yaml uses, registered when the `train` package is
imported (train/__init__.py), so train.py, every accelerate/torchrun rank, tests and scripts
compose the same run directory.

`${safe_dirname:${hydra:job.override_dirname}}`: Hydra's override_dirname holds the override
values verbatim, so `target.path=/models/x` or a hub id `org/name` would nest directories.
"""

from __future__ import annotations

import hashlib
import re

from omegaconf import OmegaConf

MAX_DIRNAME = 120  # characters; file systems allow 255 bytes per name, leave room to read it
UNSAFE = re.compile(r"[^A-Za-z0-9._=,+-]+")


def safe_dirname(text: str) -> str:
    """One flat, portable directory name for `text`: each run of characters other than
    letters, digits and `. _ = , + -` becomes `_` (`target.path=/models/x` ->
    `target.path=_models_x`). A longer name than MAX_DIRNAME keeps its start and ends in a
    hash of the whole text, so distinct override sets stay distinct. Deterministic: every
    rank resolves the same name."""
    safe = UNSAFE.sub("_", str(text))
    if len(safe) > MAX_DIRNAME:
        digest = hashlib.sha1(str(text).encode()).hexdigest()[:8]
        safe = f"{safe[: MAX_DIRNAME - len(digest) - 1]}-{digest}"
    return safe


OmegaConf.register_new_resolver("safe_dirname", safe_dirname, replace=True)
