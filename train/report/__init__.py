"""Reporting on training runs, from their run directories and to W&B.

runs.py      load finished run directories, group them, aggregate over seeds
tables.py    the markdown comparison table
plots.py     the comparison plots (scripts/compare.py writes them, the notebook shows them)
tracking.py  W&B run names, groups, tags and summaries for the training loop
"""
