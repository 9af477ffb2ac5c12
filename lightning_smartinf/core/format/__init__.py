"""On-disk formats: chunk records of a shard's state, state files and their manifest, a rank's device state."""
