"""A user's own model package, as a user would write it, for the tests: shardline imports it
by import path ('usernets.nets:build') from the folder a command runs in or from
training.code_paths. Nothing here imports shardline: a user's package needs nothing of it
but the ModelInputs object its factories are handed."""
