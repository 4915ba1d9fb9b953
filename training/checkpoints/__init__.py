"""A job's checkpoints: whose they are (`fingerprint`), the folder's one owner (`store`:
small files, LATEST, rotation, the lease, the ranks' files; its read-only checks of whose
folder it is and whether a resume may continue it in `whose`), the ranks' sharded state written and read
with torch.distributed.checkpoint (`sharded`), and DCP's storage seam on any URL
(`dcp_storage`)."""
