"""Run at the start of every Python process whose PYTHONPATH begins with this folder (the `bf16_matmul` fixture
sets it): bf16 products through float32 for the whole process (tests/bf16_matmul.py says why)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bf16_matmul  # noqa: E402

sys.path.pop(0)
if bf16_matmul.needed():
    bf16_matmul.Float32Products().__enter__()  # never left: the process ends with it
