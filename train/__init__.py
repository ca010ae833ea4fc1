"""draftlab training. Importing the package registers the OmegaConf resolvers conf/train.yaml
uses (train/resolvers.py), wherever the config is composed."""

import train.resolvers  # noqa: F401
