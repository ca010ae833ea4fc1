"""Training data: `prepare.prepare_data(target, **cfg.data)` turns a source into training rows
with the assistant-only loss mask, held-out eval prompts and label token counts.

    prepare.py     eval split, rows, regeneration, batches, from any source
    sources.py     local files and hub datasets read into conversations; bad sources refused
    chat.py        the one chat template and the assistant-only mask
    corpus.py      the embedded corpus (HumanEval, Shakespeare, CPython stdlib; no network)
    raw_chunks.py  raw-text chunks of the embedded corpus's stdlib modules and play scenes
    regenerate.py  the target's own answers to the training prompts, cached on disk
"""
