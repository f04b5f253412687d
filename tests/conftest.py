"""Test-wide set-up: without a GPU, Triton kernels run through Triton's interpreter.

The variable must be set before anything imports triton (transformers does, for one), so it is
set here, when pytest loads this file, rather than in the kernel test modules.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
