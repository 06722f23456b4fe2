"""Per-kernel samples from a PyTorch profiler trace (Kineto's Chrome trace JSON).

``torch.profiler.profile(activities=[CPU, CUDA], record_shapes=True)`` and
``export_chrome_trace`` write a JSON object whose ``traceEvents`` hold, among others,
complete events (``ph: "X"``, ``ts`` and ``dur`` in microseconds) of these categories:

``cpu_op``
    an operator on a CPU thread (``aten::mm``, ``aten::_flash_attention_forward``,
    autograd nodes ...). With ``record_shapes`` its ``args`` carry ``Input Dims``,
    ``Input type`` and, since PyTorch 2.1 or so, ``Concrete Inputs`` (scalars and int
    lists as strings: ``"True"``, ``"[2, 2]"``). Ops nest by time on their thread.
``cuda_runtime`` / ``cuda_driver``
    the launch calls (``cudaLaunchKernel``, ``cuLaunchKernel``) with ``args.correlation``.
``kernel``, ``gpu_memcpy``, ``gpu_memset``
    what ran on the GPU, with the same ``args.correlation`` as its launch, ``device``,
    ``stream``, ``grid``/``block``; copies also give ``bytes``.
``user_annotation``
    ``record_function`` ranges, among them ``ProfilerStep#N`` (one per ``prof.step()``).

``ac2g`` flow events (``ph: "s"``/``"f"``) draw the launch-to-kernel arrows; their ``id`` is
the correlation, so the importer follows ``args.correlation`` instead.

The launching op of a GPU event is the innermost ``cpu_op`` that encloses its launch call
on the launching thread (found by the correlation). The kernel's own ``External id`` is
not used for that when the launch is in the trace: in some traces it is the launching
op's ``External id`` (HTA's 2024 ResNet traces), in others it is just the correlation
again (DeepSeek's 2025 H800 trace, HTA's 2023 A100 traces), where matching it against the
ops' ``External id`` finds unrelated ops. Only when the launch call is missing (filtered
out) is a kernel matched to the op with its ``External id``, and then only when that id
differs from the correlation.

Without ``record_shapes`` the ops have no ``Input Dims``: samples keep their class, time
and op name, with no shapes. A kernel launched outside every op (NCCL's own threads, C++
extensions, CUDA graphs) has ``op=None``.

Verified against real traces (a CPU profile made with torch 2.13 on this machine; DeepSeek's
``profile-data/train.json`` from an H800; HTA's A100 and V100 test traces): the categories,
``args.correlation`` on launches and GPU events, ``External id`` as described above,
``Input Dims``/``Input type``/``Concrete Inputs`` (positions follow the operator schema,
keyword-only arguments included; a tensor list is a nested list or, in older traces,
``[]``), ``ProfilerStep#N`` as ``user_annotation``, ``deviceProperties[].name``/``numSms``,
``Memcpy``/``Memset`` names and ``bytes``.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import re
import zlib
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, TypedDict, get_args

from mpsim.errors import MpsimError

if TYPE_CHECKING:
    from mpsim.hardware.topology import Dtype

KernelClass = Literal["gemm", "attention", "conv", "memory", "communication", "copy", "other"]
KERNEL_CLASSES: tuple[KernelClass, ...] = get_args(KernelClass)

BytesBasis = Literal["inputs_and_output", "inputs_only", "copy_size"]
"""How ``KernelSample.bytes_moved`` was counted: the op's tensor inputs and its output
(derived from the inputs' shapes), its inputs only (output unknown), or the size a
``Memcpy``/``Memset`` reports (``args.bytes``, counted once)."""

Dims = tuple[tuple[int, ...], ...]

# Kernel symbol -> class. Searched in order, case-insensitively; the first match wins, so
# the specific families come before the generic ones (flash-attention and cuDNN conv
# kernels are built on CUTLASS and say "gemm"; cuBLAS's split-K reduction says "reduce").
# Where the names come from:
#   copy           Kineto's names for CUPTI memcpy/memset activities: "Memcpy DtoD (Device -> Device)",
#                  "Memcpy HtoD (Pinned -> Device)", "Memset (Device)".
#   communication  NCCL's kernels: ncclKernel_<coll>_<algo>_<proto>_<op>_<type> (NCCL < 2.19),
#                  ncclDevKernel_<coll>_<op>_<type>_<algo>_<proto> (later); RCCL keeps the names.
#                  DeepEP's expert-parallel dispatch/combine (ep::internode::dispatch<...>).
#   attention      FlashAttention 2/3 (flash_fwd_kernel, flash_bwd_dq_dk_dv_loop_..., flash::compute_attn_ws,
#                  flash::FlashAttnBwd), PyTorch's memory-efficient kernels (fmha_cutlassF_*, fmha_cutlassB_*,
#                  PyTorchMemEffAttention::AttentionKernel), cuDNN's fused SDPA (cudnn_generated_fort_native_sdpa_*),
#                  Triton's tutorial kernels (_attn_fwd).
#   conv           cuDNN: sm80_xmma_{fprop,dgrad,wgrad}_implicit_gemm_*, *_scudnn_* (legacy), winograd*,
#                  implicit_convolve_sgemm, wgrad_alg0_engine, fft2d_r2c_* (FFT convolution),
#                  cask_cudnn*/cutlass_cudnn* helpers and kernels, cudnn::gemm::computeOffsetsKernel;
#                  ATen's conv_depthwise2d_*.
#   gemm           cuBLAS/cuBLASLt: <arch>_xmma_gemm_*, ampere_fp16_s16816gemm_*, volta_h884gemm_*,
#                  *_sgemm_*, gemv2T_kernel_val, gemmk1_kernel, splitKreduce_kernel, nvjet_* (cuBLAS 12.x
#                  on Hopper/Blackwell), epilogue kernels taking cublasLtEpilogue_t; CUTLASS
#                  (cutlass::Kernel<cutlass_80_tensorop_*gemm_*>, cutlass::device_kernel<...GemmKernel>);
#                  Triton matmul kernels. (FBGEMM's kernels, fbgemm_gpu::*, are embedding and layout kernels.)
#   memory         ATen's TensorIterator kernels (vectorized_/unrolled_elementwise_kernel, elementwise_kernel,
#                  reduce_kernel), norms (layer_norm, cudnn::bn_fw_*/bn_bw_*), softmax, dropout, the foreach/
#                  optimizer kernels (multi_tensor_apply_kernel, AdamFunctor), copies and layout transforms
#                  (direct_copy_kernel, CatArrayBatchedCopy, nchwToNhwcKernel), index/gather/scatter, pooling,
#                  CUB's scans and sorts (cub::DeviceScanKernel, DeviceRadixSort*),
#                  TorchInductor's pointwise/reduction kernels (triton_poi_*, triton_red_*, triton_per_*).
KERNEL_PATTERNS: tuple[tuple[str, KernelClass], ...] = (
    (r"^memcpy\b|^memset\b", "copy"),
    (r"nccl|rccl", "communication"),
    (r"\bep::(internode|intranode)::", "communication"),
    (r"flash|fmha|attention|sdpa|_attn_(fwd|bwd)", "attention"),
    (r"conv(?!ert)|fprop|dgrad|wgrad|winograd|implicit_?gemm|implicit_precomp|fft2d|scudnn|hcudnn", "conv"),
    (r"cask_cudnn|cutlass_cudnn|cudnn::gemm::|cudnn::cnn::", "conv"),
    (r"(?<!fb)gemm|gemv|cublas|cutlass|xmma|nvjet|splitkreduce|matmul", "gemm"),
    (r"elementwise|vectorized|unrolled|reduce|norm|softmax|dropout|multi_tensor_apply|adam|fill|copy|cast"
     r"|transpose|permute|index|gather|scatter|embedding|pool|relu|gelu|silu|sigmoid|tanh|rotary|\brope"
     r"|swiglu|gammabeta|bn_fw|bn_bw|nchwtonhwc|nhwctonchw|triton_(poi|red|per)_|topk|sort|scan|arange"
     r"|distribution|loss", "memory"),
)
_KERNEL_RES = tuple((re.compile(p, re.IGNORECASE), c) for p, c in KERNEL_PATTERNS)


class _Attn(NamedTuple):
    """Where an attention op keeps its arguments (indices into its schema's inputs)."""

    query: int
    layout: Literal["bhsd", "bshd"]  # SDPA's (batch, heads, seq, dim) or the kernels' (batch, seq, heads, dim)
    causal: int | None  # index of is_causal (bool) or, with mask_type, custom_mask_type (0 none, 1/2 causal)
    backward: bool
    mask_type: bool = False
    cum_seq_q: int | None = None  # varlen: cumulative sequence lengths, max lengths
    max_q: int | None = None
    max_k: int | None = None


# Schemas as torch._C._jit_get_schemas_for_operator gives them (torch 2.13).
ATTENTION_OPS: dict[str, _Attn] = {
    "aten::scaled_dot_product_attention": _Attn(0, "bhsd", 5, False),
    "aten::_scaled_dot_product_flash_attention": _Attn(0, "bhsd", 4, False),
    "aten::_scaled_dot_product_flash_attention_backward": _Attn(1, "bhsd", 11, True),
    "aten::_scaled_dot_product_flash_attention_for_cpu": _Attn(0, "bhsd", 4, False),
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": _Attn(1, "bhsd", 7, True),
    "aten::_scaled_dot_product_efficient_attention": _Attn(0, "bhsd", 6, False),
    "aten::_scaled_dot_product_efficient_attention_backward": _Attn(1, "bhsd", 11, True),
    "aten::_scaled_dot_product_cudnn_attention": _Attn(0, "bhsd", 6, False),
    "aten::_scaled_dot_product_cudnn_attention_backward": _Attn(1, "bhsd", 14, True),
    "aten::_cudnn_attention_forward": _Attn(0, "bhsd", 10, False),
    "aten::_cudnn_attention_backward": _Attn(1, "bhsd", 14, True),
    "aten::_scaled_dot_product_fused_attention_overrideable": _Attn(0, "bhsd", 5, False),
    "aten::_scaled_dot_product_fused_attention_overrideable_backward": _Attn(1, "bhsd", 13, True),
    "aten::_flash_attention_forward": _Attn(0, "bshd", 8, False, cum_seq_q=3, max_q=5, max_k=6),
    "aten::_flash_attention_backward": _Attn(1, "bshd", 11, True, cum_seq_q=6, max_q=8, max_k=9),
    "aten::_efficient_attention_forward": _Attn(0, "bshd", 9, False, True, cum_seq_q=4, max_q=6, max_k=7),
    "aten::_efficient_attention_backward": _Attn(1, "bshd", 14, True, True, cum_seq_q=6, max_q=8, max_k=9),
}


class _Conv(NamedTuple):
    """Where a convolution op keeps its arguments; ``transposed`` is an index or a constant."""

    input: int
    weight: int
    stride: int
    padding: int
    dilation: int
    groups: int
    transposed: int | bool
    backward: bool = False


CONV_OPS: dict[str, _Conv] = {
    "aten::convolution": _Conv(0, 1, 3, 4, 5, 8, 6),
    "aten::_convolution": _Conv(0, 1, 3, 4, 5, 8, 6),
    "aten::conv1d": _Conv(0, 1, 3, 4, 5, 6, False),
    "aten::conv2d": _Conv(0, 1, 3, 4, 5, 6, False),
    "aten::conv3d": _Conv(0, 1, 3, 4, 5, 6, False),
    "aten::cudnn_convolution": _Conv(0, 1, 3, 2, 4, 5, False),
    "aten::cudnn_convolution_transpose": _Conv(0, 1, 4, 2, 5, 6, True),
    "aten::cudnn_convolution_relu": _Conv(0, 1, 3, 4, 5, 6, False),
    "aten::cudnn_convolution_add_relu": _Conv(0, 1, 5, 6, 7, 8, False),
    "aten::miopen_convolution": _Conv(0, 1, 4, 3, 5, 6, False),
    "aten::mkldnn_convolution": _Conv(0, 1, 4, 3, 5, 6, False),
    "aten::convolution_backward": _Conv(1, 2, 4, 5, 6, 9, 7, backward=True),
}

# op -> (first operand, second operand, how to read them)
GEMM_OPS: dict[str, tuple[int, int, Literal["mm", "bmm", "linear", "matmul", "mv"]]] = {
    "aten::mm": (0, 1, "mm"),
    "aten::addmm": (1, 2, "mm"),
    "aten::_addmm_activation": (1, 2, "mm"),
    "aten::_scaled_mm": (0, 1, "mm"),
    "aten::_int_mm": (0, 1, "mm"),
    "aten::bmm": (0, 1, "bmm"),
    "aten::baddbmm": (1, 2, "bmm"),
    "aten::addbmm": (1, 2, "bmm"),
    "aten::linear": (0, 1, "linear"),
    "aten::matmul": (0, 1, "matmul"),
    "aten::mv": (0, 1, "mv"),
    "aten::addmv": (1, 2, "mv"),
}

# Launching op -> class, for kernels whose symbol matches no pattern above.
OP_PATTERNS: tuple[tuple[str, KernelClass], ...] = (
    (r"^aten::(mm|addmm|_addmm_activation|_scaled_mm|_int_mm|bmm|baddbmm|addbmm|linear|matmul|mv|addmv"
     r"|_grouped_mm|_scaled_grouped_mm)$", "gemm"),
    (r"attention", "attention"),
    (r"conv", "conv"),
    (r"^nccl:|^c10d::|record_param_comms", "communication"),
    (r"^aten::(add|sub|mul|div|copy|fill|zero|clone|contiguous|cat|stack|where|clamp|relu|gelu|silu|sigmoid"
     r"|tanh|neg|exp|sum|mean|index\w*|gather|scatter\w*|embedding\w*|\w*norm\w*|\w*softmax\w*|\w*dropout\w*"
     r"|_foreach_\w+|_fused_adam\w*|\w*pool\w*)_?$", "memory"),
)
_OP_RES = tuple((re.compile(p), c) for p, c in OP_PATTERNS)

# Input type names as the trace writes them (c10's type names; "long" in older traces).
ELEMENT_BYTES: dict[str, int] = {
    "float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2,
    "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1, "c10::Float8_e4m3fnuz": 1, "c10::Float8_e5m2fnuz": 1,
    "c10::Float8_e8m0fnu": 1, "long int": 8, "long": 8, "int": 4, "short int": 2, "short": 2,
    "signed char": 1, "unsigned char": 1, "bool": 1, "unsigned short": 2, "unsigned int": 4,
    "unsigned long": 8, "c10::complex<c10::Half>": 4, "c10::complex<float>": 8, "c10::complex<double>": 16,
}
MPSIM_DTYPES: dict[str, Dtype] = {
    "float": "fp32",  # TF32 tensor-core math cannot be told from the trace
    "c10::Half": "fp16", "c10::BFloat16": "bf16",
    "c10::Float8_e4m3fn": "fp8", "c10::Float8_e5m2": "fp8",
    "c10::Float8_e4m3fnuz": "fp8", "c10::Float8_e5m2fnuz": "fp8",
}

# Output shape rules for bytes_moved (op names without "aten::").
_WRITE_ONLY_INPLACE = frozenset({"copy_", "fill_", "zero_", "normal_", "uniform_", "random_", "bernoulli_",
                                 "exponential_", "set_"})
_SAME_AS_FIRST = frozenset({
    "clone", "contiguous", "relu", "gelu", "silu", "sigmoid", "tanh", "neg", "exp", "log", "sqrt", "rsqrt", "abs",
    "reciprocal", "sin", "cos", "softmax", "_softmax", "log_softmax", "_log_softmax", "_softmax_backward_data",
    "_log_softmax_backward_data", "native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm",
    "native_dropout", "dropout", "gelu_backward", "silu_backward", "threshold_backward", "sigmoid_backward",
    "tanh_backward", "native_dropout_backward", "hardtanh", "leaky_relu", "elu", "mish", "clamp", "clamp_min",
    "clamp_max", "nan_to_num",
})
_BROADCAST = frozenset({"add", "sub", "rsub", "mul", "div", "where", "maximum", "minimum", "pow", "lerp", "addcmul",
                        "addcdiv", "masked_fill", "remainder", "fmod", "atan2", "hypot"})
_COMPARE = frozenset({"eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor", "logical_not",
                      "isnan", "isinf", "isfinite"})


class AttentionShape(TypedDict):
    """An attention op's problem: ``s_q``/``s_k`` are the longest sequences of a varlen
    batch (or, without ``Concrete Inputs``, total tokens over the batch); ``causal`` is
    None when the trace does not say."""

    batch: int
    heads: int
    kv_heads: int
    s_q: int
    s_k: int
    head_dim: int
    causal: bool | None
    backward: bool
    varlen: bool


class ConvShape(TypedDict):
    """A convolution: input (n, c_in, d, h, w), filter (c_out, c_in/groups, t, r, s); 1-D and
    2-D convolutions have d = t = 1 (and 1-D h = r = 1). stride, padding, dilation and
    groups come from ``Concrete Inputs`` (None without them; groups then follows from the
    channels of a forward convolution); ``transposed`` is False unless the op says so."""

    n: int
    c_in: int
    d: int
    h: int
    w: int
    c_out: int
    t: int
    r: int
    s: int
    stride: tuple[int, ...] | None
    padding: tuple[int, ...] | None
    dilation: tuple[int, ...] | None
    groups: int | None
    transposed: bool
    backward: bool


@dataclass(frozen=True)
class KernelSample:
    """One GPU kernel (or memcpy/memset) as profiled, with what its launching op tells.

    - ``kernel``: the symbol exactly as the trace names it (not shortened).
    - ``op``: the innermost ``cpu_op`` around the launch (``aten::addmm``, not the
      ``aten::linear`` around it); None for a kernel launched outside every op.
    - ``input_dims``/``input_dtypes``: that op's ``Input Dims``/``Input type``, one entry per
      schema input; None without ``record_shapes`` or without an op.
    - ``dtype``: mpsim's name for the first floating input's type ("float" reads as fp32:
      TF32 math cannot be told from a trace); None for other types or without shapes.
    - ``gemm``: (m, n, k, batch) of a matmul op; ``attention`` and ``conv``: the problem of an
      attention or convolution op. All three describe the op, whichever of its kernels this is.
    - ``bytes_moved``: for memory-class kernels of ATen ops, the op's tensor traffic
      (``bytes_basis`` says whether its output is counted); for copies, the size copied.
    - ``op_id``: the launching op's ``External id``. The kernels of one op call share it (a
      convolution's layout transforms and its conv kernel, an attention backward's kernels);
      ``bytes_moved`` is the op's traffic, not split among them.
    - ``start_us``: the kernel's start on the trace's clock."""

    kernel: str
    kernel_class: KernelClass
    duration_s: float
    op: str | None
    input_dims: Dims | None  # () for scalars, absent tensors and tensor lists
    input_dtypes: tuple[str, ...] | None
    dtype: Dtype | None
    gemm: tuple[int, int, int, int] | None
    attention: AttentionShape | None = dataclasses.field(default=None, hash=False)
    conv: ConvShape | None = dataclasses.field(default=None, hash=False)
    bytes_moved: int | None = None
    bytes_basis: BytesBasis | None = None
    op_id: int | None = None
    start_us: float = 0.0


@dataclass(frozen=True)
class Profile:
    """The GPU events of one trace, in start order."""

    samples: tuple[KernelSample, ...]
    device_name: str | None
    sm_count: int | None
    steps: int

    def by_class(self) -> dict[KernelClass, list[KernelSample]]:
        """The samples of each class (every class is a key, in ``KERNEL_CLASSES`` order)."""
        out: dict[KernelClass, list[KernelSample]] = {c: [] for c in KERNEL_CLASSES}
        for s in self.samples:
            out[s.kernel_class].append(s)
        return out


# ----------------------------------------------------------------------------- classify


def classify_kernel(name: str, op: str | None) -> KernelClass:
    """The class of a kernel symbol (``KERNEL_PATTERNS``); a symbol no pattern knows takes
    its launching op's class (``OP_PATTERNS``), else "other". A GEMM kernel launched by a
    convolution op is "conv": cuDNN runs some convolutions (1x1, FFT) as plain GEMMs."""
    for regex, cls in _KERNEL_RES:
        if regex.search(name):
            if cls == "gemm" and op is not None and _op_class(op) == "conv":
                return "conv"
            return cls
    return _op_class(op) if op is not None else "other"


def _op_class(op: str) -> KernelClass:
    for regex, cls in _OP_RES:
        if regex.search(op):
            return cls
    return "other"


# ----------------------------------------------------------------------------- shapes


def gemm_shape(op: str, dims: Sequence[Sequence[int]]) -> tuple[int, int, int, int] | None:
    """(m, n, k, batch) of a matmul op from its ``Input Dims``, None if the op is not one
    or its operands do not fit. ``linear``'s weight is (n, k); ``matmul`` with a 2-D second
    operand folds the first one's leading dimensions into m, as PyTorch runs it."""
    spec = GEMM_OPS.get(op)
    if spec is None or len(dims) <= max(spec[0], spec[1]):
        return None
    a, b, kind = tuple(dims[spec[0]]), tuple(dims[spec[1]]), spec[2]
    if kind == "mm" and len(a) == 2 and len(b) == 2 and a[1] == b[0]:
        return a[0], b[1], a[1], 1
    if kind == "bmm" and len(a) == 3 and len(b) == 3 and a[0] == b[0] and a[2] == b[1]:
        return a[1], b[2], a[2], a[0]
    if kind == "linear" and a and len(b) == 2 and a[-1] == b[1]:
        return math.prod(a[:-1]), b[0], a[-1], 1
    if kind == "mv" and len(a) == 2 and len(b) == 1 and a[1] == b[0]:
        return a[0], 1, a[1], 1
    if kind == "matmul":
        return _matmul_shape(a, b)
    return None


def _matmul_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, int, int, int] | None:
    if not a or not b or a[-1] != (b[0] if len(b) == 1 else b[-2]):
        return None
    k = a[-1]
    if len(b) == 1:
        return math.prod(a[:-1]), 1, k, 1
    if len(a) == 1:
        return 1, b[-1], k, math.prod(b[:-2])
    if len(b) == 2:
        return math.prod(a[:-1]), b[1], k, 1
    batch = _broadcast(a[:-2], b[:-2])
    return None if batch is None else (a[-2], b[-1], k, math.prod(batch))


def _broadcast(*shapes: Sequence[int]) -> tuple[int, ...] | None:
    out: list[int] = []
    for i in range(1, max((len(s) for s in shapes), default=0) + 1):
        sizes = {s[-i] for s in shapes if len(s) >= i} - {1}
        if len(sizes) > 1:
            return None
        out.append(sizes.pop() if sizes else 1)
    return tuple(reversed(out))


def attention_shape(op: str, dims: Sequence[Sequence[int]],
                    concrete: Sequence[str] | None = None) -> AttentionShape | None:
    """The problem of an SDPA / flash / memory-efficient / cuDNN attention op (forward or
    backward) from its ``Input Dims`` and, for ``causal`` and varlen lengths, its
    ``Concrete Inputs``; None if the op is not one or the dims do not fit."""
    spec = ATTENTION_OPS.get(op)
    if spec is None or len(dims) <= spec.query + 1:
        return None
    q, k = tuple(dims[spec.query]), tuple(dims[spec.query + 1])
    if len(q) < 3 or len(k) != len(q):
        return None
    causal = _concrete(concrete, spec.causal)
    is_causal = (None if causal is None else causal not in ("0", "False")) if spec.mask_type else _as_bool(causal)
    if spec.layout == "bhsd":
        return AttentionShape(batch=math.prod(q[:-3]), heads=q[-3], kv_heads=k[-3], s_q=q[-2], s_k=k[-2],
                              head_dim=q[-1], causal=is_causal, backward=spec.backward, varlen=False)
    batch, s_q, s_k, varlen = math.prod(q[:-3]), q[-3], k[-3], False
    cum = tuple(dims[spec.cum_seq_q]) if spec.cum_seq_q is not None and len(dims) > spec.cum_seq_q else ()
    if len(cum) == 1 and cum[0] > 1:  # varlen: tokens of all sequences packed along one axis
        total_q, total_k, batch, varlen = batch * s_q, math.prod(k[:-3]) * s_k, cum[0] - 1, True
        s_q = _as_int(_concrete(concrete, spec.max_q)) or total_q // batch
        s_k = _as_int(_concrete(concrete, spec.max_k)) or total_k // batch
    return AttentionShape(batch=batch, heads=q[-2], kv_heads=k[-2], s_q=s_q, s_k=s_k, head_dim=q[-1],
                          causal=is_causal, backward=spec.backward, varlen=varlen)


def conv_shape(op: str, dims: Sequence[Sequence[int]], concrete: Sequence[str] | None = None) -> ConvShape | None:
    """A convolution op's problem from its ``Input Dims`` (input, weight) and, for stride,
    padding, dilation, groups and transposition, its ``Concrete Inputs``."""
    spec = CONV_OPS.get(op)
    if spec is None or len(dims) <= max(spec.input, spec.weight):
        return None
    x, w = tuple(dims[spec.input]), tuple(dims[spec.weight])
    if len(x) != len(w) or len(x) not in (3, 4, 5):
        return None
    spatial_x = (1,) * (5 - len(x)) + x[2:]
    spatial_w = (1,) * (5 - len(w)) + w[2:]
    transposed = spec.transposed if isinstance(spec.transposed, bool) else \
        bool(_as_bool(_concrete(concrete, spec.transposed)))
    groups = _as_int(_concrete(concrete, spec.groups))
    if groups is None and not transposed and w[1] > 0 and x[1] % w[1] == 0:
        groups = x[1] // w[1]
    c_out = w[1] * (groups or 1) if transposed else w[0]
    return ConvShape(n=x[0], c_in=x[1], d=spatial_x[0], h=spatial_x[1], w=spatial_x[2], c_out=c_out,
                     t=spatial_w[0], r=spatial_w[1], s=spatial_w[2],
                     stride=_as_ints(_concrete(concrete, spec.stride)),
                     padding=_as_ints(_concrete(concrete, spec.padding)),
                     dilation=_as_ints(_concrete(concrete, spec.dilation)),
                     groups=groups, transposed=transposed, backward=spec.backward)


def op_bytes(op: str, dims: Sequence[Sequence[int]], types: Sequence[str]) -> tuple[int, BytesBasis] | None:
    """Bytes an elementwise/memory op moves: its tensor inputs plus, where the op's output
    follows from them, its output (in-place ops write their first input; ``copy_`` and
    ``fill_`` do not read it). None when an input's size is unknown (a tensor list)."""
    if "TensorList" in types:
        return None
    tensors = [(tuple(d), ELEMENT_BYTES[t]) for d, t in zip(dims, types) if t in ELEMENT_BYTES]
    if not tensors:
        return None
    sizes = [math.prod(d) * e for d, e in tensors]
    base = op.removeprefix("aten::")
    if base.endswith("_") and not base.endswith("__"):
        if base in _WRITE_ONLY_INPLACE:
            return sum(sizes), "inputs_and_output"
        return sum(sizes) + sizes[0], "inputs_and_output"
    if base in _SAME_AS_FIRST:
        return sum(sizes) + sizes[0], "inputs_and_output"
    if base in _BROADCAST or base in _COMPARE:
        shape = _broadcast(*(d for d, _ in tensors))
        if shape is not None:
            largest = max(range(len(tensors)), key=lambda i: math.prod(tensors[i][0]))
            element = 1 if base in _COMPARE else tensors[largest][1]
            return sum(sizes) + math.prod(shape) * element, "inputs_and_output"
    return sum(sizes), "inputs_only"


def _concrete(concrete: Sequence[str] | None, i: int | None) -> str | None:
    if concrete is None or i is None or i >= len(concrete):
        return None
    value = concrete[i]
    return value.strip() if isinstance(value, str) and value.strip() else None


def _as_bool(value: str | None) -> bool | None:
    return {"True": True, "False": False, "1": True, "0": False}.get(value or "")


def _as_int(value: str | None) -> int | None:
    return int(value) if value is not None and re.fullmatch(r"-?\d+", value) else None


def _as_ints(value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    if _as_int(value) is not None:
        return (int(value),)
    m = re.fullmatch(r"\[\s*(-?\d+(?:\s*,\s*-?\d+)*)?\s*\]", value)
    return None if m is None else tuple(int(v) for v in (m.group(1) or "").split(",") if v.strip())


# ----------------------------------------------------------------------------- reading

_OP_CATS = frozenset({"cpu_op", "operator"})
_GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset"})
_STEP = re.compile(r"^ProfilerStep#\d+$")
_EXPECTED = "expected a PyTorch profiler trace (the .json or .json.gz that torch.profiler's export_chrome_trace writes)"


@dataclass(frozen=True)
class _Op:
    name: str
    ts: float
    end: float
    order: int
    args: Mapping[str, Any]


def read_profile(path: Path) -> Profile:
    """Read a Kineto trace (``.json`` or gzipped ``.json.gz``) into per-kernel samples.

    Refuses, with an ``MpsimError`` of one line naming the file, what is not such a trace:
    an unreadable or malformed file, JSON without ``traceEvents``, GPU or op events without
    numeric ``ts``/``dur``. A CPU-only trace gives a profile with no samples."""
    path = Path(path)
    data = _load_json(path)
    events = _trace_events(path, data)
    ops: dict[tuple[Any, Any], list[_Op]] = defaultdict(list)
    by_ext: dict[Any, _Op] = {}
    launches: dict[Any, tuple[Any, Any, float]] = {}
    gpu: list[tuple[int, Mapping[str, Any]]] = []
    steps: set[str] = set()
    for i, e in enumerate(events):
        if e.get("ph") != "X":
            continue
        cat, name = str(e.get("cat", "")).lower(), e.get("name")
        if isinstance(name, str) and _STEP.match(name):
            steps.add(name)
        elif cat in _OP_CATS:
            op = _op_event(path, i, e)
            ops[(e.get("pid"), e.get("tid"))].append(op)
            ext = op.args.get("External id")
            if ext is not None and (ext not in by_ext or op.end - op.ts < by_ext[ext].end - by_ext[ext].ts):
                by_ext[ext] = op
        elif cat.endswith("runtime") or cat.endswith("driver"):
            corr = _args(e).get("correlation")
            if corr is not None:
                launches[corr] = (e.get("pid"), e.get("tid"), _times(path, i, e)[0])
        elif cat in _GPU_CATS:
            _times(path, i, e)
            gpu.append((i, e))
    launched_by = _launching_ops(gpu, launches, ops, by_ext)
    samples = [_sample(e, is_copy=str(e.get("cat", "")).lower() != "kernel", op=launched_by.get(i)) for i, e in gpu]
    samples.sort(key=lambda s: s.start_us)
    name, sms = _device(data, gpu)
    return Profile(samples=tuple(samples), device_name=name, sm_count=sms, steps=len(steps) or 1)


def _load_json(path: Path) -> Any:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise MpsimError(f"{path}: cannot read it ({exc.strerror or exc}); {_EXPECTED}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise MpsimError(f"{path}: not a readable gzip file ({exc}); {_EXPECTED}") from None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise MpsimError(f"{path}: not valid JSON ({reason}); {_EXPECTED}") from None


def _trace_events(path: Path, data: Any) -> list[Mapping[str, Any]]:
    events = data.get("traceEvents") if isinstance(data, dict) else data if isinstance(data, list) else None
    if not isinstance(events, list):
        found = (f"an object with keys {', '.join(map(repr, list(data)[:5]))}" if isinstance(data, dict) and data
                 else f"a JSON {type(data).__name__}")
        raise MpsimError(f"{path}: no 'traceEvents' list ({found}); {_EXPECTED}")
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise MpsimError(f"{path}: traceEvents[{i}] is a {type(e).__name__}, not an event object; {_EXPECTED}")
    return events


def _args(e: Mapping[str, Any]) -> Mapping[str, Any]:
    args = e.get("args")
    return args if isinstance(args, dict) else {}


def _times(path: Path, i: int, e: Mapping[str, Any]) -> tuple[float, float]:
    """An X event's start and duration (µs), refused in one line unless both are finite numbers, dur >= 0."""
    return _number(path, i, e, "ts"), _number(path, i, e, "dur")


def _number(path: Path, i: int, e: Mapping[str, Any], key: str) -> float:
    value = e.get(key)
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and \
            (key == "ts" or value >= 0):
        return float(value)
    raise MpsimError(f"{path}: traceEvents[{i}] ({e.get('name')!r}, cat {e.get('cat')!r}): expected a "
                     f"non-negative number 'ts' and 'dur' in microseconds, found {key}={value!r}")


def _op_event(path: Path, i: int, e: Mapping[str, Any]) -> _Op:
    ts, dur = _times(path, i, e)
    return _Op(name=str(e.get("name")), ts=ts, end=ts + dur, order=i, args=_args(e))


def _launching_ops(gpu: list[tuple[int, Mapping[str, Any]]], launches: Mapping[Any, tuple[Any, Any, float]],
                   ops: Mapping[tuple[Any, Any], list[_Op]], by_ext: Mapping[Any, _Op]) -> dict[int, _Op]:
    """For each GPU event (by index), the innermost op enclosing its launch call."""
    found: dict[int, _Op] = {}
    queries: dict[tuple[Any, Any], list[tuple[float, int]]] = defaultdict(list)
    for i, e in gpu:
        args = _args(e)
        corr, ext = args.get("correlation"), args.get("External id")
        launch = launches.get(corr) if corr is not None else None
        if launch is not None:
            queries[(launch[0], launch[1])].append((launch[2], i))
        elif ext is not None and ext != corr and ext in by_ext:
            found[i] = by_ext[ext]
    for thread, points in queries.items():
        found.update(_innermost(sorted(ops.get(thread, []), key=lambda o: (o.ts, -(o.end - o.ts), o.order)),
                                sorted(points)))
    return found


def _innermost(ops: list[_Op], points: list[tuple[float, int]]) -> dict[int, _Op]:
    """Sweep one thread's ops (by start, outer first) and launch times together: the op on
    top of the stack of those still open is the innermost one around the point."""
    out: dict[int, _Op] = {}
    stack: list[_Op] = []
    j = 0
    for t, key in points:
        while j < len(ops) and ops[j].ts <= t:
            while stack and stack[-1].end < ops[j].ts:
                stack.pop()
            stack.append(ops[j])
            j += 1
        while stack and stack[-1].end < t:
            stack.pop()
        if stack:
            out[key] = stack[-1]
    return out


def _sample(e: Mapping[str, Any], is_copy: bool, op: _Op | None) -> KernelSample:
    args = _args(e)
    name = str(e.get("name", ""))
    kclass: KernelClass = "copy" if is_copy else classify_kernel(name, op.name if op else None)
    dims, types, concrete = _inputs(op.args) if op is not None else (None, None, None)
    op_name = op.name if op is not None else None
    bytes_moved: int | None = None
    basis: BytesBasis | None = None
    if is_copy and isinstance(args.get("bytes"), int):
        bytes_moved, basis = args["bytes"], "copy_size"
    elif kclass == "memory" and op_name and op_name.startswith("aten::") and dims is not None and \
            types is not None and op_name not in GEMM_OPS and op_name not in ATTENTION_OPS and op_name not in CONV_OPS:
        counted = op_bytes(op_name, dims, types)
        if counted is not None:
            bytes_moved, basis = counted
    ext = op.args.get("External id") if op is not None else None
    return KernelSample(
        kernel=name, kernel_class=kclass, duration_s=float(e["dur"]) * 1e-6, op=op_name,
        input_dims=dims, input_dtypes=types,
        dtype=next((MPSIM_DTYPES[t] for t in types or () if t in MPSIM_DTYPES), None),
        gemm=gemm_shape(op_name, dims) if op_name and dims is not None else None,
        attention=attention_shape(op_name, dims, concrete) if op_name and dims is not None else None,
        conv=conv_shape(op_name, dims, concrete) if op_name and dims is not None else None,
        bytes_moved=bytes_moved, bytes_basis=basis, op_id=ext if isinstance(ext, int) else None,
        start_us=float(e["ts"]))


def _inputs(args: Mapping[str, Any]) -> tuple[Dims | None, tuple[str, ...] | None, tuple[str, ...] | None]:
    raw_dims, raw_types, raw_concrete = args.get("Input Dims"), args.get("Input type"), args.get("Concrete Inputs")
    dims = tuple(_dims(d) for d in raw_dims) if isinstance(raw_dims, list) else None
    types = tuple(str(t) for t in raw_types) if isinstance(raw_types, list) else None
    concrete = tuple(str(c) for c in raw_concrete) if isinstance(raw_concrete, list) else None
    return dims, types, concrete


def _dims(d: Any) -> tuple[int, ...]:
    if isinstance(d, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in d):
        return tuple(d)
    return ()  # a tensor list (nested lists) or something else: no single shape


def _device(data: Any, gpu: list[tuple[int, Mapping[str, Any]]]) -> tuple[str | None, int | None]:
    """The GPU most GPU events ran on, as the trace's ``deviceProperties`` describe it."""
    raw = data.get("deviceProperties") if isinstance(data, dict) else None
    props = [p for p in raw if isinstance(p, dict)] if isinstance(raw, list) else []
    if not props:
        return None, None
    used = Counter(_args(e).get("device", e.get("pid")) for _, e in gpu).most_common(1)
    chosen = next((p for p in props if used and p.get("id") == used[0][0]), props[0])
    name, sms = chosen.get("name"), chosen.get("numSms")
    return (name if isinstance(name, str) else None,
            sms if isinstance(sms, int) and not isinstance(sms, bool) else None)
