"""The consumers an export names: the programs its users load it with, and what each one
does with a checkpoint. One home for these facts; the recipe (which consumers it advertises),
the eval stage (which it measures), the gate (which must agree), the card (which it lists,
with their snippets) and `quantize verify` (vLLM) read them here.

An export is proven for a consumer only when that consumer, loading it its own way with no
extra code, computes what the project's reference decode computes (quantize.model.decode).
transformers 5.17-5.25 and lm-eval's `hf` model load compressed-tensors checkpoints but do
not apply a rotated export's online transforms (`transform_config`): such a checkpoint loads
without error there and computes another model. vLLM applies them (its Hadacore kernel, on
CUDA GPUs of capability >= 8.0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

ConsumerName = Literal["transformers", "lm-eval-hf", "transformers+transforms", "vllm"]

# Agreement with the reference decode that a consumer must show (both in fp32 on the same
# token windows): the mean KL divergence of its next-token distribution from the reference's
# at most this (the gate's row: agreement exp(-KL) >= exp(-MAX_KL)); top-1 agreement is
# reported beside it. A consumer that loads the same weights computes the same model up to
# rounding; one that drops a transform computes another (KL of nats, top-1 near 0).
MAX_KL = 0.01


@dataclass(frozen=True)
class Consumer:
    name: str
    label: str  # how the card and the gate name the way it loads
    online_transforms: bool  # applies a checkpoint's transform_config (online rotations)
    measured_by: Literal["eval", "verify"]  # eval: on this machine; verify: in vLLM


CONSUMERS: dict[str, Consumer] = {c.name: c for c in (
    Consumer("transformers", "transformers `AutoModelForCausalLM.from_pretrained`", False,
             "eval"),
    Consumer("lm-eval-hf", "lm-eval `hf` model (`HFLM(pretrained=...)`)", False, "eval"),
    Consumer("transformers+transforms", "transformers `from_pretrained`, then the card's "
             "snippet that attaches the online transforms (compressed-tensors "
             "`apply_transform_config`)", True, "eval"),
    Consumer("vllm", "vLLM (`vllm serve`, `LLM(model=...)`)", True, "verify"),
)}

# What a recipe advertises when it names none: every consumer that can load its export.
PORTABLE: tuple[ConsumerName, ...] = ("transformers", "lm-eval-hf", "vllm")
ONLINE: tuple[ConsumerName, ...] = ("vllm", "transformers+transforms")


def default_consumers(online_transforms: bool) -> tuple[ConsumerName, ...]:
    return ONLINE if online_transforms else PORTABLE


def cannot_apply(consumers: Sequence[str]) -> list[str]:
    """The consumers of `consumers` that load a rotated export without its online transforms."""
    return [c for c in consumers if not CONSUMERS[c].online_transforms]


def row_name(consumer: str) -> str:
    """The consumer's row in eval.json and gate.json."""
    return f"consumer:{consumer}"


# The lines of the card's transformers snippet that attach a rotated export's online
# transforms after a plain `from_pretrained`; the eval stage runs these very lines (with
# `repo` the export's folder and `model` the loaded model) to measure that consumer.
ATTACH_TRANSFORMS = '''\
from compressed_tensors.transform import TransformConfig, apply_transform_config
from transformers import AutoConfig

# transformers does not apply the online rotations this checkpoint stores: attach them
tc = TransformConfig.model_validate(
    AutoConfig.from_pretrained(repo).quantization_config["transform_config"])
for scheme in tc.config_groups.values():  # the weight-side ones are in the weights already
    scheme.apply = [a for a in scheme.apply if a.location in ("input", "output")]
apply_transform_config(model, tc)'''
