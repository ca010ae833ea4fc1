"""The frozen target wrapper, the draft modules and their contract (docs/design.md §1).

Importing the package checks the torch and transformers versions first (models/versions.py):
below the floors the code would run and be wrong without a word."""

import torch
import transformers

from models.versions import check_versions

check_versions(torch.__version__, transformers.__version__)
