"""``trace``: a model as a trace file, from a preset or a shape, any PyTorch module, or a
Hugging Face config."""

from __future__ import annotations

from pathlib import Path

import click

from mpsim import api
from mpsim.cli.options import FiniteFloatRange, fine_tune_options
from mpsim.errors import MpsimError

ATTENTION_HELP = ("attention kernel whose saved tensors and FLOPs the trace records: eager (written out), "
                  "fused-softmax (Megatron), mem-efficient (xFormers/CUTLASS), flash (FlashAttention-2)  "
                  "[default: the preset's; otherwise what PyTorch picks on --server's GPU: flash from A100 on, "
                  "mem-efficient before; flash without --server]")
FRAMEWORK_HELP = ("how the Llama layer is written, which sets what it keeps for the backward (parameters and FLOPs "
                  "are the same): megatron (fused q|k|v, fused RMSNorm, RoPE tables rebuilt in every layer), hf "
                  "(transformers: separate q, k, v, eager fp32 RMSNorm, RoPE tables built once and shared), "
                  "torchtitan (separate q, k, v, fused RMSNorm, RoPE tables built once and shared); GPT and BERT "
                  "layers are the same in each  [default: megatron; with --hf: hf]")


def _list_presets(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        from mpsim.views.text import presets_text

        click.echo(presets_text(api.presets()))
        ctx.exit(0)


@click.command()
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="trace JSON file to write")
@click.option("--preset", help="start from a shipped configuration (gpt-5.3b, llama-3-8b ...; "
                               "see `mpsim trace --list`); other options override it")
@click.option("--list", "list_presets", is_flag=True, is_eager=True, expose_value=False, callback=_list_presets,
              help="list the presets and exit")
@click.option("--module", "module_spec", metavar="SPEC",
              help="trace your own model: package.module:build or file.py:build returning (blocks, example input); "
                   "shipped CNNs: mpsim.models.cnn:resnet50, vgg16, inception_v3 ... (README); --recipe defaults to "
                   "fp32")
@click.option("--family", type=click.Choice(["gpt", "bert", "llama"]),
              help="model family: gpt (GPT-2), bert, llama (RMSNorm, SwiGLU, RoPE, GQA: Llama, Mistral, Qwen2)  "
                   "[default: gpt]")
@click.option("--layers", type=click.IntRange(min=1), help="transformer layers  [default: 16]")
@click.option("--hidden", type=click.IntRange(min=1), help="hidden size  [default: 5120]")
@click.option("--heads", type=click.IntRange(min=1), help="attention heads, dividing hidden  [default: 40]")
@click.option("--kv-heads", type=click.IntRange(min=1), help="key/value heads (grouped-query attention), "
                                                            "dividing heads  [default: heads]")
@click.option("--ffn-hidden", type=click.IntRange(min=1), help="MLP inner size  [default: 4 x hidden]")
@click.option("--seq-len", type=click.IntRange(min=1), help="sequence length  [default: 1024]")
@click.option("--vocab", type=click.IntRange(min=1), help="vocabulary size  [default: 50257]")
@click.option("--dropout", type=FiniteFloatRange(min=0, max=1, max_open=True),
              help="dropout probability; 0 keeps no masks  [default: the preset's]")
@click.option("--attention", type=click.Choice(["eager", "fused-softmax", "mem-efficient", "flash"]),
              help=ATTENTION_HELP)
@click.option("--framework", type=click.Choice(["megatron", "hf", "torchtitan"]), help=FRAMEWORK_HELP)
@click.option("--server", "-s", help="with no --attention: pick the kernel PyTorch uses on this server's GPUs")
@click.option("--microbatch", type=click.IntRange(min=1), help="samples per microbatch  [default: the preset's]")
@click.option("--recipe", type=click.Choice(list(api.RECIPES)),
              help="training precision: " + api.RECIPE_HELP + "  [default: the preset's]")
@fine_tune_options
@click.option("--name", help="name stored in the trace  [default: the preset's, else from the shape]")
@click.option("--measure", is_flag=True, help="run the layers for real on --device and record measured times and bytes")
@click.option("--device", default="cpu", show_default=True, help="with --measure: cpu, cuda or cuda:N")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="with --measure on CPU: intra-op threads (as each pipeline process will have)")
@click.option("--repeats", type=click.IntRange(min=1), default=10, show_default=True,
              help="with --measure: timed runs per layer (the median is kept)")
@click.option("--hf", "hf_source", metavar="SOURCE",
              help="trace a Hugging Face model with its own modules: a folder with config.json, a config.json or "
                   "a shipped one (llama-2-7b, llama-3-70b, mistral-7b, qwen2.5-7b, gpt2-xl ...); takes --layers, "
                   "--hidden, --heads, --seq-len, --microbatch, --recipe, --attention, --server, --name; its "
                   "layers are the hf framework")
def trace(output: Path, preset: str | None, family: str | None, layers: int | None, hidden: int | None,
          heads: int | None, kv_heads: int | None, ffn_hidden: int | None, seq_len: int | None, vocab: int | None,
          dropout: float | None, attention: str | None, server: str | None, microbatch: int | None,
          recipe: str | None, fine_tune: api.FineTune | None, name: str | None, measure: bool, device: str,
          threads: int, repeats: int, module_spec: str | None = None, hf_source: str | None = None,
          framework: str | None = None) -> None:
    """Trace a model: a preset or a GPT, BERT or Llama-style shape.

    By default under FakeTensor mode (no memory allocated): per layer the saved-for-backward
    bytes the CUDA kernels keep, parameters, FLOPs and bytes moved; times are derived per
    GPU when simulated. `--preset llama-3-8b -o llama.json` traces a public model;
    `--preset gpt-5.3b -o traces/gpt-5.3b.json` regenerates a shipped trace.

    With --measure the layers run on --device: measured forward and backward times, real
    saved bytes and the backward's transient memory go into the trace, with the device
    named (`--preset gpt-tiny --measure --device cpu -o tiny.json`).

    With --module any PyTorch model cut into pipeline layers is traced, one row per layer
    (`--module mpsim.models.cnn:resnet50 -o resnet50.json`).

    With --hf a Hugging Face model is traced with its own modules from its config.json
    (`--hf llama-3-70b -o llama.json`; no weights, no network).

    --framework writes a Llama layer as Megatron-LM, transformers or torchtitan do
    (`--preset llama-3-8b --framework hf`); the trace's model names it.

    --lora, --qlora or --peft-config trace a fine-tune: the model's transformers modules
    frozen under PEFT's adapters (`--hf llama-3-8b --qlora -o q.json`; a preset is traced
    through the shipped config.json of its shape). A --module model's parameters that do
    not require gradients are counted as frozen.
    """
    from mpsim.views.text import trace_line

    if module_spec is not None and hf_source is not None:
        raise MpsimError("--module and --hf each name a whole model: give one of them")
    _check_framework(framework, module_spec, hf_source)
    if fine_tune is not None and (module_spec is not None or measure):
        raise MpsimError("--lora, --qlora and --peft-config trace transformers modules under FakeTensor: not with "
                         "--module (freeze your own parameters instead) or --measure")
    if module_spec is not None:
        if measure:
            raise MpsimError("--module traces under FakeTensor mode; --measure is for the GPT, BERT and Llama shapes")
        result = api.trace_module(module_spec, microbatch, recipe, name)
    elif hf_source is not None:
        others = {"--preset": preset, "--family": family, "--kv-heads": kv_heads, "--ffn-hidden": ffn_hidden,
                  "--vocab": vocab, "--dropout": dropout, "--measure": measure or None}
        unsupported = [k for k, v in others.items() if v is not None]
        if unsupported:
            raise MpsimError(f"--hf does not take {', '.join(unsupported)}: set them in the config.json")
        overrides = {k: v for k, v in {"layers": layers, "hidden": hidden, "heads": heads, "seq_len": seq_len}.items()
                     if v is not None}
        api.check_hf(hf_source, overrides)  # before torch loads: a config asking too much is refused at once
        kernel = attention or api.default_attention(server, recipe)
        result = api.trace_hf(hf_source, microbatch, recipe, kernel, overrides, name, fine_tune)
    else:
        shape = {"family": family, "layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
                 "ffn_hidden": ffn_hidden, "seq_len": seq_len, "vocab": vocab, "dropout": dropout,
                 "framework": framework}
        measured = api.Measure(device, threads, repeats) if measure else None
        result = api.trace_shape(preset, shape, attention, server, microbatch, recipe, name, measured)
        if fine_tune is not None:  # through the shipped config.json of its shape
            result = api.at_finetune(result, fine_tune, name=name)
    output.write_text(result.to_json() + "\n")
    click.echo(trace_line(output, result))


def _check_framework(framework: str | None, module_spec: str | None, hf_source: str | None) -> None:
    """--framework is for presets and shapes: --hf runs transformers' own modules (the hf
    framework by definition), --module the user's."""
    if framework is None:
        return
    if module_spec is not None:
        raise MpsimError("--framework is for presets and shapes; --module traces your own modules as they are written")
    if hf_source is not None and framework != "hf":
        raise MpsimError(f"--hf traces transformers' own modules, the hf framework; for --framework {framework} "
                         "trace a preset or a shape (--preset NAME --framework ...)")
