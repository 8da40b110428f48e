"""CheckpointError alone: engine.checkpoint.io (plain file-system work, imported by the config
checks at start-up) raises and re-exports it without importing megatron-core through
models.bridge.checkpoint, which re-exports it too.

May import: nothing.
"""


class CheckpointError(FileNotFoundError):
    """A path that is not a readable checkpoint of this project."""
