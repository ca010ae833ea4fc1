"""A trained draft in the formats other tools load, and back (docs/export.md).

export.py      `export(draft, target, fmt, out)`: the entry point (temporary directory,
               read-back checks, rename) and the hf / medusa / vllm-medusa writers;
               `load_run_draft(ckpt)` and `checkpoint_config(ckpt)` for a training checkpoint.
kinds.py       which draft kind is written as which format (`EXPORT_FORMATS`), checked before
               the target loads, and why MTP / DFlash / Domino have none (`REFUSED`).
eagle.py       the EAGLE heads' writers: `export_speculators`, `export_eagle`.
eagle_read.py  `read_eagle_export`: a speculators / eagle export back into an EAGLE head.
checks.py      what every writer shares: `ExportError` and the checks before and after writing.
"""
