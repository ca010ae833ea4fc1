"""A run's set-up and records: the config is read here, and each room gets the values it uses.

settings.py      start-up checks of the whole config, before anything loads
setup.py         what a run builds before its first step (accelerator, target, draft, caches)
machine.py       threads, the target's dtype and the draft's autocast, chosen by timing
memory_plan.py   the memory per rank from the config alone; a launch that cannot fit refused
meta_forward.py  a training step's activations counted on the meta device
identity.py      what a checkpoint was trained with, compared wherever it is used again
init_from.py     a draft warm-started from any supported format or checkpoint
records.py       checkpoints with their evaluation, summary.json
files.py         the run directory's own files (eval prompts, Hydra's record, third-party log)
resolvers.py     OmegaConf resolvers conf/train.yaml uses
compose.py       conf's target and data groups composed without train.py (scripts)
"""
