"""Functions written for torchrun / PySpark's TorchDistributor, outside shardline: tests/test_distribute.py."""
