"""The driver half: one CPU device, no streams; benchmarks time one plain call."""

import time

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase


class InterpreterDriver(DriverBase):
    def __init__(self) -> None:
        pass

    @classmethod
    def is_active(cls) -> bool:
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cpu", "x86_64", 0)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device: int) -> None:
        pass

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_device_interface(self):  # -> torch's module for the device
        return torch.cpu

    def get_benchmarker(self):
        def bench(fn, *args, **kwargs) -> float:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3

        return bench
