"""LightningCLI for the main job; the same as the ``lightning-mics`` console script.

    python examples/cli.py fit --config examples/cli_config.yaml
    python examples/cli.py fit --config examples/cli_config.yaml \
        --trainer.strategy=lightning_mics.MiCSStrategy --trainer.strategy.partition_size=2
    python examples/cli.py validate --config examples/cli_config.yaml --ckpt_path=<checkpoint dir>
"""

from lightning_mics.cli import main

if __name__ == "__main__":
    main()
