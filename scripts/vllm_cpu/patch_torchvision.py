"""Make PyPI's torchvision importable beside a CPU-only torch.

PyPI's torchvision is a CUDA build: its compiled ops (`torchvision::nms`, ...) cannot load
against torch+cpu, and `torchvision/_meta_registrations.py` then fails at import while
registering fake kernels for ops that do not exist. transformers' Gemma4 image processor
(and so vLLM's gemma4_mm, which DiffusionGemma uses) imports torchvision's pure-Python
transforms, so the registrations are made conditional on the ops having loaded.
Idempotent: run it again and it changes nothing.
"""

import importlib.util
from pathlib import Path

MARK = "# canvasroute: fake kernels only when torchvision's ops loaded"
GUARD = f'''
{MARK}
def _register_fake_if_loaded(op_name):
    if torchvision.extension._has_ops():
        return torch.library.register_fake(op_name)
    return lambda fn: fn

'''

spec = importlib.util.find_spec("torchvision")
assert spec is not None and spec.origin, "torchvision is not installed"
path = Path(spec.origin).parent / "_meta_registrations.py"
text = path.read_text()
if MARK not in text:
    decorated = text.replace('@torch.library.register_fake("torchvision::', '@_register_fake_if_loaded("torchvision::')
    anchor = decorated.index("\ndef register_meta(")  # the first definition after the imports
    path.write_text(decorated[:anchor] + "\n" + GUARD + decorated[anchor:])
print(f"torchvision fake-kernel registrations guarded in {path}")
