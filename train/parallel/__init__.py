"""How a run's processes share the work (the bottom room: it imports no other).

ranks.py     `Ranks`: which rank regenerates, caches and decodes which share, and the gathers
strategy.py  one process, DDP or FSDP2: what the launch asks, sharding, what ran
"""
