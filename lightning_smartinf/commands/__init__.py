"""The ``smartinf`` command line (:mod:`.cli` dispatches): ``fit``/``validate``/``test`` (LightningCLI), ``demo``,
``report``, ``export``; ``plan`` and ``serve`` live with the planner and the remote devices."""
