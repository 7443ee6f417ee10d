"""The tiny checkpoints of every source format (tests/fixtures/convert_models.py) as
session fixtures for the converter tests."""

from fixtures.convert_models import (  # noqa: F401 (fixtures)
    awq_dir,
    bf16_dir,
    bf16_mtp_dir,
    ct_dir,
    fp8_dir,
    fp8_even_dir,
    gptq_dir,
)
