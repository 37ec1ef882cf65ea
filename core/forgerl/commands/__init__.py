"""``forge`` subcommands that live in their own modules (registered in :mod:`forgerl.cli`)."""
