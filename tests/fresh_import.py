"""A module attribute as a fresh interpreter sees it at import under an environment variable:
for the switches moeserve reads from MOESERVE_ variables at import (envs.py), checked without
reloading the module in the test process (a reload rebinds its globals, and the jitted helpers
other modules took from it stop working)."""

from __future__ import annotations

import os
import subprocess
import sys


def attribute_at_import(module: str, attribute: str, variable: str,
                        value: str | None) -> str:
    """str(module.attribute) in a fresh interpreter with `variable` set to value (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != variable}
    if value is not None:
        env[variable] = value
    read = f"import {module} as m; print(m.{attribute})"
    return subprocess.run([sys.executable, "-c", read], env=env, capture_output=True,
                          text=True, check=True).stdout.strip()
