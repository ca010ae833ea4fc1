"""draftlab training. Importing the package registers the OmegaConf resolvers conf/train.yaml
uses (train/run/resolvers.py), wherever the config is composed."""

import train.run.resolvers  # noqa: F401
