"""bf16 matrix products on CPUs without bf16 instructions: the values torch's own kernel gives (the bf16 inputs
multiplied and summed in float32, rounded once to bf16), computed by the float32 kernel.

On a CPU without AVX512-BF16 or AMX (this project's machines and CI have AVX2), torch multiplies a bf16 matrix by a
row-major bf16 matrix in a single-threaded reference loop (pytorch/pytorch#146508): the input gradient of a frozen
Linear, grad_out @ W, takes 15 s at FLUX.1's width (32 x 3072 by 3072 x 15360) where the float32 product takes
0.25 s; one bf16 LoRA step there took 61 s, 15 s with this mode. The tests that train real-width models in bf16
check what this project does with dtypes, storage and shards, none of which this kernel decides; they take the
`bf16_matmul` fixture (conftest.py), which puts the mode on in the test's process and, through bf16_site/ on
PYTHONPATH, in every Python process the test starts (torchrun's workers). test_bf16_matmul.py checks the values
against torch's kernel.
"""

from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
PRODUCTS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default)
SITE = Path(__file__).resolve().with_name("bf16_site")  # holds the sitecustomize.py that puts the mode on


def needed() -> bool:
    """Whether torch's bf16 products take the slow path here: oneDNN runs them only on CPUs with bf16 support."""
    return not torch.ops.mkldnn._is_mkldnn_bf16_supported()


class Float32Products(TorchDispatchMode):
    """mm, addmm, bmm and baddbmm with bf16 operands (alpha and beta included) through float32, rounded to bf16."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in PRODUCTS and args[0].dtype == torch.bfloat16:
            wide = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
            return func(*wide, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)
