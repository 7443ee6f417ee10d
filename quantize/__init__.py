"""quantize: recipe → calibrate → quantize → export → eval → gate, checked and resumable."""

import logging as _logging

__version__ = "0.1.0"

# torchao (brought by the optional GPTQModel extra; transformers imports it whenever it is
# installed) logs at import that its CUDA libraries do not load, and torch logs an enum
# deprecation for it: noise on every command of a CPU machine, not a problem.
_logging.getLogger("torchao").setLevel(_logging.ERROR)
_logging.getLogger("torch.utils._pytree").setLevel(_logging.ERROR)
