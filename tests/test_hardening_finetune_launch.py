"""Bad input to the fine-tuning flags (``--lora``, ``--qlora``, ``--peft-config``,
``--lora-rank``) and the launch configurations (``plan/choose --emit``, ``simulate --from``),
through the command line: each is refused in one line (``mpsim: error: ...``, exit 2), never
a traceback, never a hang, and a refused ``--emit`` leaves no file behind.

What broke before the fixes: a PEFT config or launch file that was a FIFO hung and
``/dev/zero`` was read without end; JSON nested too deeply or with a 5,000-digit number, a
Megatron script with unbalanced quotes, a zero or non-numeric degree, a header of the wrong
type, integer YAML keys and a target_modules regex that does not compile were tracebacks;
repeated keys, ``"8"``/``true`` for a rank and ``"yes"`` for use_dora were read silently;
``--emit FORMAT=`` wrote the default file, ``--emit`` to one file twice (or onto the plan)
overwrote it, and a refused write left the other files behind; writing to a FIFO hung.

Refusals come before any model is traced or planned, so every case here is quick. The
FIFO and device cases run ``mpsim`` in a subprocess with a timeout (as
tests/test_hardening_files.py does), so a regression fails instead of hanging."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from mpsim.cli import app, main
from mpsim.datafile import MAX_SMALL_FILE_BYTES
from mpsim.launch import megatron
from mpsim.launch.formats import Where

HANG_BOUND_S = 120
"""A refusal is immediate; this only turns a hang into a failure, even on a busy machine."""

MEGATRON = """#!/bin/bash
torchrun --nproc-per-node 8 pretrain_gpt.py \\
  --tensor-model-parallel-size 1 \\
  --pipeline-model-parallel-size 1 \\
  --micro-batch-size 1 \\
  --global-batch-size 128 \\
  --seq-length 2048 \\
  --bf16 \\
  --grad-reduce-in-bf16 \\
  --overlap-grad-reduce \\
  --ddp-bucket-size 13107200 \\
  --num-layers 22 \\
  --hidden-size 2048 \\
  --num-attention-heads 32
"""
DEEPSPEED = {"train_batch_size": 128, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 16,
             "bf16": {"enabled": True}, "zero_optimization": {"stage": 0},
             "mpsim": {"header": ['mpsim job: {"seq_len":2048,"recipe":"mixed-bf16"}']}}
ACCELERATE = """# mpsim job: {"seq_len":2048,"recipe":"mixed-bf16"}
# training script (not Accelerate's):
#   per_device_train_batch_size: 1
#   gradient_accumulation_steps: 16
distributed_type: MULTI_GPU
mixed_precision: bf16
num_machines: 1
num_processes: 8
"""
TORCHTITAN = """[model]
name = "llama3"
flavor = "8B"

[training]
local_batch_size = 1
global_batch_size = 128
seq_len = 8192

[parallelism]
data_parallel_shard_degree = 8
tensor_parallel_degree = 1

[activation_checkpoint]
mode = "none"
"""
SIM = ["--model", "tinyllama-1.1b", "--server", "dgx-h100"]
PLAN = ["plan", "--model", "tinyllama-1.1b", "--server", "dgx-h100", "--dp", "8", "--microbatch", "1", "-o", "p.json"]


def _refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The one line ``mpsim ARGS`` (in-process) prints when it refuses them with exit 2; a
    traceback fails the test by escaping ``main``."""
    capsys.readouterr()
    assert main(list(args)) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("mpsim: error: ") and "\n" not in line, line
    return line.removeprefix("mpsim: error: ")


def _refused_apart(cwd: Path, *args: str) -> str:
    """The same, in a subprocess with a timeout: for FIFOs and devices, which could hang."""
    try:
        done = subprocess.run([sys.executable, "-m", "mpsim.cli", *args], capture_output=True, text=True, cwd=cwd,
                              timeout=HANG_BOUND_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"mpsim {' '.join(args)} hung")
    line = done.stderr.strip()
    assert done.returncode == 2, done.stderr
    assert line.startswith("mpsim: error: ") and "\n" not in line, done.stderr
    return line.removeprefix("mpsim: error: ")


# --- fine-tuning flags -------------------------------------------------------------------

PEFT_CONFIGS = [
    ('{"r": 0}', "r: Input should be greater than or equal to 1"),
    ('{"r": -4}', "r: Input should be greater than or equal to 1"),
    ('{"r": 1000000000}', "r: Input should be less than or equal to 65536"),
    ('{"r": 1e300}', "r: "),
    ('{"r": "8"}', "r: Input should be a valid integer"),
    ('{"r": true}', "r: Input should be a valid integer"),
    ('{"r": 8.5}', "r: Input should be a valid integer"),
    ('{"r": ' + "9" * 5000 + "}", "not JSON (Exceeds the limit"),
    ('{"r": 8, "r": 16}', "repeats the key 'r'"),
    ('{"lora_alpha": -16}', "lora_alpha: Input should be greater than 0"),
    ('{"lora_alpha": "x"}', "lora_alpha: Input should be a valid number"),
    ('{"lora_alpha": NaN}', "lora_alpha: Input should be a finite number"),
    ('{"lora_dropout": 1.5}', "lora_dropout: Input should be less than 1"),
    ('{"lora_dropout": Infinity}', "lora_dropout: Input should be a finite number"),
    ('{"use_dora": "yes"}', "use_dora: Input should be a valid boolean"),
    ('{"target_modules": []}', "expected at least one target module"),
    ('{"target_modules": ""}', "expected at least one target module"),
    ('{"target_modules": "(("}', "'((' is not a regular expression"),
    ('{"target_modules": 5}', "target_modules"),
    ('{"target_modules": [1, 2]}', "target_modules"),
    ('{"modules_to_save": "lm_head"}', "modules_to_save: Input should be a valid list"),
    ('{"peft_type": "IA3"}', "peft_type 'IA3' is not modelled"),
    ('{"bias": "all"}', 'bias = "all" is not modelled'),
    ('{"layers_to_transform": [0]}', "layers_to_transform = [0] is not modelled"),
    ('{"foo": 1}', "foo = 1 is not modelled"),
    ("[1, 2]", "expected a JSON object"),
    ("[" * 100_000 + "]" * 100_000, "not JSON (nested too deeply)"),
    ('{"r": 8,', "not JSON (Expecting property name"),
    ("", "not JSON (Expecting value, line 1)"),
]


@pytest.mark.parametrize(("text", "expected"), PEFT_CONFIGS, ids=[f"peft{i}" for i in range(len(PEFT_CONFIGS))])
def test_a_bad_peft_config_is_refused_in_one_line(tmp_path, capsys, text, expected):
    config = tmp_path / "adapter_config.json"
    config.write_text(text)
    line = _refused(capsys, "simulate", *SIM, "--peft-config", str(config))
    assert line.startswith(f"--peft-config {config}: ") and expected in line, line


@pytest.mark.parametrize(("make", "expected"), [
    (lambda d: d / "missing.json", "missing.json: cannot read PEFT config file (No such file or directory)"),
    (lambda d: d, "adapter_config.json: cannot read PEFT config file (No such file or directory)"),
    (lambda d: d / "bin.json", "bin.json: not UTF-8 text (byte 0)"),
])
def test_a_peft_config_that_is_no_json_file_is_refused(tmp_path, capsys, make, expected):
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00garbage")
    line = _refused(capsys, "simulate", *SIM, "--peft-config", str(make(tmp_path)))
    assert expected in line, line


@pytest.mark.parametrize("command", [["simulate"], ["plan", "-o", "x.json"], ["choose", "--model", "tinyllama-1.1b"],
                                     ["fits"], ["trace", "-o", "x.json"], ["validate"]])
def test_every_command_with_the_flags_refuses_a_bad_config(tmp_path, capsys, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    Path("dup.json").write_text('{"r": 8, "r": 16}')
    assert _refused(capsys, *command, "--peft-config", "dup.json") == "--peft-config dup.json: repeats the key 'r'; " \
                                                                     "give it once"
    assert not Path("x.json").exists()


@pytest.mark.parametrize(("flags", "expected"), [
    (["--lora", "--lora-rank", "0"], "0 is not in the range 1<=x<=65536"),
    (["--lora", "--lora-rank", "-1"], "-1 is not in the range 1<=x<=65536"),
    (["--lora", "--lora-rank", "99999999"], "99999999 is not in the range 1<=x<=65536"),
    (["--lora", "--lora-rank", "abc"], "'abc' is not a valid integer range"),
    (["--lora", "--qlora"], "--lora and --qlora: give one"),
    (["--lora-rank", "8"], "--lora-rank: give --lora or --qlora too"),
    (["--lora-rank", "8", "--peft-config", "x.json"], "--lora-rank with --peft-config"),
])
def test_bad_fine_tuning_flags_are_refused(capsys, flags, expected):
    assert expected in _refused(capsys, "simulate", *SIM, *flags)


@pytest.mark.skipif(not hasattr(os, "mkfifo") or not Path("/dev/zero").exists(), reason="needs FIFOs and /dev/zero")
def test_a_peft_config_that_is_a_fifo_or_a_device_does_not_hang(tmp_path):
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "model").mkdir()
    os.mkfifo(tmp_path / "model" / "adapter_config.json")
    fifo = "is a named pipe (FIFO), not a regular file"
    assert _refused_apart(tmp_path, "simulate", *SIM, "--peft-config", "fifo.json") == \
        f"--peft-config fifo.json: cannot read PEFT config file: it {fifo}"
    assert _refused_apart(tmp_path, "simulate", *SIM, "--peft-config", "model") == \
        f"--peft-config model/adapter_config.json: cannot read PEFT config file: it {fifo}"
    assert _refused_apart(tmp_path, "simulate", *SIM, "--peft-config", "/dev/zero") == \
        "--peft-config /dev/zero: cannot read PEFT config file: it is a character device, not a regular file"


def test_a_huge_peft_config_is_refused_before_it_is_read(tmp_path, capsys):
    big = tmp_path / "big.json"
    with big.open("wb") as f:  # sparse: no disk used
        f.truncate(MAX_SMALL_FILE_BYTES + 1)
    assert f"PEFT config file is {MAX_SMALL_FILE_BYTES + 1:,} bytes" in _refused(capsys, "simulate", *SIM,
                                                                                  "--peft-config", str(big))


# --- simulate --from -------------------------------------------------------------------------

def _edited(old: str, new: str) -> str:
    assert old in MEGATRON
    return MEGATRON.replace(old, new)


MEGATRON_CASES = [
    (_edited("--bf16", "--bf16 'unterminated"), "not a shell script mpsim can read (No closing quotation)"),
    (_edited("--tensor-model-parallel-size 1", "--tensor-model-parallel-size abc"),
     "--tensor-model-parallel-size 'abc': expected a whole number"),
    (_edited("--tensor-model-parallel-size 1", "--tensor-model-parallel-size 0"),
     "--tensor-model-parallel-size 0: expected at least 1"),
    (_edited("--tensor-model-parallel-size 1", "--tensor-model-parallel-size -2"),
     "--tensor-model-parallel-size -2: expected at least 1"),
    (_edited("--tensor-model-parallel-size 1", "--tensor-model-parallel-size 3"),
     "8 GPUs do not split into tensor 3 x pipeline 1"),
    (_edited("--tensor-model-parallel-size 1", "--tensor-model-parallel-size="),
     "--tensor-model-parallel-size '': expected a whole number"),
    (_edited("--micro-batch-size 1", "--micro-batch-size 0"), "--micro-batch-size 0: expected at least 1"),
    (_edited("--micro-batch-size 1", "--micro-batch-size 1e3"), "--micro-batch-size '1e3': expected a whole number"),
    (_edited("--nproc-per-node 8", "--nproc-per-node 0"), "--nproc-per-node 0: expected at least 1"),
    (_edited("--nproc-per-node 8", "--nproc-per-node x"), "--nproc-per-node 'x': expected a whole number"),
    (_edited("--nproc-per-node 8", "--nproc-per-node 7"), "no whole number of micro-batches x data-parallel size"),
    (_edited("--nproc-per-node 8", "--nnodes 0 --nproc-per-node 8"), "--nnodes 0: expected at least 1"),
    (_edited("--ddp-bucket-size 13107200", "--ddp-bucket-size lots"), "--ddp-bucket-size 'lots': expected a whole"),
    (_edited("--ddp-bucket-size 13107200", "--ddp-bucket-size 0"), "--ddp-bucket-size 0: expected at least 1"),
    (_edited("--seq-length 2048", "--seq-length 0"), "--seq-length 0: expected at least 1"),
    (_edited("--seq-length 2048", "--seq-length"), "--seq-length: expected a value after it"),
    (_edited("--bf16", "--bf16=yes"), "--bf16=yes: it is a switch and takes no value"),
    (_edited("--global-batch-size 128", "--global-batch-size -128"), "--global-batch-size -128: expected at least 1"),
    (_edited("--overlap-grad-reduce", "--recompute-granularity full --recompute-method block --recompute-num-layers 0"),
     "--recompute-num-layers 0: expected at least 1"),
    (_edited("--pipeline-model-parallel-size 1",
             "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 5"),
     "--num-layers-per-virtual-pipeline-stage 5: 22 layers do not split into 2 stages"),
    (_edited("--pipeline-model-parallel-size 1",
             "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 0"),
     "--num-layers-per-virtual-pipeline-stage 0: expected at least 1"),
    (_edited("--overlap-grad-reduce", "--unknown-flag"), "--unknown-flag is not modelled by mpsim"),
    (_edited("--num-layers 22", "--num-layers 40"), "--num-layers 40 but the model has 22"),
    ("", "no Megatron-LM argument in it"),
    ("#!/bin/bash\n# nothing\n", "no Megatron-LM argument in it"),
    (TORCHTITAN, "no Megatron-LM argument in it"),
]


@pytest.mark.parametrize(("text", "expected"), MEGATRON_CASES, ids=[f"megatron{i}" for i in range(len(MEGATRON_CASES))])
def test_a_bad_megatron_script_is_refused_in_one_line(tmp_path, capsys, text, expected):
    script = tmp_path / "train.sh"
    script.write_text(text)
    line = _refused(capsys, "simulate", "--from", str(script), *SIM)
    assert expected in line, line


def test_a_megatron_option_given_twice_keeps_the_last_as_argparse_does():
    where = Where("tinyllama-1.1b", "dgx-h100")
    twice = _edited("--tensor-model-parallel-size 1", "--tensor-model-parallel-size 1 --tensor-model-parallel-size 2")
    assert megatron.parse(twice, "train.sh", where).tensor == 2
    assert megatron.parse(MEGATRON, "train.sh", where).tensor == 1


def _deepspeed(**changes: object) -> str:
    return json.dumps({**DEEPSPEED, **changes})


DEEPSPEED_CASES = [
    ('{"train_micro_batch_size_per_gpu": 1, "train_micro_batch_size_per_gpu": 2}',
     "JSON repeats the key 'train_micro_batch_size_per_gpu'"),
    ("[" * 100_000 + "]" * 100_000, "not JSON (nested too deeply)"),
    ('{"a": ' * 100_000 + "1" + "}" * 100_000, "not JSON (nested too deeply)"),
    ('{"train_micro_batch_size_per_gpu": ' + "9" * 5000 + "}", "not JSON (Exceeds the limit"),
    ('{"a": 1,,}', "not JSON (Expecting property name"),
    ("", "not JSON (Expecting value, line 1)"),
    ("[1, 2]", "expected a JSON object"),
    (_deepspeed(train_micro_batch_size_per_gpu="1"), "train_micro_batch_size_per_gpu '1': expected a whole number"),
    (_deepspeed(train_micro_batch_size_per_gpu=True), "train_micro_batch_size_per_gpu True: expected a whole number"),
    (_deepspeed(train_micro_batch_size_per_gpu=0), "train_micro_batch_size_per_gpu 0: expected a whole number"),
    (_deepspeed(train_micro_batch_size_per_gpu=1e300), "train_micro_batch_size_per_gpu 1e+300: expected a whole"),
    (_deepspeed(train_micro_batch_size_per_gpu=1.5), "train_micro_batch_size_per_gpu 1.5: expected a whole number"),
    (_deepspeed(fp16="yes"), "fp16 'yes': expected an object"),
    (_deepspeed(zero_optimization={"stage": 1.0}), "zero_optimization.stage 1.0: expected 0-3"),
    (_deepspeed(zero_optimization={"stage": "3"}), "zero_optimization.stage '3': expected 0-3"),
    (_deepspeed(zero_optimization={"stage": 0, "reduce_bucket_size": 10**30}), "bucket_mib: Input should be less"),
    (_deepspeed(mpsim={"header": ['mpsim job: {"seq_len":2048,"pipeline":"x"}']}),
     "the header's pipeline 'x': expected a whole number"),
    (_deepspeed(mpsim={"header": ['mpsim job: {"seq_len":"long"}']}), "seq_len: Input should be a valid integer"),
    (_deepspeed(mpsim={"header": ["mpsim job: " + "[" * 100_000 + "]" * 100_000]}),
     "not the header's mpsim job as JSON (nested too deeply)"),
    (_deepspeed(mpsim={"header": ['mpsim job: {"seq_len": ' + "9" * 5000 + "}"]}),
     "not the header's mpsim job as JSON (Exceeds the limit"),
    (_deepspeed(train_batch_size=1024), "64 replicas of 1 stage need 64 GPUs but dgx-h100 has 8"),
]


@pytest.mark.parametrize(("text", "expected"), DEEPSPEED_CASES,
                         ids=[f"deepspeed{i}" for i in range(len(DEEPSPEED_CASES))])
def test_a_bad_deepspeed_config_is_refused_in_one_line(tmp_path, capsys, text, expected):
    config = tmp_path / "ds.json"
    config.write_text(text)
    assert expected in _refused(capsys, "simulate", "--from", str(config), *SIM)


def test_a_deepspeed_header_runtime_of_the_wrong_type_is_read_as_none_given():
    from mpsim.launch import deepspeed

    config = _deepspeed(mpsim={"header": ['mpsim job: {"seq_len":2048,"runtime":[1]}']})
    assert deepspeed.parse(config, "ds.json", Where("tinyllama-1.1b", "dgx-h100")).runtime == "deepspeed"


ACCELERATE_CASES = [
    (ACCELERATE + "num_processes: 4\n", "not YAML (duplicate key 'num_processes'"),
    (ACCELERATE + "  bad: [unclosed\n", "not YAML ("),
    ("[" * 10_000 + "]" * 10_000, "not YAML (nested too deeply)"),
    ("- 1\n- 2\n", "expected a mapping"),
    ("!!python/object/apply:os.system ['echo pwned']\n", "not YAML (could not determine a constructor"),
    (ACCELERATE.replace("distributed_type: MULTI_GPU", "distributed_type: FSDP")
     + "parallelism_config: {dp_replicate_size: a, dp_shard_size: b}\nfsdp_config: {fsdp_sharding_strategy: "
       "FULL_SHARD}\n", "dp_replicate_size a x dp_shard_size b is not num_processes 8"),
    (ACCELERATE + "parallelism_config: {1: 2, tp_size: 2}\n", "parallelism_config tp_size 2"),
    (ACCELERATE.replace("num_processes: 8", "num_processes: '8'"), "num_processes '8': expected the GPUs"),
    (ACCELERATE.replace("num_processes: 8", "num_processes: 0"), "num_processes 0: expected the GPUs"),
    (ACCELERATE.replace("num_processes: 8", "num_processes: 16").replace("steps: 16", "steps: 8"),
     "16 replicas of 1 stage need 16 GPUs but dgx-h100 has 8"),
    (ACCELERATE.replace("batch_size: 1", "batch_size: -1"), "microbatch: Input should be greater than or equal to 1"),
    (ACCELERATE.replace("batch_size: 1", "batch_size: " + "9" * 5000), "per_device_train_batch_size '999"),
    (ACCELERATE.replace("steps: 16\n", "steps: 16\n#   ddp_bucket_cap_mb: nan\n"),
     "bucket_mib: Input should be a finite number"),
    (ACCELERATE.replace('{"seq_len":2048,', '[' * 100_000 + ']' * 100_000 + ' #{'),
     "the header's mpsim job: not JSON (nested too deeply)"),
    (ACCELERATE.replace('"seq_len":2048', '"seq_len":"2048"'), "seq_len: Input should be a valid integer"),
]


@pytest.mark.parametrize(("text", "expected"), ACCELERATE_CASES,
                         ids=[f"accelerate{i}" for i in range(len(ACCELERATE_CASES))])
def test_a_bad_accelerate_config_is_refused_in_one_line(tmp_path, capsys, text, expected):
    config = tmp_path / "acc.yaml"
    config.write_text(text)
    assert expected in _refused(capsys, "simulate", "--from", str(config), *SIM)


TORCHTITAN_CASES = [
    (TORCHTITAN.replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 1\ntensor_parallel_degree = 2"),
     "not a TOML file: Cannot overwrite a value"),
    (TORCHTITAN + "[broken\n", "not a TOML file: Expected ']'"),
    ("a = " + "[" * 100_000 + "]" * 100_000 + "\n", "not a TOML file: nested too deeply"),
    (TORCHTITAN.replace("tensor_parallel_degree = 1", "tensor_parallel_degree = " + "9" * 5000),
     "not a TOML file: Exceeds the limit"),
    (TORCHTITAN.replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 9223372036854775807"),
     "tensor: Input should be less than or equal to"),
    (TORCHTITAN.replace("tensor_parallel_degree = 1", 'tensor_parallel_degree = "2"'),
     "parallelism.tensor_parallel_degree '2': expected a whole number"),
    (TORCHTITAN.replace("tensor_parallel_degree = 1", "tensor_parallel_degree = true"),
     "parallelism.tensor_parallel_degree True: expected a whole number"),
    (TORCHTITAN.replace("tensor_parallel_degree = 1", "tensor_parallel_degree = nan"),
     "parallelism.tensor_parallel_degree nan: expected a whole number"),
    (TORCHTITAN.replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 0"),
     "parallelism.tensor_parallel_degree 0: expected at least 1"),
    (TORCHTITAN.replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 3"),
     "8 replicas of 1 stage of 3 GPUs each need 24 GPUs but dgx-h100 has 8"),
    (TORCHTITAN.replace("seq_len = 8192", "seq_len = 0"), "training.seq_len 0: expected at least 1"),
    (TORCHTITAN + "[zzz]\nfoo = 1\n", "zzz is not modelled by mpsim"),
]


@pytest.mark.parametrize(("text", "expected"), TORCHTITAN_CASES,
                         ids=[f"torchtitan{i}" for i in range(len(TORCHTITAN_CASES))])
def test_a_bad_torchtitan_config_is_refused_in_one_line(tmp_path, capsys, text, expected):
    config = tmp_path / "job.toml"
    config.write_text(text)
    assert expected in _refused(capsys, "simulate", "--from", str(config), "--model", "llama-3-8b", "--server",
                                "dgx-h100")


CROSS = [("megatron", "ds.json", "no Megatron-LM argument in it"),
         ("megatron", "job.toml", "no Megatron-LM argument in it"),
         ("megatron", "acc.yaml", "no Megatron-LM argument in it"),
         ("torchtitan", "train.sh", "not a TOML file"), ("torchtitan", "ds.json", "not a TOML file"),
         ("torchtitan", "acc.yaml", "not a TOML file"),
         ("deepspeed", "train.sh", "not JSON"), ("deepspeed", "job.toml", "not JSON"),
         ("deepspeed", "acc.yaml", "not JSON"),
         ("accelerate", "train.sh", "expected a mapping"), ("accelerate", "job.toml", "not YAML"),
         ("accelerate", "ds.json", "does not state the sequence length")]


@pytest.mark.parametrize(("fmt", "name", "expected"), CROSS)
def test_each_format_refuses_a_file_of_another(tmp_path, capsys, fmt, name, expected):
    for file, text in (("train.sh", MEGATRON), ("job.toml", TORCHTITAN), ("ds.json", json.dumps(DEEPSPEED)),
                       ("acc.yaml", ACCELERATE)):
        (tmp_path / file).write_text(text)
    line = _refused(capsys, "simulate", "--from", str(tmp_path / name), "--from-format", fmt, *SIM)
    assert expected in line, line


@pytest.mark.parametrize(("args", "expected"), [
    (["--from", "missing.sh", *SIM], "--from missing.sh: cannot read launch configuration file (No such file"),
    (["--from", ".", *SIM], "is a directory"),
    (["--from", "bin.sh", *SIM], "--from bin.sh: not UTF-8 text (byte 3): expected a megatron configuration"),
    (["--from", "train.noext", *SIM], "cannot tell its format from the suffix '.noext'; give --from-format"),
    (["--from", "train.sh", "--from-format", "zzz", *SIM], "'zzz' is not one of 'megatron', 'torchtitan'"),
    (["--from", "train.sh", "--server", "dgx-h100"], "--from needs --model"),
    (["--from", "train.sh", *SIM, "--tp", "2"], "--tp and --from: the configuration states it"),
    (["--from", "train.sh", *SIM, "--lora"], "--lora and --from: the configuration states it"),
    (["--from", "train.sh", *SIM, "--plan", "p.json"], "--from and --plan each give the whole job"),
    (["--from", "train.sh", *SIM, "--seq-len", "4096"], "--seq-length 2048 but --seq-len 4096: give one"),
])
def test_simulate_from_refuses_bad_files_and_flags(tmp_path, capsys, monkeypatch, args, expected):
    monkeypatch.chdir(tmp_path)
    Path("train.sh").write_text(MEGATRON)
    Path("train.noext").write_text(MEGATRON)
    Path("bin.sh").write_bytes(b"--x\xff\xfe")
    line = _refused(capsys, "simulate", *args)
    assert expected in line, line


@pytest.mark.skipif(not hasattr(os, "mkfifo") or not Path("/dev/zero").exists(), reason="needs FIFOs and /dev/zero")
def test_simulate_from_a_fifo_or_a_device_does_not_hang(tmp_path):
    os.mkfifo(tmp_path / "fifo.sh")
    (tmp_path / "zero.sh").symlink_to("/dev/zero")
    assert _refused_apart(tmp_path, "simulate", "--from", "fifo.sh", *SIM) == \
        "--from fifo.sh: cannot read launch configuration file: it is a named pipe (FIFO), not a regular file"
    assert _refused_apart(tmp_path, "simulate", "--from", "zero.sh", *SIM) == \
        "--from zero.sh: cannot read launch configuration file: it is a character device, not a regular file"


def test_a_huge_launch_file_is_refused_before_it_is_read(tmp_path, capsys):
    big = tmp_path / "big.sh"
    with big.open("wb") as f:
        f.truncate(MAX_SMALL_FILE_BYTES + 1)
    assert f"launch configuration file is {MAX_SMALL_FILE_BYTES + 1:,} bytes" in _refused(
        capsys, "simulate", "--from", str(big), *SIM)


# --- plan/choose --emit ----------------------------------------------------------------------------

@pytest.mark.parametrize(("emits", "expected"), [
    (["zzz"], "--emit/--from format 'zzz': expected one of megatron, torchtitan, deepspeed, accelerate"),
    (["MEGATRON"], "--emit/--from format 'MEGATRON'"),
    ([""], "--emit/--from format ''"),
    (["=x.sh"], "--emit/--from format ''"),
    (["megatron="], "--emit megatron=: give a file after '=' or leave '=' out"),
    (["megatron=nodir/x.sh"], "nodir/x.sh: cannot write it: the folder nodir does not exist"),
    (["megatron=adir"], "adir: cannot write it: it is a folder"),
    (["megatron=same.sh", "deepspeed=same.sh"], "same.sh is already the megatron file; give each its own file"),
    (["megatron", "megatron"], "p.megatron.sh is already the megatron file"),
    (["megatron=p.json"], "p.json is already the plan file"),
    (["megatron=ok.sh", "deepspeed=nodir/x.json"], "nodir/x.json: cannot write it: the folder nodir does not exist"),
    (["megatron=/dev/full"], "/dev/full: cannot write it: it is not a regular file"),
])
def test_a_bad_emit_is_refused_and_writes_nothing(tmp_path, capsys, monkeypatch, emits, expected):
    monkeypatch.chdir(tmp_path)
    Path("adir").mkdir()
    args = [a for e in emits for a in ("--emit", e)]
    line = _refused(capsys, *PLAN, *args)
    assert expected in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir"]


def test_a_plan_file_that_cannot_be_written_leaves_no_configuration(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = _refused(capsys, *PLAN[:-1], "nodir/p.json", "--emit", "megatron=ok.sh")
    assert line == "nodir/p.json: cannot write it: the folder nodir does not exist"
    assert list(tmp_path.iterdir()) == []


def test_emit_refuses_a_fine_tune_before_tracing_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _refused(capsys, *PLAN, "--lora", "--emit", "megatron") == \
        "--emit: fine-tunes (LoRA, QLoRA) are written for no framework yet"
    assert _refused(capsys, "choose", "--model", "tinyllama-1.1b", "--servers", "h100-x1", "--lora", "--emit",
                    "megatron") == "--emit: fine-tunes (LoRA, QLoRA) are written for no framework yet"
    assert _refused(capsys, "choose", "--model", "tinyllama-1.1b", "--servers", "h100-x1", "--emit",
                    "megatron=") .startswith("--emit megatron=: give a file after '='")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_emitting_to_a_fifo_does_not_hang(tmp_path):
    os.mkfifo(tmp_path / "fifo.sh")
    plan = [*PLAN[:-1], "p.json"]
    assert _refused_apart(tmp_path, *plan, "--emit", "megatron=fifo.sh") == \
        "fifo.sh: cannot write it: it is not a regular file"
    assert _refused_apart(tmp_path, *plan[:-1], "fifo.sh") == "fifo.sh: cannot write it: it is not a regular file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo.sh"]


def test_good_emits_still_write_each_file_and_read_back(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([*PLAN, "--emit", "megatron", "--emit", "deepspeed=ds.json"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.json", "p.json", "p.megatron.sh"]
    assert main(["simulate", "--from", "p.megatron.sh", *SIM]) == 0


# --- help ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("command", "options"), [
    ("simulate", ["--lora", "--qlora", "--peft-config", "--lora-rank", "--from", "--from-format"]),
    ("plan", ["--lora", "--qlora", "--peft-config", "--lora-rank", "--emit"]),
    ("choose", ["--lora", "--qlora", "--peft-config", "--lora-rank", "--emit"]),
    ("fits", ["--lora", "--qlora", "--peft-config", "--lora-rank"]),
    ("trace", ["--lora", "--qlora", "--peft-config", "--lora-rank"]),
    ("validate", ["--lora", "--qlora", "--peft-config", "--lora-rank"]),
])
def test_help_says_what_each_flag_does(command, options):
    cmd = app.commands[command]
    helps = {o: p.help for p in cmd.params if isinstance(p, click.Option) for o in p.opts}
    for option in options:
        assert len(helps.get(option) or "") > 20, (command, option)
    with click.Context(cmd, info_name=command) as ctx:
        text = cmd.get_help(ctx)
    assert all(option in text for option in options)
