import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the suite runs only its own code through the sandbox: where namespaces are missing (some CI
# machines) the weak mode is acceptable here; tests of the refusal itself unset this
os.environ.setdefault("METALOOM_SANDBOX_WEAK", "1")
# Triton's kernels (the GPU's static step) are tested on the CPU under Triton's interpreter,
# which must be on before triton is first imported (it decorates its library then)
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from metaloom.models.kernels import isa

# the aarch64 builds under qemu: `make test-aarch64` (it sets this), not the main suite
collect_ignore = [] if os.environ.get("METALOOM_AARCH64") else ["aarch64"]


@pytest.fixture(params=isa.runnable())
def kernel_path(request):
    """The instruction-set path of metaloom's C kernels a test runs on: once for each one this
    CPU runs (`metaloom.models.kernels.isa`: avx512, avx2 and generic on an AVX-512 x86, avx2 and
    generic on an AVX2 one, neon and generic on aarch64), as ``METALOOM_ISA`` would force it."""
    with isa.using(request.param):
        yield request.param


@pytest.fixture
def path_kernels(kernel_path, request, monkeypatch):
    """For a kernel suite (a module whose KERNELS_OF gives its library: fused's or quant's
    `kernels`): its KERNELS set to the kernels of the path under test, built for exactly it."""
    available = request.module.KERNELS_OF()
    if available.kernels is None:
        pytest.skip(f"no kernels for {kernel_path}: {available.reason}")
    assert available.kernels.isa == kernel_path
    monkeypatch.setattr(request.module, "KERNELS", available.kernels)
    return available.kernels


@pytest.fixture(scope="session")
def smollm():
    """The real default model (SmolLM2-135M-Instruct), float32, native backend, its GGUF
    dequantised (``weights="dense"``: the weights transformers loads in the equivalence tests;
    native quantised weights are tested against it in test_native_weights.py)."""
    from metaloom.models import load

    return load("default", dtype="float32", weights="dense")


@pytest.fixture(scope="session")
def hf_smollm(smollm):
    """transformers' own implementation over the same converted weights."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm.folder, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm_generator(smollm):
    from metaloom.generator import LocalGenerator

    return LocalGenerator(smollm)
