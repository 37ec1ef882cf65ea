"""First-party backends of forgerl.

Each module registered in pyproject.toml's ``forgerl`` entry-point group is a plugin,
exactly as a third-party one would be. Registration modules import nothing heavy; the
implementation lives in sibling modules that a backend's factory names as a string.
"""
