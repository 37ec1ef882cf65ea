"""The plugin system: plugins found through entry points, their backends' records and
classes, the index that lists them without importing them, the one-line problems, and what
the registry resolves in a config (backend options, docs/config.md).
"""
