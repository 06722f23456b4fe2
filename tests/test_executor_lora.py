"""The executor's LoRA fine-tuning on CPU (gloo, torchrun): a tiny Llama config (2 layers, hidden
64, grouped-query attention, vocabulary 256, 256 tokens) traced with PEFT's adapters as
`mpsim trace --hf CONFIG --recipe fp32 --lora` traces it, and the same transformers model
fine-tuned by ``validate/finetune.py`` with PEFT's ``get_peft_model`` (r 8, all-linear), AdamW
over the adapters (about 10 s on 2 cores).

What is asserted, read off the rank itself: PEFT's trainable count is the trace's; the
parameters (the frozen base included), the adapters' gradients and AdamW's states are the
prediction's to the byte (AdamW's step counters aside); what autograd keeps per layer is the
trace's to the byte; and the peak is within 5% of the prediction once the head's backward
workspace is the measured one (a derived trace takes the head's forward workspace for it,
which is the whole of the shipped prediction's gap: reports/validation_lora_cpu.md).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("peft", reason="the hf extra")

from mpsim import api  # noqa: E402
from mpsim.models.finetune import FineTune  # noqa: E402
from mpsim.models.probe import probe  # noqa: E402
from mpsim.plans.job import Parallelism  # noqa: E402
from mpsim.studies.hardware_check import RunSettings, simulate_plan  # noqa: E402
from mpsim.studies.lora_check import (  # noqa: E402
    FineTuneModel,
    lora_trace,
    validate_lora_plan,
    with_head_backward_workspace,
)

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
          "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
          "attention_dropout": 0.0, "hidden_act": "silu", "rope_theta": 10000.0}
SPEC = FineTune(method="lora", r=8, lora_dropout=0.0)
SETTINGS = RunSettings(device="cpu", threads=1, warmup=0, steps=1)
ADAM_STEP_COUNTERS = 1024
"""Bytes AdamW's step counters may add to the measured optimizer states (one scalar per tensor)."""


@pytest.mark.torchrun
def test_lora_peak_within_5_percent_and_trainable_count_is_peft(tmp_path):
    from mpsim.executor.finetune import head_backward_workspace, saved_tensors_by_layer

    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    trace = lora_trace(str(config), SPEC)
    topo = probe("cpu", devices=1, threads=1, memory_mib=2048)[1]
    plan = api.plan(topo, trace, "1f1b", microbatches=2, n_stages=1, parallelism=Parallelism(data=1)).plan
    (tmp_path / "run").mkdir()
    report = validate_lora_plan(plan, topo, trace, CONFIG, SETTINGS, workdir=tmp_path / "run")
    model = FineTuneModel(CONFIG, 256, str(trace.spec.model["attention"]), SPEC.model_dump()).__dict__
    head_ws = head_backward_workspace(model, 1)
    again = simulate_plan(plan, topo, with_head_backward_workspace(trace, head_ws))
    rows = report["stages"]
    assert len(rows) == 1
    for r in rows:
        assert r["peft_params"]["trainable"] == r["predicted_trainable_params"] == trace.trained_params == 16384
        pred, held = r["predicted_breakdown"], r["measured_model_state_bytes"]
        assert held["params"] == pred["params"] and held["grads"] == pred["grads"]
        assert 0 <= held["optimizer"] - pred["optimizer"] <= ADAM_STEP_COUNTERS
        measured = r["measured_peak_bytes"]
        assert abs(again.gpus[r["gpu"]].peak_bytes - measured) / measured <= 0.05, r
        assert r["peak_error_pct"] < 0  # the shipped trace's head workspace is the forward's: under
        assert head_ws > next(x for x in trace.spec.layers if x.kind == "head").workspace_bytes
    saved = saved_tensors_by_layer(model, 1)
    rows_by_name = {x.name: x.act_bytes for x in trace.spec.layers}
    assert saved == {"layer0": rows_by_name["layer0"] + rows_by_name["embedding"], "layer1": rows_by_name["layer1"],
                     "head": rows_by_name["head"]}
    ranks = json.loads((tmp_path / "run" / "ranks" / "rank0.json").read_text())
    assert len(ranks["losses"]) == 3  # the setup step, the measured one, the timed one
