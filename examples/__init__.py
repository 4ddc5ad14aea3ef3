"""The demo around the library: a small GPT on an embedded corpus (``examples.models``), the Hydra
main job (``examples/train.py``), a LightningCLI (``examples/cli.py``) and Lightning's own FSDP
hybrid strategy as a peer baseline (``examples.baselines``).

It is not part of the installed library: run it from the repository root, with the extra that
brings its dependencies (``pip install -e ".[examples]"``: Hydra, jsonargparse, torchmetrics).
"""
