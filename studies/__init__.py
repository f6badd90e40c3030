"""The studies behind the design choices: each module is one study, run from the repository root as
``python -m studies.NAME --help``; results and the commands that made them are in ``results/``."""
