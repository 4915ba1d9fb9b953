"""The image example's own model package (found from the folder the job runs in)."""
