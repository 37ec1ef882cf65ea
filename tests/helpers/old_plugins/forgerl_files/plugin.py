# src/forgerl_files/plugin.py (the tutorial's registration module, its transport only)
from forgerl.hookspecs import hookimpl


@hookimpl
def forge_transports():
    return ["forgerl_files.transport:FilesTransport"]
