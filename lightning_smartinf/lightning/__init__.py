"""The Lightning integration: the strategy and what it hands Lightning (its checkpoint hooks, the engine's set-up,
precision, callbacks, activation offload's hooks, the training monitor, Lightning's DeepSpeed strategy on CPUs, and
the filters of warnings that do not apply).

The one layer that imports Lightning. It drives the Lightning-free core (:mod:`lightning_smartinf.core`) through the
ZeRO adapter (:mod:`lightning_smartinf.zero`, the one place that imports DeepSpeed's internals).
"""
