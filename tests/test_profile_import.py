"""mpsim.models.profile_import: PyTorch profiler (Kineto) traces into per-kernel samples.

The fixtures under tests/data/kineto/ are hand-written in the shape of real traces (see
their notes in this file); the kernel names are real ones, from public traces and docs.
One test makes a real CPU trace with torch.profiler to hold the argument positions to
what PyTorch writes."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mpsim.errors import MpsimError
from mpsim.models.profile_import import (
    KERNEL_CLASSES,
    KERNEL_PATTERNS,
    KernelSample,
    Profile,
    attention_shape,
    classify_kernel,
    conv_shape,
    gemm_shape,
    op_bytes,
    read_profile,
)

DATA = Path(__file__).resolve().parent / "data" / "kineto"
H100 = DATA / "h100_train_step.json"  # record_shapes, 2 steps, kernels' External id == correlation
A100 = DATA / "a100_no_shapes.json"  # no record_shapes, no ProfilerStep
V100 = DATA / "v100_resnet_steps.json.gz"  # gzipped, 3 steps, kernels' External id == their op's


def _one(profile: Profile, op: str, kernel_part: str = "") -> KernelSample:
    found = [s for s in profile.samples if s.op == op and kernel_part in s.kernel]
    assert len(found) == 1, [(s.op, s.kernel[:40]) for s in profile.samples]
    return found[0]


# ----------------------------------------------------------------------------- classification

REAL_NAMES = [
    # cuBLAS / cuBLASLt / CUTLASS GEMMs
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off"
     "_kernel__5x_cublas",
     "gemm"),
    ("sm90_xmma_gemm_bf16f32_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_"
     "kernel__5x_cublas",
     "gemm"),
    ("ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_tn", "gemm"),
    ("volta_h884gemm_128x256_ldg8_nn", "gemm"),
    ("volta_sgemm_64x32_sliced1x4_tn", "gemm"),
    ("ampere_sgemm_32x32_sliced1x4_tn", "gemm"),
    ("void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_256x64_16x4_nn_align4>("
     "cutlass_80_tensorop_s1688gemm_256x64_16x4_nn_align4::Params)",
     "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, float, float, float, true, true, false>("
     "cublasLt::cublasSplitKParams<float>, float const*, float const*, float*, float const*, float const*,"
     " float const*, float const*, float*, void*, long, float*, int*)",
     "gemm"),
    ("void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false, "
     "cublasGemvParams<cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float "
     "const>, cublasGemvTensorStridedBatched<float>, float> >",
     "gemm"),
    ("void cutlass::device_kernel<dpsk::grouped_gemm::cuda::fp8_ptp128c::GemmKernel>(dpsk::grouped_gemm"
     "::cuda::fp8_ptp128c::GemmKernel::Params)",
     "gemm"),
    # fused attention
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64, 64, 4, false, false, cutlass"
     "::bfloat16_t",
     "attention"),
    ("flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::half_t>>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention"),
    ("fmha_cutlassF_f16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::half_t, "
     "cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)",
     "attention"),
    ("void flash::compute_attn_ws<Flash_fwd_kernel_traits<192, 128, 128, 12, 2, false, 1, cutlass"
     "::bfloat16_t, 128>, true, flash::SingleTileScheduler, flash::SeqLenTraits<true> >(flash"
     "::CollectiveMainloopFwd<Flash_fwd_kernel_traits<192,",
     "attention"),
    ("void cutlass::device_kernel<flash::FlashAttnBwd<flash::CollectiveMainloopBwd<2, cute::tuple<cute::C<"
     "1>, cute::C<1>, cute::C<1> >, cute::tuple<cute::C<64>, cute::C<128>, cute::C<192> >",
     "attention"),
    ("cudnn_generated_fort_native_sdpa_sm120_flash_fprop_f16_knob_3_64x64x128_4x1x1_cga1x1x1", "attention"),
    # cuDNN convolutions
    ("sm80_xmma_fprop_implicit_gemm_indexed_tf32f32_tf32f32_f32_nhwckrsc_nchw_tilesize128x128x16_stage4_wa"
     "rpsize2x2x1_g1_tensor16x8x8_alignc4_execute_kernel_cudnn",
     "conv"),
    ("sm80_xmma_wgrad_implicit_gemm_indexed_tf32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x128x16_stage4_wa"
     "rpsize2x2x1_g1_tensor16x8x8_execute_kernel_cudnn_train",
     "conv"),
    ("void cudnn::winograd_nonfused::winogradForwardData4x4<float, float>(cudnn::winograd_nonfused"
     "::WinogradDataParams<float, float>)",
     "conv"),
    ("cudnn_infer_volta_scudnn_winograd_128x128_ldg1_ldg4_relu_tile148t_nt_v1", "conv"),
    ("cudnn_ampere_scudnn_128x64_relu_xregs_large_nn_v1", "conv"),
    ("void cutlass_cudnn_infer::Kernel<"
     "cutlass_tensorop_s1688dgrad_optimized_tf32_128x128_16x4_nhwc_unity_stride_align4>("
     "cutlass_tensorop_s1688dgrad_optimized_tf32_128x128_16x4_nhwc_unity_stride_align4::Params)",
     "conv"),
    ("void wgrad_alg0_engine<float, 128, 6, 7, 3, 3, 5, false, 512>(int, int, int, float const*, int, "
     "float*, float const*, kernel_grad_params, unsigned long long, int, float, int, int, int, int)",
     "conv"),
    ("void fft2d_r2c_32x32<float, false, 0u, false>(float2*, float const*, int, int, int, int, int, int, "
     "int, int, int, cudnn::reduced_divisor, bool, int2, int, int)",
     "conv"),
    ("cask_cudnn_infer::computeBOffsetsKernel(cask_cudnn_infer::ComputeBOffsetsParams)", "conv"),
    ("_ZN19cutlass_cudnn_train6KernelINS_4conv6kernel23ImplicitGemmConvolutionINS1_11threadblock22Implicit"
     "GemmMultistage",
     "conv"),
    # collectives
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)", "communication"),
    ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclWorkElem)", "communication"),
    ("ncclDevKernel_AllReduce_Sum_f32_TREE_LL", "communication"),
    ("void dpsk::ep::internode::dispatch<false, 8, true, 8>(int4*, float*, long*, float*, dpsk::ep"
     "::internode::SourceMeta*)",
     "communication"),
    # memory-bound
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, at"
     "::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, at::detail::Array<"
     "char*, 3>)",
     "memory"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float,"
     " at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, "
     "float)#1}>",
     "memory"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>(int, float, "
     "float const*, float const*, float const*, float*, float*, float*)",
     "memory"),
    ("void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, true, false>(float*, "
     "float const*, int, int, int, bool const*, int, bool)",
     "memory"),
    ("void at::native::(anonymous namespace)::fused_dropout_kernel_vec<float, float, unsigned int, 1, 4, "
     "bool>(at::cuda::detail::TensorInfo<float, unsigned int>",
     "memory"),
    ("void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float>, float, float, float, "
     "float, float, float, adamMode_t, float, int, int>(int, int volatile*, TensorListMetadata<4>, "
     "AdamFunctor<float>, float, float, float, f",
     "memory"),
    ("void cudnn::bn_fw_tr_1C11_singleread<float, 512, true, 1, 2, 0>(cudnn::bn_fw_tr_1C11_args<float>)", "memory"),
    ("void cudnn::ops::nchwToNhwcKernel<float, float, float, false, true, (cudnnKernelDataType_t)0>(cudnn"
     "::ops::nchw2nhwc_params_t<float>, float const*, float*)",
     "memory"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 1, 128, 1>(float*, "
     "at::native::(anonymous namespace)::CatArrInputTensorMetadata<float, unsigned int, 128, 1>",
     "memory"),
    ("void layer_norm::ln_fwd_kernel<layer_norm::Kernel_traits<__nv_bfloat16, __nv_bfloat16, "
     "__nv_bfloat16, __nv_bfloat16, float, unsigned int, 7168u, 1u, 1u, 4u, 16u",
     "memory"),
    ("void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernel<float, float>(long, long, float "
     "const*, float const*, float const*, float const*, float*, float*)",
     "memory"),
    ("void fbgemm_gpu::permute_2D_data_kernel<false, int, int, decltype(nullptr)>(int, int, int, int "
     "const*, decltype(nullptr) const*, int const*, int const*, int const*, int*, decltype(nullptr)*)",
     "memory"),
    ("void cub::DeviceScanKernel<cub::AgentScanPolicy<128, 15, int, (cub::BlockLoadAlgorithm)3", "memory"),
    ("rotary_kernel", "memory"),
    # DMA copies
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("Memcpy HtoD (Pageable -> Device)", "copy"),
    ("Memset (Device)", "copy"),
    # none of the above
    ("cuda::unique_group_indices_impl(long*, int, int, int)", "other"),
]


@pytest.mark.parametrize(("name", "expected"), REAL_NAMES, ids=[n[:48] for n, _ in REAL_NAMES])
def test_real_kernel_names_are_classified(name, expected):
    assert classify_kernel(name, None) == expected


def test_the_table_names_only_known_classes_and_compiles():
    assert {cls for _, cls in KERNEL_PATTERNS} <= set(KERNEL_CLASSES)
    for pattern, _ in KERNEL_PATTERNS:
        re.compile(pattern)


@pytest.mark.parametrize(("name", "op", "expected"), [
    ("Kernel2", "aten::mm", "gemm"),  # cuBLAS's SIMT kernel on consumer GPUs says nothing
    ("triton__0d1d2d", "aten::mul", "memory"),
    ("triton__0d1d2d", "CompiledFunction", "other"),
    ("triton__0d1d2d", None, "other"),
    ("some_custom_kernel", "record_param_comms", "communication"),
    ("some_custom_kernel", "aten::_efficient_attention_forward", "attention"),
    ("some_custom_kernel", "aten::convolution_backward", "conv"),
])
def test_an_unknown_symbol_takes_the_class_of_its_launching_op(name, op, expected):
    assert classify_kernel(name, op) == expected


def test_a_gemm_kernel_launched_by_a_convolution_is_conv():
    """cuDNN runs some convolutions as cuBLAS GEMMs (in HTA's V100 ResNet trace, volta_sgemm_* kernels are
    launched by aten::cudnn_convolution)."""
    assert classify_kernel("volta_sgemm_64x64_nn", "aten::cudnn_convolution") == "conv"
    assert classify_kernel("volta_sgemm_64x64_nn", "aten::mm") == "gemm"
    assert classify_kernel("volta_sgemm_64x64_nn", None) == "gemm"


# ----------------------------------------------------------------------------- a trace with shapes


@pytest.fixture(scope="module")
def h100() -> Profile:
    return read_profile(H100)


def test_gemm_samples_get_m_n_k_batch_for_mm_addmm_and_bmm(h100):
    addmm = _one(h100, "aten::addmm")  # nn.Linear's (2048, 1024) x (1024, 4096) after folding (4, 512)
    assert addmm.gemm == (2048, 4096, 1024, 1)
    assert addmm.kernel_class == "gemm" and addmm.dtype == "bf16"
    assert addmm.duration_s == pytest.approx(85.5e-6)
    assert addmm.input_dims == ((4096,), (2048, 1024), (1024, 4096), (), ())
    assert addmm.input_dtypes == ("c10::BFloat16", "c10::BFloat16", "c10::BFloat16", "Scalar", "Scalar")
    mm = [s for s in h100.samples if s.op == "aten::mm"]
    assert [s.gemm for s in mm] == [(2048, 1024, 4096, 1), (1024, 256, 512, 1)]
    bmm = _one(h100, "aten::bmm")
    assert bmm.gemm == (512, 512, 128, 64)
    assert bmm.dtype == "fp32"  # "float": TF32 math cannot be told from the trace


def test_linear_with_a_3d_input_folds_its_leading_dimensions():
    dims = [[4, 512, 1024], [4096, 1024], [4096]]  # input (..., k), weight (n, k), bias
    assert gemm_shape("aten::linear", dims) == (2048, 4096, 1024, 1)
    assert gemm_shape("aten::linear", [[7, 1024], [4096, 1024]]) == (7, 4096, 1024, 1)
    assert gemm_shape("aten::linear", [[4, 512, 1000], [4096, 1024]]) is None  # k disagrees


@pytest.mark.parametrize(("op", "dims", "expected"), [
    ("aten::mm", [[64, 32], [32, 16]], (64, 16, 32, 1)),
    ("aten::addmm", [[16], [64, 32], [32, 16], [], []], (64, 16, 32, 1)),
    ("aten::bmm", [[8, 64, 32], [8, 32, 16]], (64, 16, 32, 8)),
    ("aten::baddbmm", [[8, 64, 16], [8, 64, 32], [8, 32, 16], [], []], (64, 16, 32, 8)),
    ("aten::matmul", [[2, 3, 4], [4, 5]], (6, 5, 4, 1)),  # folded into one mm, as PyTorch does
    ("aten::matmul", [[3, 2, 3, 4], [2, 4, 5]], (3, 5, 4, 6)),  # broadcast batch 3 x 2
    ("aten::matmul", [[4], [4, 5]], (1, 5, 4, 1)),
    ("aten::matmul", [[2, 3, 4], [4]], (6, 1, 4, 1)),
    ("aten::mv", [[64, 32], [32]], (64, 1, 32, 1)),
    ("aten::_scaled_mm", [[64, 32], [32, 16], [], [], [], [], [], []], (64, 16, 32, 1)),
    ("aten::mm", [[64, 32], [16, 16]], None),
    ("aten::add", [[64, 32], [64, 32]], None),
])
def test_gemm_shape(op, dims, expected):
    assert gemm_shape(op, dims) == expected


def test_attention_ops_give_their_problem_forward_and_backward(h100):
    fwd = _one(h100, "aten::_flash_attention_forward")  # (batch, seq, heads, dim) layout
    assert fwd.kernel_class == "attention" and fwd.dtype == "bf16"
    assert fwd.attention == {"batch": 4, "heads": 16, "kv_heads": 16, "s_q": 512, "s_k": 512, "head_dim": 64,
                             "causal": True, "backward": False, "varlen": False}
    bwd = [s for s in h100.samples if s.op == "aten::_flash_attention_backward"]
    assert len(bwd) == 2 and bwd[0].op_id == bwd[1].op_id  # one call, two kernels
    assert all(s.attention is not None and s.attention["backward"] and s.attention["causal"] for s in bwd)
    assert bwd[1].duration_s == pytest.approx(260e-6)


def test_attention_shape_layouts_gqa_varlen_and_unknown_causal():
    q, kv = [2, 32, 1024, 128], [2, 8, 2048, 128]  # SDPA's (batch, heads, seq, dim); 8 KV heads
    sdpa = attention_shape("aten::_scaled_dot_product_efficient_attention", [q, kv, kv, [], [], [], []])
    assert sdpa is not None
    assert (sdpa["batch"], sdpa["heads"], sdpa["kv_heads"], sdpa["s_q"], sdpa["s_k"], sdpa["head_dim"]) == \
        (2, 32, 8, 1024, 2048, 128)
    assert sdpa["causal"] is None  # no Concrete Inputs
    # varlen flash: 3 sequences packed into 1000 tokens, the longest 500
    packed = [[1000, 16, 64], [1000, 16, 64], [1000, 16, 64], [4], [4], [], [], [], [], []]
    concrete = ["", "", "", "", "", "500", "500", "0.", "False", "False"]
    var = attention_shape("aten::_flash_attention_forward", packed, concrete)
    assert var is not None and var["varlen"] and (var["batch"], var["s_q"], var["causal"]) == (3, 500, False)
    # memory-efficient attention says causal with a mask type (1: from the top left)
    bmhk = [1, 256, 8, 64]
    eff = attention_shape("aten::_efficient_attention_forward", [bmhk, bmhk, bmhk] + [[]] * 7,
                          ["", "", "", "", "", "", "", "", "0.", "1"])
    assert eff is not None and eff["causal"] is True and (eff["batch"], eff["s_q"], eff["heads"]) == (1, 256, 8)
    assert attention_shape("aten::mm", [q, kv]) is None


def test_an_elementwise_op_moves_its_inputs_and_its_output(h100):
    add = _one(h100, "aten::add")
    assert add.kernel_class == "memory"
    assert add.bytes_moved == 3 * 4 * 512 * 1024 * 2 and add.bytes_basis == "inputs_and_output"
    mul = _one(h100, "aten::mul_")  # in place: reads self and the (1024,) scale, writes self
    assert mul.bytes_moved == 2 * 4 * 512 * 1024 * 2 + 1024 * 2
    copy = _one(h100, "aten::copy_")
    assert copy.kernel_class == "copy" and copy.bytes_moved == 4194304 and copy.bytes_basis == "copy_size"
    foreach = _one(h100, "aten::_foreach_add_")  # a tensor list: sizes without one dtype
    assert foreach.kernel_class == "memory" and foreach.bytes_moved is None
    assert foreach.input_dims == ((), (), ())
    assert _one(h100, "aten::addmm").bytes_moved is None  # shapes describe GEMMs, not bytes


def test_op_bytes_rules():
    bf = "c10::BFloat16"
    assert op_bytes("aten::mul", [[8, 1], [1, 16]], [bf, bf]) == (8 * 2 + 16 * 2 + 8 * 16 * 2, "inputs_and_output")
    assert op_bytes("aten::gt", [[8, 16], []], ["float", "Scalar"]) == (8 * 16 * 4 + 8 * 16, "inputs_and_output")
    assert op_bytes("aten::fill_", [[8, 16], []], ["float", "Scalar"]) == (8 * 16 * 4, "inputs_and_output")
    assert op_bytes("aten::_softmax", [[4, 128], [], []], [bf, "Scalar", "Scalar"]) == (2 * 4 * 128 * 2,
                                                                                          "inputs_and_output")
    assert op_bytes("aten::sum", [[8, 16], [], [], []], ["float", "ScalarList", "Scalar", ""]) == (8 * 16 * 4,
                                                                                                   "inputs_only")
    assert op_bytes("aten::cat", [[], []], ["TensorList", "Scalar"]) is None


def test_kernels_outside_any_op(h100):
    nccl = [s for s in h100.samples if s.kernel_class == "communication"]
    assert len(nccl) == 1 and nccl[0].op is None and nccl[0].input_dims is None and nccl[0].gemm is None
    assert nccl[0].duration_s == pytest.approx(95e-6)
    # launched without a recorded launch call, its External id being its correlation: no op (not a stranger's)
    orphan = [s for s in h100.samples if s.op is None and s.kernel_class == "memory"]
    assert len(orphan) == 1 and orphan[0].op_id is None


def test_steps_device_and_classes(h100):
    assert h100.steps == 2
    assert (h100.device_name, h100.sm_count) == ("NVIDIA H100 80GB HBM3", 132)
    groups = h100.by_class()
    assert list(groups) == list(KERNEL_CLASSES)
    assert {c: len(v) for c, v in groups.items()} == {"gemm": 4, "attention": 3, "conv": 0, "memory": 4,
                                                      "communication": 1, "copy": 1, "other": 0}
    starts = [s.start_us for s in h100.samples]
    assert starts == sorted(starts)
    assert len({hash(s) for s in h100.samples}) == len(h100.samples)  # hashable despite the dict fields


# ----------------------------------------------------------------------------- no shapes, gzip


def test_a_trace_without_record_shapes_keeps_classes_and_times():
    p = read_profile(A100)
    assert p.steps == 1 and (p.device_name, p.sm_count) == ("NVIDIA A100-SXM4-80GB", 108)
    summary = [(s.kernel_class, s.op, round(s.duration_s * 1e6, 3)) for s in p.samples]
    assert summary == [("gemm", "aten::mm", 21.0), ("attention", "aten::_efficient_attention_forward", 55.0),
                       ("memory", "aten::mul", 4.5), ("copy", "aten::fill_", 1.0), ("other", "CompiledFunction", 6.0),
                       ("communication", None, 30.0)]
    assert all(s.input_dims is None and s.input_dtypes is None and s.dtype is None for s in p.samples)
    assert all(s.gemm is None and s.attention is None and s.conv is None for s in p.samples)
    memset = _one(p, "aten::fill_")
    assert memset.bytes_moved == 2048 and memset.bytes_basis == "copy_size"
    assert _one(p, "aten::mul").bytes_moved is None


def test_a_gzipped_trace_with_convolutions_and_three_steps():
    p = read_profile(V100)
    assert p.steps == 3 and (p.device_name, p.sm_count) == ("Tesla V100-SXM2-32GB", 80)
    fwd = _one(p, "aten::cudnn_convolution", "scudnn")
    assert fwd.kernel_class == "conv" and fwd.dtype == "fp32"
    assert fwd.conv == {"n": 32, "c_in": 64, "d": 1, "h": 56, "w": 56, "c_out": 128, "t": 1, "r": 3, "s": 3,
                        "stride": (2, 2), "padding": (1, 1), "dilation": (1, 1), "groups": 1, "transposed": False,
                        "backward": False}
    assert _one(p, "aten::cudnn_convolution", "volta_sgemm").kernel_class == "conv"
    transform = _one(p, "aten::cudnn_convolution", "nchwToNhwc")
    assert transform.kernel_class == "memory" and transform.conv == fwd.conv and transform.bytes_moved is None
    bwd = [s for s in p.samples if s.op == "aten::convolution_backward"]
    assert [s.kernel_class for s in bwd] == ["conv", "conv"]
    assert all(s.conv is not None and s.conv["backward"] and s.conv["stride"] == (2, 2) for s in bwd)
    assert [s.gemm for s in p.samples if s.kernel_class == "gemm"] == [(32, 1000, 2048, 1), (32, 2048, 1000, 1)]
    # the last mm's launch call is missing: its External id (not its correlation) names the op
    assert _one(p, "aten::mm").dtype == "fp16"


def test_conv_shape_1d_3d_groups_and_transposed():
    c1 = conv_shape("aten::convolution", [[8, 16, 100], [32, 16, 5], [], [], [], [], [], [], []],
                    ["", "", "", "[1]", "[2]", "[1]", "False", "[0]", "1"])
    assert c1 is not None and (c1["h"], c1["w"], c1["r"], c1["s"], c1["padding"]) == (1, 100, 1, 5, (2,))
    c3 = conv_shape("aten::cudnn_convolution", [[2, 4, 8, 16, 16], [8, 4, 3, 3, 3]])
    assert c3 is not None and (c3["d"], c3["t"], c3["stride"], c3["groups"]) == (8, 3, None, 1)
    depthwise = conv_shape("aten::cudnn_convolution", [[2, 64, 32, 32], [64, 1, 3, 3]])
    assert depthwise is not None and depthwise["groups"] == 64
    up = conv_shape("aten::convolution", [[2, 64, 16, 16], [64, 32, 4, 4], [], [], [], [], [], [], []],
                    ["", "", "", "[2, 2]", "[1, 1]", "[1, 1]", "True", "[0, 0]", "1"])
    assert up is not None and up["transposed"] and up["c_out"] == 32
    assert conv_shape("aten::mm", [[2, 3], [3, 4]]) is None


# ----------------------------------------------------------------------------- refusals


def _refused(path: Path) -> str:
    with pytest.raises(MpsimError) as info:
        read_profile(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    return message


def test_malformed_json_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "cut.json"
    bad.write_text(H100.read_text()[:5000])
    assert "not valid JSON" in _refused(bad)


def test_json_that_is_not_a_trace_is_refused_in_one_line(tmp_path):
    other = tmp_path / "calibrate.json"
    other.write_text(json.dumps({"device": "H100", "layers": [{"fwd_ms": 1.0}]}))
    message = _refused(other)
    assert "'traceEvents'" in message and "export_chrome_trace" in message and "'layers'" in message
    scalar = tmp_path / "number.json"
    scalar.write_text("42")
    assert "a JSON int" in _refused(scalar)


@pytest.mark.parametrize(("content", "words"), [
    (b"\x1f\x8b\x08\x00garbage", "not a readable gzip file"),
    (gzip.compress(b"{\"traceEvents\": [1, 2]}"), "traceEvents[0] is a int"),
    (json.dumps({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1.0}]}).encode(), "found dur=None"),
    (json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": "1", "dur": 2}]}).encode(),
     "found ts='1'"),
])
def test_broken_traces_are_refused_in_one_line(tmp_path, content, words):
    path = tmp_path / "trace.json.gz"
    path.write_bytes(content)
    assert words in _refused(path)


def test_a_missing_file_is_refused(tmp_path):
    assert "cannot read it" in _refused(tmp_path / "absent.json")


def test_a_cpu_only_trace_has_no_samples(tmp_path):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"schemaVersion": 1, "deviceProperties": [], "traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#7", "pid": 1, "tid": 1, "ts": 0.0, "dur": 10.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 1.0, "dur": 5.0,
         "args": {"External id": 2, "Input Dims": [[2, 3], [3, 4]], "Input type": ["float", "float"]}}]}))
    p = read_profile(path)
    assert p.samples == () and p.steps == 1 and p.device_name is None and p.sm_count is None


# ----------------------------------------------------------------------------- a real trace


def test_the_importer_does_not_import_torch():
    code = "import sys, mpsim.models.profile_import; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_argument_positions_match_a_real_cpu_trace(tmp_path):
    """torch.profiler on this CPU writes the same cpu_op args as on a GPU (there are no kernels to read)."""
    torch = pytest.importorskip("torch")
    from torch.nn import functional as F
    from torch.profiler import ProfilerActivity, profile, schedule

    path = tmp_path / "cpu_trace.json"
    lin, conv = torch.nn.Linear(16, 8), torch.nn.Conv2d(3, 4, 3, stride=2, padding=1)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 schedule=schedule(wait=0, warmup=1, active=2, repeat=1),
                 on_trace_ready=lambda prof: prof.export_chrome_trace(str(path))) as prof:
        for _ in range(3):
            a, b = torch.randn(4, 16), torch.randn(16, 8)
            torch.mm(a, b)
            torch.bmm(torch.randn(2, 4, 16), torch.randn(2, 16, 8))
            lin(torch.randn(2, 5, 16))
            q = torch.randn(2, 3, 6, 8)
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
            conv(torch.randn(1, 3, 10, 10, requires_grad=True)).sum().backward()
            torch.randn(100) + torch.randn(100)
            prof.step()
    events = json.loads(path.read_text())["traceEvents"]
    ops: dict[str, dict] = {}
    for e in events:
        if e.get("cat") == "cpu_op":
            ops.setdefault(e["name"], e["args"])

    def shape_args(name: str) -> tuple[list, list[str], list[str]]:
        args = ops[name]
        return args["Input Dims"], args["Input type"], args["Concrete Inputs"]

    assert gemm_shape("aten::mm", shape_args("aten::mm")[0]) == (4, 8, 16, 1)
    assert gemm_shape("aten::bmm", shape_args("aten::bmm")[0]) == (4, 8, 16, 2)
    assert gemm_shape("aten::linear", shape_args("aten::linear")[0]) == (10, 8, 16, 1)
    assert gemm_shape("aten::addmm", shape_args("aten::addmm")[0]) == (10, 8, 16, 1)  # linear's inner op
    for name in ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu"):
        dims, _, concrete = shape_args(name)
        assert attention_shape(name, dims, concrete) == {"batch": 2, "heads": 3, "kv_heads": 3, "s_q": 6, "s_k": 6,
                                                         "head_dim": 8, "causal": True, "backward": False,
                                                         "varlen": False}
    dims, _, concrete = shape_args("aten::convolution")
    fwd = conv_shape("aten::convolution", dims, concrete)
    assert fwd is not None and (fwd["stride"], fwd["padding"], fwd["groups"], fwd["c_out"]) == ((2, 2), (1, 1), 1, 4)
    dims, _, concrete = shape_args("aten::convolution_backward")
    bwd = conv_shape("aten::convolution_backward", dims, concrete)
    assert bwd is not None and bwd["backward"] and bwd["h"] == 10 and bwd["stride"] == (2, 2)
    dims, types, _ = shape_args("aten::add")
    assert op_bytes("aten::add", dims, types) == (3 * 100 * 4, "inputs_and_output")
    profile_read = read_profile(path)
    assert profile_read.samples == () and profile_read.steps == 2


def test_the_gpu_checks_profiler_script_runs_and_calibrate_says_a_cpu_trace_has_no_gpu_kernels(tmp_path):
    """validate/profile_layers.py (what validate/gpu_checks.sh runs on a GPU) writes a
    Kineto trace on a CPU too; `mpsim calibrate --profile` refuses it in one line."""
    from helpers import run_cli

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, str(root / "validate" / "profile_layers.py"), "--preset", "gpt2-xl",
                           "--layers", "1", "--seq-len", "32", "--recipe", "fp32", "--device", "cpu", "--steps", "1",
                           "-o", str(out)], capture_output=True, text=True, check=False, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert read_profile(out).samples == ()
    code, _, err = run_cli(120, "calibrate", "--profile", str(out), "--dtype", "fp32", "--server", "h100-x1")
    assert code == 2 and err.strip().splitlines() == [
        "mpsim: error: profile.json: no fp32 kernel with a shape to fit; profile with record_shapes=True and the "
        "model's precision"]
