"""Run the plugin's tests from a checkout without installing it (src layout)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
