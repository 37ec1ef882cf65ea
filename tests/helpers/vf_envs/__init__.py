"""Environments written for the ``verifiers`` library, for the tests of the ``verifiers``
environment. They run in verifiers' own Python (.venv-verifiers), found through this
directory on its PYTHONPATH: ``forge_vf_envs`` imports ``vf_scoring`` as a top-level
module, which the tests import as ``tests.helpers.vf_envs.vf_scoring`` to recompute the
rewards."""
