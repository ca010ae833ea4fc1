"""The lowest torch and transformers draftlab runs with, checked when `models` is imported.

Below either floor the code does not fail where the cause is plain (docs/bad_inputs.md,
Version floors, says what was tested):
- transformers < 5.24: the model forwards take `past_key_values=`, not `cache=`; an unknown
  `cache=` goes into **kwargs without a word, so every cached forward sees only its new
  tokens and decoding runs on garbage.
- torch < 2.7: torch.compile (decode.compile=true, decoding/compiled.py) cannot trace
  transformers 5.24's forward wrappers (`Unsupported: ... co_varnames`), and
  `torch._dynamo.config.recompile_limit` does not exist yet; transformers 5.24 itself
  disables torch < 2.6 altogether.
"""

from __future__ import annotations

from packaging.version import Version

TORCH_FLOOR = "2.7"
TRANSFORMERS_FLOOR = "5.24"
INSTALL = f"pip install 'torch>={TORCH_FLOOR}' 'transformers>={TRANSFORMERS_FLOOR},<6'"


def older(version: str, floor: str) -> bool:
    """`version` (e.g. "2.7.0+cu126", "2.8.0a0+git") is below `floor` (release numbers only)."""
    return Version(version).release < Version(floor).release


def check_versions(torch_version: str, transformers_version: str) -> None:
    """Raise ImportError naming each package below its floor, and the pip line that fixes it."""
    problems = []
    if older(torch_version, TORCH_FLOOR):
        problems.append(
            f"torch >= {TORCH_FLOOR} (found {torch_version}: torch.compile cannot trace "
            "transformers 5.24's models, and transformers 5.24 disables torch < 2.6)"
        )
    if older(transformers_version, TRANSFORMERS_FLOOR):
        problems.append(
            f"transformers >= {TRANSFORMERS_FLOOR} (found {transformers_version}: its model "
            "forwards would ignore the cache= keyword without a word, and decode garbage)"
        )
    if problems:
        raise ImportError(f"draftlab needs {'; '.join(problems)}. {INSTALL}")
