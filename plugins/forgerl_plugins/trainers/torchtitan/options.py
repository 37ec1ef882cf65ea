"""Options of the backends registered in forgerl_plugins.trainers.torchtitan (imported only when validated)."""

from __future__ import annotations

from forgerl.options import OptionsModel


class TorchTitanTrainerOptions(OptionsModel):
    """No options yet (the backend is not implemented)."""
