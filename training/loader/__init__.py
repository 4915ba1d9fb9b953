"""The shard loader every rank reads with: the reader (`reader.ShardLoader`: sharding,
seeded shuffle, exact resume), its row movers (`batches`) and its columns (`columns`)."""
