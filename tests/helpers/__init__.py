"""Helpers shared by the tests: models, references, launchers, servers and machine checks (imported as
``helpers.<module>``; ``tests/`` is on the path of every test and of the scripts they launch)."""
