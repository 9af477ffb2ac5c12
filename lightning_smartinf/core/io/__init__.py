"""Storage: direct I/O of state files, storage directories and their checks, one owner per directory."""
