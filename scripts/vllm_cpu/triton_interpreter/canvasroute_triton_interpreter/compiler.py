"""The compiler half: it claims the `cpu` target and refuses to compile anything."""

from triton.backends.compiler import BaseBackend, GPUTarget

_INTERPRET_ONLY = "this backend only runs Triton's interpreter: set TRITON_INTERPRET=1"


class InterpreterBackend(BaseBackend):
    @staticmethod
    def supports_target(target: GPUTarget) -> bool:
        return target.backend == "cpu"

    def hash(self) -> str:
        return "canvasroute-interpreter"

    def parse_options(self, options: dict) -> object:
        raise NotImplementedError(_INTERPRET_ONLY)

    def add_stages(self, stages: dict, options: object, language: object = None) -> None:
        raise NotImplementedError(_INTERPRET_ONLY)

    def load_dialects(self, context: object) -> None:
        return None

    def get_module_map(self) -> dict:
        return {}
