"""The API process parses a checkpoint's config.json: that path must not import torch."""

from __future__ import annotations

import subprocess
import sys


def test_parsing_every_preset_imports_no_torch() -> None:
    code = ("import sys\n"
            "from moeserve.config import load_model_config\n"
            "from moeserve.presets import list_presets\n"
            "for name in list_presets():\n"
            "    load_model_config(name)\n"
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
