"""The one exception tree of forgerl.

Everything forgerl raises on purpose derives from :class:`ForgeError`. Errors a user
can fix themselves (a bad config, an unknown backend, a missing extra, an unreadable
file, an unreachable server) set ``user_fixable = True``: the CLI prints them as one
line that says what to do and exits with status 2, without a traceback (``--debug``
shows it). Everything else is a bug or an environment failure and keeps its traceback.
"""

from __future__ import annotations


class ForgeError(Exception):
    """Root of every error forgerl raises on purpose."""

    user_fixable: bool = False


class UserError(ForgeError):
    """Something the user can fix; printed as one line, exit status 2."""

    user_fixable = True


class ConfigError(UserError):
    """A config file, flag or ``--set`` value is invalid."""


class PluginError(ForgeError):
    """A plugin is broken: it failed to import, or misdeclares its hooks or backends."""


class DuplicateBackend(PluginError, UserError):
    """Two installed plugins claim the same backend name."""


class PluginLoadError(PluginError, UserError):
    """A plugin the user named explicitly (FORGE_PLUGINS, an import path) cannot be imported."""


class BrokenPlugin(PluginError, UserError):
    """A third-party plugin failed to load, implements an unknown hook or registers
    something wrong, and ``FORGE_STRICT_PLUGINS=1`` makes that an error (else a warning).
    The fix is the user's: upgrade, uninstall or disable that plugin."""


class BackendLoadError(PluginError, UserError):
    """A backend was registered fine but a module it names (its factory, options model,
    pre-flight check or roles) fails to import; the message names the plugin and backend."""


class BackendContractError(PluginError, UserError):
    """A backend's factory does not accept the arguments forgerl builds its kind with
    (:mod:`forgerl.contract`): a plugin written for another forgerl version. The fix is the
    user's: upgrade the plugin (or forgerl), or stop selecting that backend."""


class PluginAPIError(PluginError, UserError, AttributeError):
    """A plugin uses a name the plugin API no longer has (:mod:`forgerl.deprecation`): a
    plugin written for another forgerl version. The message names the plugin, what it used
    and what to use instead; the fix is the user's: upgrade the plugin. Also an
    AttributeError, so that a plugin's ``getattr(obj, name, default)`` still falls back."""


class UnknownBackend(UserError):
    """A backend name was selected that no installed plugin provides."""


class BackendUnavailable(UserError):
    """A backend exists but cannot run here: its extra is not installed, or it is not built yet."""


class NotSupported(UserError):
    """A backend was asked for something its capability flags say it cannot do (e.g.
    ``forge logs`` for a scheduler whose ``supports_logs`` is False)."""


class ImageError(UserError):
    """An image in a prompt or a message cannot be used: not an image, truncated, too large,
    too many, or a reference forgerl refuses to follow (a network URL). One line; the sample
    that carries it fails and the run goes on."""


class SchedulerError(ForgeError):
    """A scheduler failed to submit, watch or cancel a job."""


class JobNotFound(UserError):
    """``forge status|logs|cancel`` was given a job id the scheduler does not know."""


class GeneratorError(ForgeError):
    """A generator failed to produce completions or to load weights."""


class GeneratorUnreachable(GeneratorError, UserError):
    """No generator replica answered (server down, wrong address)."""


class TransportError(ForgeError):
    """Moving weights from the trainer to the generators failed."""


class TransportTimeout(TransportError):
    """A weight transfer did not complete within its configured timeout."""


class RewardError(ForgeError):
    """A reward function failed; the loop scores that sample as failed and goes on."""


class TeacherError(ForgeError):
    """A distillation teacher could not score (its server failed, an answer was not one);
    the loop leaves the samples it failed out of the step and goes on."""


class RunWriteError(UserError):
    """A file of the run (config.yaml, metrics.jsonl, submission.json, a job file) could not
    be written: the disk is full, a quota is reached, the file system is read-only, or the
    folder is not writable. Nothing half-written is left behind; the message names the file,
    the cause and what to do (:mod:`forgerl.rundirs.diskerrors`)."""


class CheckpointError(ForgeError):
    """A checkpoint could not be written, or a run directory cannot be resumed."""


class ResumeError(CheckpointError, UserError):
    """``--resume`` points at something that is not a resumable run directory."""


class CheckpointUnusable(CheckpointError, UserError):
    """A checkpoint (or one file of it) is missing, truncated, of another format or
    tampered with; resuming falls back to an earlier checkpoint when one is usable."""


class CheckpointWriteError(CheckpointError, UserError):
    """A checkpoint could not be written (disk full, no permission); the previous one
    stays usable and the run stops so that the user can fix the disk and resume."""
