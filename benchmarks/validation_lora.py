"""LoRA and QLoRA fine-tuning predicted against measured on CPU: a tiny Llama config traced as
`mpsim trace --hf CONFIG --recipe fp32 --lora` traces it (FakeTensor, PEFT's adapters injected),
and the same transformers model fine-tuned by the executor's fine-tuning worker
(`validate/finetune.py` under torchrun, gloo: PEFT's `get_peft_model`, QLoRA's base as
`mpsim.models.adapters.QuantizedLinear`, AdamW over the adapters) on one rank and on two
data-parallel ranks; each rank's peak (MemTracker) against the simulator's prediction for its
GPU, and PEFT's trainable count against the trace's. Prints the markdown of
reports/validation_lora_cpu.md.

    python benchmarks/validation_lora.py > reports/validation_lora_cpu.md

The gap's attribution is measured here too: the bytes autograd keeps per layer
(`saved_tensors_hooks` on the real run) against the trace's rows, and the head's real
backward workspace against the one the derived trace assumes, with the prediction again
with the measured figure in the trace.
"""

from __future__ import annotations

import json
import platform
import tempfile
from pathlib import Path

from mpsim import api
from mpsim.executor.finetune import head_backward_workspace, saved_tensors_by_layer
from mpsim.models.finetune import FineTune
from mpsim.models.probe import probe
from mpsim.models.trace import Trace
from mpsim.plans.job import Parallelism
from mpsim.studies.hardware_check import RunSettings, simulate_plan
from mpsim.studies.lora_check import FineTuneModel, lora_trace, validate_lora_plan, with_head_backward_workspace

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
          "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
          "attention_dropout": 0.0, "hidden_act": "silu", "rope_theta": 10000.0}
"""A tiny Llama: 2 layers, hidden 64, 4 heads, 2 KV heads, MLP 128, vocabulary 256, 256 tokens."""
LORA = FineTune(method="lora", r=8, lora_dropout=0.0)
QLORA = FineTune(method="qlora", r=8, lora_dropout=0.0, quant="nf4")
LORA_DROPOUT = FineTune(method="lora", r=8, lora_dropout=0.05)
RUNS = [("LoRA", LORA, 1), ("LoRA", LORA, 2), ("QLoRA (NF4, double quant.)", QLORA, 1),
        ("QLoRA (NF4, double quant.)", QLORA, 2), ("LoRA, dropout 0.05", LORA_DROPOUT, 1)]  # (label, spec, dp)
MICROBATCHES = 2
SETTINGS = RunSettings(device="cpu", threads=1, warmup=1, steps=3)
MIB = 2**20
COLUMNS = ["fine-tune (r 8, all-linear)", "ranks", "GPU", "predicted peak MiB", "measured MiB", "peak error",
           "with measured head bwd workspace", "activations MiB (predicted / measured)",
           "trainable params (trace / PEFT)", "all params (trace / PEFT)"]


def _row(label: str, dp: int, report: dict, again: dict[int, int]) -> list[str]:
    rows = []
    for g in report["stages"]:
        pred, meas = g["predicted_breakdown"], g["measured_breakdown"]
        measured = g["measured_peak_bytes"]
        fixed = again[g["gpu"]]
        fixed_pct = 100 * (fixed - measured) / measured
        rows.append(f"| {label} | {dp} | {g['gpu']} | {g['predicted_peak_bytes'] / MIB:.3f} | {measured / MIB:.3f} | "
                    f"{g['peak_error_pct']:+.2f}% | {fixed / MIB:.3f} MiB, {fixed_pct:+.2f}% | "
                    f"{pred['activations'] / MIB:.3f} / {meas['activations'] / MIB:.3f} | "
                    f"{g['predicted_trainable_params']:,} / {g['peft_params']['trainable']:,} | "
                    f"{report['predicted_params']:,} / {g['peft_params']['all']:,} |")
    return rows


def _saved_rows(label: str, trace: Trace, model: FineTuneModel) -> str:
    """The bytes autograd keeps per layer: the trace's rows (a block's with the rotary tables
    the embedding's row holds) against the real run's."""
    real = saved_tensors_by_layer(model.__dict__, 1)
    rows = {r.name: r.act_bytes for r in trace.spec.layers}
    trace_l0 = rows["layer0"] + rows["embedding"]
    return (f"| {label} | {trace_l0:,} / {real.get('layer0', 0):,} | {rows['layer1']:,} / {real.get('layer1', 0):,} | "
            f"{rows['head']:,} / {real.get('head', 0):,} |")


def main() -> None:
    rows: list[str] = []
    saved: list[str] = []
    reports: dict[tuple[str, int], dict] = {}
    head_ws: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps(CONFIG))
        topo = probe("cpu", devices=2, threads=1)[1]
        traces = {spec.describe(): lora_trace(str(config), spec) for _l, spec, _d in RUNS}
        for label, spec, dp in RUNS:
            trace = traces[spec.describe()]
            plan = api.plan(topo, trace, "1f1b", microbatches=MICROBATCHES, n_stages=1,
                            parallelism=Parallelism(data=dp)).plan
            report = validate_lora_plan(plan, topo, trace, CONFIG, SETTINGS)
            model = FineTuneModel(CONFIG, int(trace.spec.model["seq_len"]), str(trace.spec.model["attention"]),
                                  spec.model_dump())
            if label not in head_ws:
                head_ws[label] = head_backward_workspace(model.__dict__, trace.spec.microbatch)
                saved.append(_saved_rows(label, trace, model))
            sim = simulate_plan(plan, topo, with_head_backward_workspace(trace, head_ws[label]))
            again = {g: sim.gpus[g].peak_bytes for g in range(len(sim.gpus))}
            reports[(label, dp)] = report
            rows += _row(label, dp, report, again)
    lora1 = reports[("LoRA", 1)]
    head = next(r for r in traces[LORA.describe()].spec.layers if r.kind == "head")
    drop = traces[LORA_DROPOUT.describe()]
    print(f"""# Validation of LoRA and QLoRA fine-tuning on CPU

Regenerated by `python benchmarks/validation_lora.py > reports/validation_lora_cpu.md` (about two minutes on
2 cores). The model is a tiny Llama config (2 layers, hidden 64, 4 heads, 2 KV heads, MLP 128, vocabulary
256, 256 tokens a sample, microbatch 1, {MICROBATCHES} microbatches a step, fp32), traced as
`mpsim trace --hf CONFIG --recipe fp32 --lora` traces it (FakeTensor, {traces[LORA.describe()].spec.model['attention']}
attention, PEFT's adapters injected by `peft.inject_adapter_in_model`: `mpsim.studies.lora_check.lora_trace`),
each plan simulated on a topology probed here for 2 CPU devices (1F1B on one stage, DDP over the
ranks), and run by the executor's fine-tuning worker (`validate/finetune.py`) under torchrun with gloo:
the same transformers model built from the config, PEFT's LoRA applied by `peft.get_peft_model` (r 8,
alpha 32, all-linear: q, k, v, o, gate, up and down of every block; the output head is frozen), for
QLoRA the blocks' linear layers replaced first by `mpsim.models.adapters.QuantizedLinear` (the packed
uint8 weight and its scales as bitsandbytes stores NF4 with double quantization; the real `dequantize`
writes zeros of the full weight's size, forward and backward, which is all memory needs), AdamW over the
trained parameters only, the trained gradients all-reduced over the ranks. Each rank's peak (MemTracker,
the step after the setup steps) is compared with the simulator's prediction for its GPU.
Machine: {platform.machine()}, torch {lora1['torch_version']}. Error = (predicted - measured) / measured;
target: every rank's peak within 5%. Activations: everything but parameters, gradients and AdamW's states.

| {' | '.join(COLUMNS)} |
|{'---|' * len(COLUMNS)}
{chr(10).join(rows)}

Parameters (the frozen base as stored: fp32, or for QLoRA the packed 4-bit weights and their scales),
gradients (the adapters' only) and AdamW's states agree to the byte on every rank (AdamW's step counters
aside). Trainable parameters: PEFT's own `get_nb_trainable_parameters` on each rank equals the
trace's count. All parameters: PEFT counts a `QuantizedLinear`'s packed uint8 weight by its elements (it
counts only bitsandbytes' own `Params4bit` as two weights a byte), the trace counts the weights the
layer stands for, so they agree for LoRA and not for QLoRA.

**What autograd keeps agrees to the byte.** Bytes saved for the backward per layer and microbatch, the
trace's row against the real run (`saved_tensors_hooks`; layer 0 with the rotary tables the embedding's
row holds, the head from the final norm on):

| fine-tune | layer 0 (trace / real) | layer 1 | head |
|---|---|---|---|
{chr(10).join(saved)}

With dropout 0.05 every adapter's `lora_dropout` keeps a 1-byte mask and `lora_A` keeps the dropped
input (4 bytes) beside the undropped one the frozen path's norm already holds: {drop.spec.layers[1].act_bytes -
traces[LORA.describe()].spec.layers[1].act_bytes:,} bytes a layer more here. The trace counts the mask as CUDA's fused
dropout keeps it (`kernels.CudaDropout`); the worker runs dropout the same way (CPU's `F.dropout`
would keep a 4-byte noise tensor instead, 3 bytes an element more).

**The gap is the head's backward workspace, not the adapters.** Every peak is in the loss head's
backward (cross-entropy and the vocabulary projection of the last microbatch). A derived trace has no
measured backward workspace and takes each layer's forward workspace for it: {head.workspace_bytes:,}
bytes for the head. Its real backward holds {head_ws['LoRA']:,} bytes beyond the input gradient (the
gradients of the log-softmax and of the logits at once, b s V x 4 bytes each, measured here as
`mpsim trace --measure` measures a layer); with that figure in the trace every prediction is within
the column "with measured head bwd workspace". At this size the logits (256 x 256) are a large part of
the activations; the same under-count grows with the vocabulary (Llama 3: 128,256).

Three things the executor does so that it runs what the trace counts, each found by comparing the
saved tensors and the tracker's peak (`validate/finetune.py`'s module doc):

- dropout as CUDA's fused kernel (a 1-byte mask), as above;
- mpsim's fused attention on CPU returns its output in the queries' memory layout, as its FakeTensor
  kernel and CUDA's fused kernels do: the reference CPU kernel returned it contiguous, so
  `transpose(1, 2).contiguous()` copied it and the `o_proj` adapter kept that copy, 65,536 bytes a
  layer the trace (rightly, for CUDA) does not count;
- the embedding's output is made to require gradients by adding a zero scalar that requires them,
  not by PEFT's `requires_grad_` on the output: that makes the output a leaf, and MemTracker's module
  hooks keep such a leaf and its gradient alive after the backward, so the tracker counted every
  earlier microbatch's (131,072 bytes each); a run without the tracker frees them.

Iteration time is not a target here: the trace is derived (no kernel table for a CPU).""")


if __name__ == "__main__":
    main()
