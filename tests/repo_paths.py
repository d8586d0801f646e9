"""Paths the tests share, wherever a test file sits under ``tests/`` (``tests/conftest.py`` puts
this folder on ``sys.path``, so ``import repo_paths`` and the helper modules beside it work from
``tests/unit/<layer>/`` and ``tests/integration/``)."""

import os

TESTS = os.path.dirname(os.path.abspath(__file__))  # tests/: helpers, workers, data, scripts
ROOT = os.path.dirname(TESTS)                         # the repository root
