"""Tests of the tests' bf16 products through float32 (bf16_matmul.py): the values torch's own bf16 kernel gives, in
forward and backward, and in the processes a test starts."""

import subprocess
import sys

import pytest
import torch

import bf16_matmul


def assert_torchs_values(got, native, magnitude, terms: int):
    """bf16 results that differ by float32 summation order at most: both sum K products in float32 (each within
    K 2^-24 of the exact sum, relative to the sum of the terms' magnitudes) and round once to bf16 (within one bf16
    step of each other); nearly all equal. magnitude: the sum of the terms' magnitudes, per element; terms: K."""
    assert got.dtype == native.dtype == torch.bfloat16 and got.shape == native.shape
    bound = torch.finfo(torch.bfloat16).eps * native.double().abs() + 2 * 2**-24 * terms * magnitude
    assert ((got.double() - native.double()).abs() <= bound).all()
    assert (got == native).double().mean() > 0.99


@pytest.mark.parametrize("transposed", [False, True])
def test_products_give_torchs_bf16_values(transposed):
    g = torch.Generator().manual_seed(0)
    a, bias = torch.randn(7, 300, generator=g).bfloat16(), torch.randn(40, generator=g).bfloat16()
    b = torch.randn(40, 300, generator=g).bfloat16().t() if transposed else torch.randn(300, 40, generator=g).bfloat16()
    batch_a, batch_b = torch.randn(3, 7, 300, generator=g).bfloat16(), torch.randn(3, 300, 40, generator=g).bfloat16()
    batch_bias = torch.randn(3, 7, 40, generator=g).bfloat16()
    scaled = dict(beta=0.5, alpha=2.0)
    for op, args, kwargs in [(torch.mm, (a, b), {}), (torch.addmm, (bias, a, b), scaled),
                             (torch.bmm, (batch_a, batch_b), {}), (torch.baddbmm, (batch_bias, batch_a, batch_b), scaled)]:
        native = op(*args, **kwargs)
        magnitude = op(*(x.double().abs() for x in args), **kwargs)
        with bf16_matmul.Float32Products():
            assert_torchs_values(op(*args, **kwargs), native, magnitude, terms=300)


def test_a_linear_layers_backward_goes_through_float32_with_torchs_values():
    seen = []

    class Recording(bf16_matmul.Float32Products):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return super().__torch_dispatch__(func, types, args, kwargs)

    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 96).bfloat16()
    x = torch.randn(5, 256, dtype=torch.bfloat16, requires_grad=True)

    def grads():
        x.grad = layer.weight.grad = None
        layer(x).square().sum().backward()
        return x.grad, layer.weight.grad

    native = grads()
    with Recording():
        emulated = grads()
    magnitudes = (2 * layer(x).abs() @ layer.weight.abs(), 2 * layer(x).abs().t() @ x.abs())  # d(y^2)/dy = 2y
    for got, want, magnitude, terms in zip(emulated, native, magnitudes, (96, 5)):
        assert_torchs_values(got, want, magnitude.detach().double(), terms)
    assert seen.count(torch.ops.aten.mm.default) == 2  # the input's and the weight's gradient


def test_the_fixture_puts_the_mode_on_in_the_processes_a_test_starts(bf16_matmul_fast):
    probe = ("import torch; from torch.utils._python_dispatch import _get_current_dispatch_mode as mode; "
             "print(type(mode()).__name__)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ("Float32Products" if bf16_matmul.needed() else "NoneType")
