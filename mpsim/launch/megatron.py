"""A launch job as a Megatron-LM / Megatron-Core launch script: ``torchrun`` over the
servers, then ``pretrain_gpt.py`` with the arguments that set the layout, the batch, the
precision, recomputation and what overlaps (the names of Megatron-Core's
``megatron/training/arguments.py``).

- Degrees: ``--tensor-model-parallel-size``, ``--sequence-parallel``,
  ``--pipeline-model-parallel-size``, ``--num-layers-per-virtual-pipeline-stage``,
  ``--context-parallel-size`` with ``--cp-comm-type`` (p2p: the ring; all_gather; a2a:
  Ulysses), ``--expert-model-parallel-size``. Megatron's data-parallel size is what the
  world leaves (world / (tensor x pipeline x context)), and holds the expert GPUs: mpsim's
  data axis is it divided by the expert degree.
- ZeRO-1 is ``--use-distributed-optimizer`` (and with offload ``--optimizer-cpu-offload``);
  FSDP is ``--use-torch-fsdp2``; ZeRO-2, HSDP and parameter offload have no Megatron-LM
  flag and are refused.
- Batch: ``--micro-batch-size`` and ``--global-batch-size`` (microbatch x microbatches x
  data-parallel size); ``--seq-length``.
- Precision: ``--bf16``/``--fp16``; mpsim's 2-byte gradients are ``--grad-reduce-in-bf16``
  (Megatron keeps fp32 main gradients by default: mpsim's ``-fp32grad`` recipes); FP8 as
  ``--fp8-format hybrid --fp8-recipe delayed|tensorwise|mxfp8|blockwise``.
- Recomputation: ``--recompute-granularity selective``, or ``full`` with ``--recompute-method
  uniform --recompute-num-layers 1`` (every layer) or ``block`` and N (the first N of each
  stage).
- Runtime: ``--overlap-grad-reduce`` (megatron-lm), none (megatron-lm-sync-grads),
  ``--tp-comm-overlap`` (megatron-core-tp-overlap), ``--overlap-moe-expert-parallel-comm``
  (megatron-core-ep-overlap); ``--ddp-bucket-size`` in parameters.
- The model's shape (layers, hidden, heads, query groups, MLP, positions) is written from
  its trace and, read back, must be the model's.

``parse`` reads such a script (or the arguments alone), ignores what changes neither memory
nor time (learning rates, data, logging, checkpoints), and refuses any other argument in one
line naming it."""

from __future__ import annotations

import shlex

from pydantic import ValidationError

from mpsim.errors import MpsimError
from mpsim.launch.formats import Where, header
from mpsim.launch.job import LaunchJob, Recompute
from mpsim.models.context_parallel import ContextAttention

NAME = "megatron"
SUFFIX = ".sh"
_CP_COMM: dict[ContextAttention, str] = {"ring": "p2p", "all-gather": "all_gather", "all-to-all": "a2a"}
_FP8 = {"fp8-delayed": "delayed", "fp8-current": "tensorwise", "mxfp8": "mxfp8", "fp8-blockwise": "blockwise"}
_RUNTIME = {"megatron-lm": ["--overlap-grad-reduce"], "megatron-lm-sync-grads": [],
            "megatron-core-tp-overlap": ["--overlap-grad-reduce", "--tp-comm-overlap"],
            "megatron-core-ep-overlap": ["--overlap-grad-reduce", "--overlap-moe-expert-parallel-comm"]}
_IGNORED_PREFIXES = ("--lr", "--min-lr", "--weight-decay", "--clip-grad", "--adam-", "--init-method-std", "--train-",
                     "--data-", "--split", "--tokenizer-", "--vocab-file", "--merge-file", "--save", "--load",
                     "--log-", "--eval-", "--tensorboard-", "--wandb-", "--seed", "--exit-", "--no-load-",
                     "--ckpt-", "--use-checkpoint-", "--distributed-timeout", "--mock-data", "--dist-ckpt")
"""Arguments that change neither memory nor time: read past."""


def emit(launch: LaunchJob) -> str:
    """The launch script (module doc); refused in one line where Megatron-LM has no flag."""
    model = _model_of(launch.model)
    args = [*_layout_args(launch, model), *_batch_args(launch), *_precision_args(launch),
            *_recompute_args(launch), *_runtime_args(launch, model), *_shape_args(model, launch.seq_len)]
    nodes = f"--nnodes {launch.servers} " if launch.servers > 1 else ""
    per_node = launch.gpus // launch.servers
    lines = [f"torchrun {nodes}--nproc-per-node {per_node} pretrain_gpt.py"] + [f"  {a}" for a in args]
    return "#!/bin/bash\n" + header(launch, "#") + " \\\n".join(lines) + "\n"


def _model_of(name: str) -> dict:
    from mpsim.data.catalog import load_trace

    return dict(load_trace(name).spec.model)


def _layout_args(launch: LaunchJob, model: dict) -> list[str]:
    if launch.zero_stage == 2 or launch.hsdp:
        raise MpsimError(f"megatron: {'HSDP' if launch.hsdp else 'ZeRO-2'} has no Megatron-LM flag; emit it for "
                         "deepspeed or accelerate, or use ZeRO-1 (--use-distributed-optimizer) or FSDP")
    if launch.offload == "params":
        raise MpsimError("megatron: parameter offload (ZeRO-Infinity) has no Megatron-LM flag; emit it for deepspeed")
    if launch.offload == "optimizer" and launch.zero_stage != 1:
        raise MpsimError("megatron: optimizer offload goes with the distributed optimizer (ZeRO-1) in Megatron-LM")
    if launch.zero_stage == 3 and not launch.reshard_after_forward:
        raise MpsimError("megatron: FSDP without resharding after the forward has no Megatron-LM flag")
    args = [f"--tensor-model-parallel-size {launch.tensor}", f"--pipeline-model-parallel-size {launch.pipeline}"]
    if launch.sequence_parallel:
        args.append("--sequence-parallel")
    if launch.virtual_stages > 1:
        per_chunk, odd = divmod(model["layers"], launch.pipeline * launch.virtual_stages)
        if odd:
            raise MpsimError(f"megatron: {model['layers']} layers do not split into {launch.pipeline} x "
                             f"{launch.virtual_stages} model chunks")
        args.append(f"--num-layers-per-virtual-pipeline-stage {per_chunk}")
    if launch.context > 1:
        args += [f"--context-parallel-size {launch.context}", f"--cp-comm-type {_CP_COMM[launch.context_attention]}"]
    if launch.expert > 1:
        args.append(f"--expert-model-parallel-size {launch.expert}")
    args += {0: [], 1: ["--use-distributed-optimizer"], 3: ["--use-torch-fsdp2"]}[launch.zero_stage]
    if launch.offload == "optimizer":
        args += ["--optimizer-cpu-offload", "--optimizer-offload-fraction 1.0"]
    return args


def _batch_args(launch: LaunchJob) -> list[str]:
    return [f"--micro-batch-size {launch.microbatch}", f"--global-batch-size {launch.global_batch}",
            f"--seq-length {launch.seq_len}"]


def _precision_args(launch: LaunchJob) -> list[str]:
    recipe = launch.recipe
    if recipe in _FP8:
        return ["--bf16", "--fp8-format hybrid", f"--fp8-recipe {_FP8[recipe]}"]
    if recipe in ("nvfp4", "tf32"):
        raise MpsimError(f"megatron: recipe {recipe} is not written for Megatron-LM here; give mixed-bf16 or an FP8 "
                         "recipe")
    flags = {"mixed-fp16": ["--fp16", "--grad-reduce-in-bf16"], "mixed-bf16": ["--bf16", "--grad-reduce-in-bf16"],
             "mixed-fp16-fp32grad": ["--fp16"], "mixed-bf16-fp32grad": ["--bf16"], "fp32": []}
    return flags[recipe]


def _recompute_args(launch: LaunchJob) -> list[str]:
    if launch.recompute == "none":
        return []
    if launch.recompute == "selective":
        return ["--recompute-granularity selective"]
    if launch.recompute_layers is None:
        return ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    return ["--recompute-granularity full", "--recompute-method block",
            f"--recompute-num-layers {launch.recompute_layers}"]


def _runtime_args(launch: LaunchJob, model: dict) -> list[str]:
    if launch.runtime not in _RUNTIME:
        raise MpsimError(f"megatron: runtime profile {launch.runtime} is another framework's; Megatron-LM runs "
                         f"{', '.join(_RUNTIME)}")
    grad_bytes = 2 if launch.recipe in ("mixed-fp16", "mixed-bf16") else 4
    elements = launch.bucket_mib * 2**20 / grad_bytes
    if elements != int(elements):
        raise MpsimError(f"megatron: a {launch.bucket_mib:g} MiB bucket is no whole number of {grad_bytes}-byte "
                         "gradients")
    return [*_RUNTIME[launch.runtime], f"--ddp-bucket-size {int(elements)}"]


def _shape_args(model: dict, seq_len: int) -> list[str]:
    """The model's shape as Megatron-LM's arguments (a GPT or Llama-style trace)."""
    family = model.get("family")
    if family not in ("gpt", "llama") or model.get("moe"):
        raise MpsimError(f"megatron: writes GPT and Llama-style models; this one is {family} "
                         f"{'(a mixture of experts)' if model.get('moe') else ''}".rstrip())
    heads, kv = model["heads"], model.get("kv_heads") or model["heads"]
    args = [f"--num-layers {model['layers']}", f"--hidden-size {model['hidden']}", f"--num-attention-heads {heads}",
            f"--ffn-hidden-size {model.get('ffn_hidden') or 4 * model['hidden']}",
            f"--max-position-embeddings {max(seq_len, model.get('max_position_embeddings') or seq_len)}",
            "--use-flash-attn" if model.get("attention") == "flash" else "--no-masked-softmax-fusion"]
    if kv != heads:
        args += ["--group-query-attention", f"--num-query-groups {kv}"]
    if family == "llama":
        args += ["--swiglu", "--normalization RMSNorm", "--position-embedding-type rope",
                 "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
    return args


def parse(text: str, source: str, where: Where) -> LaunchJob:
    """The launch job of a Megatron-LM script or argument list (module doc)."""
    args = _arguments(text, source)
    if not args:
        raise MpsimError(f"{source}: no Megatron-LM argument in it; expected a launch script (torchrun ... "
                         "pretrain_gpt.py --tensor-model-parallel-size ...) or its arguments")
    model = _model_of(where.model)
    _check_shape(args, model, source)
    tensor = _int(args, "--tensor-model-parallel-size", 1, source)
    pipeline = _int(args, "--pipeline-model-parallel-size", 1, source)
    context = _int(args, "--context-parallel-size", 1, source)
    expert = _int(args, "--expert-model-parallel-size", 1, source)
    world = _world(args, where, source)
    dp, odd = divmod(world, tensor * pipeline * context)
    if odd or dp % expert:
        raise MpsimError(f"{source}: {world} GPUs do not split into tensor {tensor} x pipeline {pipeline} x context "
                         f"{context} with expert {expert} inside the data-parallel size")
    microbatch = _int(args, "--micro-batch-size", 1, source)
    microbatches, left = divmod(_int(args, "--global-batch-size", microbatch * dp, source), microbatch * dp)
    if left or microbatches < 1:
        raise MpsimError(f"{source}: --global-batch-size is no whole number of micro-batches x data-parallel "
                         f"size ({microbatch} x {dp})")
    layers_per_chunk = _int(args, "--num-layers-per-virtual-pipeline-stage", 0, source)
    if layers_per_chunk and model["layers"] % (pipeline * layers_per_chunk):
        raise MpsimError(f"{source}: --num-layers-per-virtual-pipeline-stage {layers_per_chunk}: {model['layers']} "
                         f"layers do not split into {pipeline} stages of model chunks that size")
    recompute, recompute_layers = _recompute_of(args, source)
    fields = {
        "model": where.model, "server": where.server, "cluster": where.cluster, "servers": where.servers,
        "seq_len": _seq_len(args, where, model, source), "recipe": _recipe_of(args, source),
        "microbatch": microbatch, "microbatches": microbatches, "data": dp // expert,
        "zero_stage": 3 if "--use-torch-fsdp2" in args else 1 if "--use-distributed-optimizer" in args else 0,
        "tensor": tensor, "sequence_parallel": "--sequence-parallel" in args, "pipeline": pipeline,
        "virtual_stages": model["layers"] // (pipeline * layers_per_chunk) if layers_per_chunk else 1,
        "context": context, "context_attention": _context_attention(args, source), "expert": expert,
        "recompute": recompute, "recompute_layers": recompute_layers,
        "offload": "optimizer" if "--optimizer-cpu-offload" in args else "none",
        "bucket_mib": _bucket_mib(args, source), "runtime": _runtime_of(args)}
    try:
        return LaunchJob.model_validate(fields)
    except ValidationError as exc:  # a value past a bound (a degree, the microbatch)
        first = exc.errors()[0]
        raise MpsimError(f"{source}: {'.'.join(str(x) for x in first['loc']) or 'job'}: {first['msg']}") from None


def _arguments(text: str, source: str) -> dict[str, str | None]:
    """The script's ``pretrain_*.py`` arguments (or every argument when there is no
    script), flag to value (None for a switch), comments and line continuations dropped;
    torchrun's own ``--nnodes`` and ``--nproc-per-node`` kept; a flag given twice keeps
    its last value, as argparse does. Refused in one line: unbalanced quotes, a flag
    without its value or a switch with one."""
    try:
        words = shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as exc:  # No closing quotation, No escaped character
        raise MpsimError(f"{source}: not a shell script mpsim can read ({exc})") from None
    args: dict[str, str | None] = {}
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("--"):
            continue  # torchrun, the script's name, a shebang's words
        flag, eq, inline = word.partition("=")
        flag = _ALIASES.get(flag, flag)
        value: str | None = inline if eq else None
        if value is None and flag not in _SWITCHES and i < len(words) and not words[i].startswith("--"):
            value, i = words[i], i + 1
        if flag.startswith(_IGNORED_PREFIXES):
            continue
        if flag not in _KNOWN:
            raise MpsimError(f"{source}: {flag} is not modelled by mpsim (it reads the layout, batch, precision, "
                             "recomputation and overlap arguments); remove it or ask for it")
        if (flag in _SWITCHES) != (value is None):
            raise MpsimError(f"{source}: {flag}" + (f"={value}: it is a switch and takes no value" if value is not None
                                                    else ": expected a value after it"))
        args[flag] = value
    return args


_KNOWN = {"--nnodes", "--nproc-per-node", "--nproc_per_node", "--node-rank", "--node_rank", "--master-addr",
          "--master_addr", "--master-port", "--master_port", "--rdzv-backend", "--rdzv-endpoint",
          "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--sequence-parallel",
          "--num-layers-per-virtual-pipeline-stage", "--context-parallel-size", "--cp-comm-type",
          "--expert-model-parallel-size", "--use-distributed-optimizer", "--use-torch-fsdp2",
          "--optimizer-cpu-offload", "--optimizer-offload-fraction", "--micro-batch-size", "--global-batch-size",
          "--seq-length", "--bf16", "--fp16", "--grad-reduce-in-bf16", "--fp8-format", "--fp8-recipe",
          "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--overlap-grad-reduce",
          "--overlap-param-gather", "--tp-comm-overlap", "--overlap-moe-expert-parallel-comm", "--ddp-bucket-size",
          "--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--max-position-embeddings",
          "--use-flash-attn", "--no-masked-softmax-fusion", "--group-query-attention", "--num-query-groups",
          "--swiglu", "--normalization", "--position-embedding-type", "--untie-embeddings-and-output-weights",
          "--disable-bias-linear", "--attention-backend", "--transformer-impl", "--use-mcore-models",
          "--rotary-base", "--vocab-size", "--make-vocab-size-divisible-by"}


_SWITCHES = {"--sequence-parallel", "--use-distributed-optimizer", "--use-torch-fsdp2", "--optimizer-cpu-offload",
             "--bf16", "--fp16", "--grad-reduce-in-bf16", "--overlap-grad-reduce", "--overlap-param-gather",
             "--tp-comm-overlap", "--overlap-moe-expert-parallel-comm", "--use-flash-attn",
             "--no-masked-softmax-fusion", "--group-query-attention", "--swiglu",
             "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--use-mcore-models"}
"""Arguments that take no value (argparse's ``store_true``)."""
_ALIASES = {"--nproc_per_node": "--nproc-per-node", "--node_rank": "--node-rank", "--master_addr": "--master-addr",
            "--master_port": "--master-port"}
"""torchrun's underscore spellings, read as its dashed ones."""


def _int(args: dict[str, str | None], flag: str, default: int, source: str) -> int:
    """``flag``'s value, a whole number of at least 1 (every count Megatron-LM and torchrun
    take here), or ``default`` when it is not given."""
    value = args.get(flag)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise MpsimError(f"{source}: {flag} {value!r}: expected a whole number") from None
    if number < 1:
        raise MpsimError(f"{source}: {flag} {value}: expected at least 1")
    return number


def _seq_len(args: dict[str, str | None], where: Where, model: dict, source: str) -> int:
    """``--seq-length``, else the command line's ``--seq-len``, else the model's; the two
    given and different refused."""
    given = _int(args, "--seq-length", 0, source)
    if given and where.seq_len and given != where.seq_len:
        raise MpsimError(f"{source}: --seq-length {given} but --seq-len {where.seq_len}: give one")
    return given or where.seq_len or model.get("seq_len") or 1


def _world(args: dict[str, str | None], where: Where, source: str) -> int:
    """GPUs the script starts: torchrun's nodes x processes per node, else the servers' GPUs."""
    from mpsim.data.catalog import load_topology

    nodes = _int(args, "--nnodes", where.servers, source)
    if nodes != where.servers:
        raise MpsimError(f"--nnodes {nodes} but the job was given {where.servers} server(s); give --servers {nodes}")
    return nodes * _int(args, "--nproc-per-node", load_topology(where.server).spec.gpu.count, source)


def _check_shape(args: dict[str, str | None], model: dict, source: str) -> None:
    """The script's model shape must be the model's (``where.model``)."""
    expected = {"--num-layers": model["layers"], "--hidden-size": model["hidden"],
                "--num-attention-heads": model["heads"]}
    if args.get("--num-query-groups"):
        expected["--num-query-groups"] = model.get("kv_heads") or model["heads"]
    for flag, want in expected.items():
        if args.get(flag) is not None and _int(args, flag, 0, source) != want:
            raise MpsimError(f"{source}: {flag} {args[flag]} but the model has {want}; give the model the script "
                             "trains (--model)")


def _recipe_of(args: dict[str, str | None], source: str) -> str:
    recipe = args.get("--fp8-recipe")
    if args.get("--fp8-format") is not None:
        found = next((k for k, v in _FP8.items() if v == (recipe or "delayed")), None)
        if found is None:
            raise MpsimError(f"{source}: --fp8-recipe {recipe} is not modelled; expected one of "
                             f"{', '.join(_FP8.values())}")
        return found
    dtype = "bf16" if "--bf16" in args else "fp16" if "--fp16" in args else None
    if dtype is None:
        return "fp32"
    return f"mixed-{dtype}" if "--grad-reduce-in-bf16" in args else f"mixed-{dtype}-fp32grad"


def _context_attention(args: dict[str, str | None], source: str) -> ContextAttention:
    comm = args.get("--cp-comm-type") or "p2p"
    found: ContextAttention | None = next((k for k, v in _CP_COMM.items() if v == comm), None)
    if found is None:
        raise MpsimError(f"{source}: --cp-comm-type {comm} is not modelled; expected p2p, all_gather or a2a")
    return found


def _recompute_of(args: dict[str, str | None], source: str) -> tuple[Recompute, int | None]:
    granularity = args.get("--recompute-granularity")
    if granularity is None:
        return "none", None
    if granularity == "selective":
        return "selective", None
    method, n = args.get("--recompute-method"), _int(args, "--recompute-num-layers", 1, source)
    if granularity == "full" and method == "uniform" and n == 1:
        return "full", None
    if granularity == "full" and method == "block":
        return "full", n
    raise MpsimError(f"{source}: --recompute-granularity {granularity} --recompute-method {method} "
                     f"--recompute-num-layers {n} is not modelled; mpsim runs selective, full uniform 1 or full "
                     "block N")


def _bucket_mib(args: dict[str, str | None], source: str) -> float:
    from mpsim.plans.mesh import DEFAULT_BUCKET_MIB

    if args.get("--ddp-bucket-size") is None:
        return DEFAULT_BUCKET_MIB
    grad_bytes = 2 if "--grad-reduce-in-bf16" in args else 4
    return _int(args, "--ddp-bucket-size", 0, source) * grad_bytes / 2**20


def _runtime_of(args: dict[str, str | None]) -> str:
    if "--overlap-moe-expert-parallel-comm" in args:
        return "megatron-core-ep-overlap"
    if "--tp-comm-overlap" in args:
        return "megatron-core-tp-overlap"
    return "megatron-lm" if "--overlap-grad-reduce" in args else "megatron-lm-sync-grads"
