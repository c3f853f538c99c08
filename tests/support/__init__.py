"""Helpers of the test suite, not tests: the cases CI runs (``ci``), tiny Hugging Face
checkpoints (``hf_tiny``), the sharded cases run in subprocesses (``sharded_cases``) and the
script that pinned the tree tests' chains (``pin_chains``). Test modules import them as
``support.<name>`` (pytest puts ``tests/``, the folder of ``conftest.py``, on ``sys.path``)."""
