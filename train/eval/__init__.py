"""What a checkpoint's draft buys: the plan, the decode, the compiled path, the held-out proxy.

plan.py       every decision of an evaluation, made before it decodes: samplings, dtypes,
              path, layout, which AR baselines run beside which decode (`plan_checkpoint`)
evaluate.py   decodes what the plan lists with the shared decoder, and the console's table
compiled.py   the compiled path: decode copies kept between checkpoints, compile verdicts
heldout.py    the held-out acceptance proxy at every checkpoint (seconds, not minutes)
"""
