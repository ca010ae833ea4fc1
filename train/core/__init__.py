"""The training core: one step, its records, and what a step reads and writes.

step.py           one optimizer step: target forward, draft forward, offset losses, backward
step_stats.py     the `kind: train` records of metrics.jsonl; the names of decode samplings
schedule.py       the seeded row order and the LR schedule
optimizers.py     AdamW, Muon + AdamW from conf/optim
checkpoint.py     atomic checkpoints and everything an exact resume needs
feature_cache.py  the target's taps over the training rows, computed once, on disk
replay.py         on-policy replay of rejected positions (Draft-OPD style)
rollouts.py       the draft's own rollouts for replay, and their buffer
"""
