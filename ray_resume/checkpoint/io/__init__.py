"""The bytes moved: the storage (local, NFS, object stores) and its retries, a shard file written and
read, the writers (thread and process), a root's metadata read, and the writer lease."""
