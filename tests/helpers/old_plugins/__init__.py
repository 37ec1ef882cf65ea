"""Plugins written against earlier forgerl releases, kept as they were written.

Each is copied into a fake installed distribution (a dist-info folder on ``sys.path``) by
the tests of tests/unit/test_old_plugins.py, which check that the current core runs it
(with a deprecation warning naming the replacement) or refuses it in one line.
"""
