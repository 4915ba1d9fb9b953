"""The example's own model and loss: shardline imports them by path (training.model,
training.loss, training.metrics) from the folder the job runs in."""
