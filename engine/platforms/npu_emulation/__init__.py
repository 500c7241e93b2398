"""TEST-ONLY emulation of documented semantics, not the hardware: plain-torch, CPU stand-ins
for exactly the torch_npu calls engine/platforms/npu.py makes, so CI can run that platform.

Each stand-in checks its arguments against the constraints the op-plugin / torch_npu
documentation states (see docs/npu.md) and raises NpuEmulationError naming the constraint,
then computes what the documentation says the op computes (layer ops in float32, cast back
once; attention with torch SDPA and the MoE ops' matmuls and sums in the input dtype, as the
CPU platform does). It says nothing about performance, real kernel numerics or on-device
behaviour; a call that passes here may still fail on an Ascend device for reasons no
document states.

Graph capture (`npu.NPUGraph`, `npu.graph`) is emulated by recording: while capturing,
every aten op and every emulated kernel launch is run once and recorded with its arguments;
replay re-runs the records in order over the same tensors and copies fresh results into the
captured outputs. Host-side arguments (Python lists such as actual_seq_kvlen) are frozen at
capture, as on the device, unless a task group is updated (graph_task_update_begin/end).
Reading a device value on the host during capture (.item(), .tolist(), bool(t)) is refused,
as a real capture cannot do it. Memory pools, streams and events are not modelled.
Enabled only by BATON_NPU_EMULATION=1 (engine/platforms/npu.py); never in production.
"""
from __future__ import annotations

from types import SimpleNamespace

from baton.engine.platforms.npu_emulation.attention import (
    _fia_out,
    _fia_workspace,
    _npu_reshape_and_cache,
    npu_fused_infer_attention_score_v2,
)
from baton.engine.platforms.npu_emulation.capture import (
    _STREAM,
    EmulatedNPUGraph,
    _device,
    _GraphContext,
    _group_begin,
    _group_end,
    _host_memory,
    _kernel,
    _PoolHandle,
    _set_device,
    _state,
    _update_begin,
    _update_end,
)
from baton.engine.platforms.npu_emulation.common import NpuEmulationError  # noqa: F401  (re-exported for tests)
from baton.engine.platforms.npu_emulation.layer_ops import (
    npu_add_rms_norm,
    npu_rms_norm,
    npu_rotary_mul,
    npu_swiglu,
)
from baton.engine.platforms.npu_emulation.moe import (
    npu_grouped_matmul,
    npu_moe_gating_top_k_softmax,
    npu_moe_init_routing_v2,
    npu_moe_token_unpermute,
)
from baton.engine.platforms.npu_emulation.quant import npu_dynamic_quant, npu_quant_matmul
from baton.engine.platforms.npu_emulation.weight_quant import (
    npu_convert_weight_to_int4pack,
    npu_weight_quant_batchmatmul,
)


def emulated_torch_npu() -> SimpleNamespace:
    """A stand-in for the torch_npu module as npu.py uses it: fused ops at the top level, the
    runtime (what torch_npu.npu / torch.npu provide) under `.npu`, and `device(index)`, which
    has no torch_npu counterpart (npu.py builds torch.device("npu", i) itself on a real host)."""
    fia = _kernel(npu_fused_infer_attention_score_v2)
    fia.out = _kernel(_fia_out)
    runtime = SimpleNamespace(
        NPUGraph=EmulatedNPUGraph, graph=_GraphContext, graph_pool_handle=lambda: _PoolHandle(0),
        synchronize=lambda device=None: None, mem_get_info=_host_memory, set_device=_set_device,
        empty_cache=lambda: None,
        device_count=lambda: 1, current_stream=lambda device=None: _STREAM,
        is_current_stream_capturing=lambda: _state.graph is not None,
        graph_task_group_begin=_group_begin, graph_task_group_end=_group_end,
        graph_task_update_begin=_update_begin, graph_task_update_end=_update_end,
    )
    return SimpleNamespace(
        EMULATED=True,
        npu_fused_infer_attention_score_v2=fia,
        _npu_fused_infer_attention_score_v2_get_max_workspace=_kernel(_fia_workspace),
        _npu_reshape_and_cache=_kernel(_npu_reshape_and_cache),
        npu_rms_norm=_kernel(npu_rms_norm),
        npu_add_rms_norm=_kernel(npu_add_rms_norm),
        npu_rotary_mul=_kernel(npu_rotary_mul),
        npu_swiglu=_kernel(npu_swiglu),
        npu_moe_gating_top_k_softmax=_kernel(npu_moe_gating_top_k_softmax),
        npu_moe_init_routing_v2=_kernel(npu_moe_init_routing_v2),
        npu_grouped_matmul=_kernel(npu_grouped_matmul),
        npu_moe_token_unpermute=_kernel(npu_moe_token_unpermute),
        npu_dynamic_quant=_kernel(npu_dynamic_quant),
        npu_quant_matmul=_kernel(npu_quant_matmul),
        npu_convert_weight_to_int4pack=npu_convert_weight_to_int4pack,       # at load, never captured
        npu_weight_quant_batchmatmul=_kernel(npu_weight_quant_batchmatmul),
        npu=runtime,
        device=_device,
    )
