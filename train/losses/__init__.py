"""The one loss API for every draft kind, and the acceptance statistics beside it.

divergences.py  `LOSSES`, `LossSpec`: CE, forward / reverse KL, TV and the TV family (LK)
family.py       JSD, NLA, D-PACE and weighted mixes, as the libraries that introduced them
rows.py         per-row divergences and the chunked, masked, checkpointed reduction
acceptance.py   what the decoder would accept: alpha, top-1 agreement, simulated tau
"""
