"""A user's own training loops (training.loop), outside shardline: tests/test_own_loop.py."""
