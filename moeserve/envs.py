"""Every environment variable moeserve reads, in one typed place (all prefixed MOESERVE_).

    MOESERVE_API_PIDS_FILE   set by the `--api-servers` launcher for its API processes: a file
                             listing their pids (the summed API CPU metric reads it)
    MOESERVE_MOE_CONFIG_DIR  extra folder of tuned fused-MoE tile configs, searched first; a
                             tune at start-up writes there when it is set
    MOESERVE_CACHE_DIR       moeserve's on-disk cache (default $XDG_CACHE_HOME/moeserve, else
                             ~/.cache/moeserve); MoE tunes made at start-up go to moe_configs/
    MOESERVE_GIT_COMMIT      the commit to stamp on results where no git checkout is at hand
"""

from __future__ import annotations

import os

API_PIDS_FILE = "MOESERVE_API_PIDS_FILE"
MOE_CONFIG_DIR = "MOESERVE_MOE_CONFIG_DIR"
CACHE_DIR = "MOESERVE_CACHE_DIR"
GIT_COMMIT = "MOESERVE_GIT_COMMIT"


def api_pids_file() -> str | None:
    return os.environ.get(API_PIDS_FILE) or None


def moe_config_dir() -> str | None:
    return os.environ.get(MOE_CONFIG_DIR) or None


def cache_dir() -> str:
    """MOESERVE_CACHE_DIR, else $XDG_CACHE_HOME/moeserve, else ~/.cache/moeserve."""
    explicit = os.environ.get(CACHE_DIR)
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "moeserve")


def git_commit() -> str | None:
    return os.environ.get(GIT_COMMIT) or None
