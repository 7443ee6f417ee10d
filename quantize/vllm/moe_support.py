"""Whether this host's vLLM can run an export's mixture-of-experts layers.

vLLM runs MoE experts through fused-MoE kernels chosen apart from the dense Linear kernels
(vllm/model_executor/layers/fused_moe/oracle/*.py pick one of the experts classes in
layers/fused_moe/experts/), so an export whose every dense layer has a kernel on this host may
still be refused at load ("No WNA16 MoE backend supports the deployment configuration",
"Unsupported FP8 MoE backend"). The rules, each citing its vLLM file, are `KERNELS`' MoE
fields in quantize.recipe.schemes (`moe_cpu_problem`); this module applies them to a checkpoint
and the host a probe found. On a GPU every family this project writes has a fused-MoE kernel
(Marlin/Triton WNA16, FP8 and INT8 Triton), so only the CPU is checked.
"""

from __future__ import annotations

from quantize.model.config import ModelConfig
from quantize.model.moe import config_is_moe, routing_kind, silu_experts
from quantize.recipe.schemes import moe_cpu_problem
from quantize.vllm.host import Host
from quantize.vllm.support import CheckpointFormat, group_label


def moe_problem(fmt: CheckpointFormat, config: ModelConfig, host: Host) -> str | None:
    """Why this host's vLLM cannot run the export's MoE layers, or None (dense model, a GPU,
    or a CPU kernel exists)."""
    if host.device != "cpu" or fmt.quant is None or not config_is_moe(config):
        return None
    routing, silu = routing_kind(config), silu_experts(config)
    for g in fmt.groups:
        w = g.weights
        if w is None:
            continue
        why = moe_cpu_problem(g.kernel, w.num_bits, w.symmetric, w.strategy, routing, silu,
                              host.isa, host.ops)
        if why:
            return f"{group_label(g, fmt.quant)} MoE experts: {why}"
    return None
