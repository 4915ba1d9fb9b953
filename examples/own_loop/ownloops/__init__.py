"""The example's own training loops: a GAN on digit images (gan.py) and a two-tower model on
interaction rows (towers.py). Each is a function of one argument, shardline's loop context."""
