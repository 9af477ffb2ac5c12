"""The name of the file a remote backend writes into a checkpoint's device-state directory (no gRPC needed to
recognise one)."""

#: Where the state is (each server's address, identity, session label, shards) and the digest of what each saved.
REMOTE_MANIFEST = "remote.json"
