"""``forgerl-files`` 0.1.0: a third-party transport written from docs/plugins-transport.md as
it stood on 2026-12-06 (git show 9bdf3e2:docs/plugins-transport.md, forgerl 0.1.0), the
tutorial's ``files`` transport in its package of its own. Like that day's generator and
trainer tutorials (``self.timeout = float(context.config.transport.timeout)``), it reads
the run's transport timeout from ``context.config``: the attribute forgerl 0.2.0 replaced
by the run's facts (``context.transport_timeout``). Kept as written: do not modernise it.
"""
