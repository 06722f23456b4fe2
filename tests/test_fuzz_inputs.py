"""Mutated shipped files through the command line: a result, or one line and exit 2.

Each example takes a shipped topology, trace or a plan written by ``mpsim plan``, breaks
it (a value of another type, sign or magnitude, a non-finite number, a deleted key,
truncated text, bytes that are not UTF-8, a repeated key) and runs ``mpsim topo check``
or ``mpsim simulate`` in-process. Whatever the input, the command ends with exit 0 or 1
and its usual output, or exit 2 and exactly one line on stderr: never a traceback, never
a hang (each run has a time limit; simulations stay small: 8 microbatches).
"""

from __future__ import annotations

import copy
import itertools
import json
import re
from pathlib import Path

import pytest
import yaml
from helpers import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGY = yaml.safe_load((ROOT / "topologies" / "dgx1-v100.yaml").read_text())
TRACE = json.loads((ROOT / "traces" / "gpt-5.3b.json").read_text())
RUN_LIMIT_S = 60
MICROBATCHES = "8"

FUZZ = settings(derandomize=True, deadline=None, max_examples=35, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# Replacement values: other types, signs, magnitudes and non-finite numbers.
VALUES = st.sampled_from([
    None, True, "", "x", "1e400", [], {}, [1, 2], {"a": 1},
    0, -1, 1, 2, 3, 7, 2**31, 2**53 + 1, 2**63, 10**30, -(10**30),
    0.0, -0.0, 0.5, -2.5, 1e-320, 1e-9, 1e9, 1e300, 1.7976931348623157e308,
    float("inf"), float("-inf"), float("nan"),
])


def _paths(obj, prefix=()):
    """Every path to a value inside nested dicts and lists (the root excluded)."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield prefix + (k,)
        yield from _paths(v, prefix + (k,))


def _apply(obj, path, value, delete: bool):
    obj = copy.deepcopy(obj)
    *head, last = path
    target = obj
    for k in head:
        target = target[k]
    if delete:
        del target[last]
    else:
        target[last] = value
    return obj


def _get(obj, path):
    for k in path:
        obj = obj[k]
    return obj


@st.composite
def structured(draw, base: dict) -> dict:
    """``base`` with one or two values changed: mostly a number scaled, negated or replaced
    by another type or magnitude, sometimes a key or list item deleted."""
    out = base
    for _ in range(draw(st.integers(1, 2))):
        paths = list(_paths(out))
        leaves = [p for p in paths if not isinstance(_get(out, p), dict | list)]
        path = draw(st.sampled_from(leaves if leaves and draw(st.integers(0, 4)) else paths))
        old = _get(out, path)
        how = draw(st.sampled_from(["scale", "scale", "replace", "replace", "delete"]))
        if how == "scale" and isinstance(old, int | float) and not isinstance(old, bool):
            factor = draw(st.sampled_from([0, -1, 0.5, 2, 1000, 10**12, 10**30, 1e300]))
            value = old * factor
            out = _apply(out, path, int(value) if isinstance(old, int) and abs(value) < 1e300 else value, False)
        else:
            out = _apply(out, path, draw(VALUES), delete=how == "delete")
    return out


@st.composite
def corrupted(draw, text: str) -> bytes:
    """``text`` broken as bytes: truncated, with invalid bytes, another encoding, a number
    spelt as a non-finite or huge one, or a line repeated (a repeated key)."""
    how = draw(st.sampled_from(["truncate", "bytes", "utf16", "number", "repeat", "nest"]))
    data = text.encode()
    if how == "truncate":
        return data[: draw(st.integers(0, len(data) - 1))]
    if how == "bytes":
        at = draw(st.integers(0, len(data)))
        return data[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\x00", b"\xe9t\xe9", b"\xed\xa0\x80"])) + data[at:]
    if how == "utf16":
        return text.encode("utf-16")
    if how == "number":
        numbers = list(re.finditer(r"(?<![\w.])\d+(\.\d+)?(?![\w.])", text))
        m = draw(st.sampled_from(numbers))
        new = draw(st.sampled_from([".inf", "-.inf", ".nan", "NaN", "Infinity", "-Infinity", "1e400", "1" * 40,
                                    "-" + m.group(0), "0x10", "1_000"]))
        return (text[: m.start()] + new + text[m.end():]).encode()
    if how == "nest":
        depth = draw(st.sampled_from([50, 5000]))
        return ("[" * depth).encode() + data
    lines = text.splitlines(keepends=True)
    i = draw(st.integers(0, len(lines) - 1))
    return "".join(lines[: i + 1] + [lines[i]] + lines[i + 1:]).encode()


_counter = itertools.count()


def _write(tmp_path: Path, suffix: str, data: bytes) -> str:
    # a new name per example: parsed files are cached by path and modification time
    path = tmp_path / f"fuzz{next(_counter)}{suffix}"
    path.write_bytes(data)
    return str(path)


def _cli(*argv: str) -> tuple[int, str, str]:
    return run_cli(RUN_LIMIT_S, *argv)


def _check(code: int, out: str, err: str, expect_on_success: str) -> None:
    assert "Traceback" not in out + err
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith("mpsim: error: ") and len(lines[0]) < 2000, lines[0][:300]
    else:
        assert code in (0, 1), (code, err)
        assert expect_on_success in out, out[-500:]


def _dump_yaml(d: object) -> bytes:
    return yaml.safe_dump(d, sort_keys=False, allow_unicode=True).encode()


def _dump_json(d: object) -> bytes:
    return json.dumps(d).encode()


def _topology_then_simulate(tmp_path: Path, data: bytes) -> None:
    path = _write(tmp_path, ".yaml", data)
    code, out, err = _cli("topo", "check", path)
    assert code in (0, 2)
    _check(code, out, err, ": ok (")
    if code == 0:
        _check(*_cli("simulate", "--server", path, "--microbatches", MICROBATCHES), "iteration")


@FUZZ
@given(d=structured(TOPOLOGY))
def test_mutated_topology(tmp_path_factory, d):
    _topology_then_simulate(tmp_path_factory.mktemp("topo"), _dump_yaml(d))


@FUZZ
@given(data=corrupted((ROOT / "topologies" / "dgx1-v100.yaml").read_text()))
def test_corrupted_topology_text(tmp_path_factory, data):
    _topology_then_simulate(tmp_path_factory.mktemp("topo"), data)


def _simulate_trace(tmp_path: Path, data: bytes) -> None:
    path = _write(tmp_path, ".json", data)
    _check(*_cli("simulate", "--model", path, "--microbatches", MICROBATCHES), "iteration")


@FUZZ
@given(d=structured(TRACE))
def test_mutated_trace(tmp_path_factory, d):
    _simulate_trace(tmp_path_factory.mktemp("trace"), _dump_json(d))


@FUZZ
@given(data=corrupted(json.dumps(TRACE, indent=1)))
def test_corrupted_trace_text(tmp_path_factory, data):
    _simulate_trace(tmp_path_factory.mktemp("trace"), data)


@pytest.fixture(scope="module")
def plan_dict(tmp_path_factory) -> dict:
    """A plan written by ``mpsim plan`` (recompute, so that it lists actions)."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    code, _, err = _cli("plan", "--strategy", "recompute", "--microbatches", MICROBATCHES, "-o", str(path))
    assert code == 0, err
    return json.loads(path.read_text())


@FUZZ
@given(data=st.data())
def test_mutated_plan(tmp_path_factory, plan_dict, data):
    mutated = data.draw(structured(plan_dict)) if data.draw(st.booleans()) else None
    raw = _dump_json(mutated) if mutated is not None else data.draw(corrupted(json.dumps(plan_dict, indent=1)))
    path = _write(tmp_path_factory.mktemp("plan"), ".json", raw)
    _check(*_cli("simulate", "--plan", path), "iteration")


HF_CONFIGS = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "vocab_size": 1000, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "hidden_act": "silu", "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1,
              "eos_token_id": 2},
    "gemma2": {"model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 1000,
               "max_position_embeddings": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "sliding_window": 64, "query_pre_attn_scalar": 16, "pad_token_id": 0, "bos_token_id": 1,
               "eos_token_id": 2},
}


@FUZZ
@given(data=st.data())
def test_mutated_hugging_face_config(tmp_path_factory, data):
    """A config with one or two fields changed (other types, signs, magnitudes, deleted):
    traced, or refused in one line; never a traceback."""
    pytest.importorskip("transformers", reason="the hf extra")
    config = data.draw(structured(HF_CONFIGS[data.draw(st.sampled_from(sorted(HF_CONFIGS)))]))
    tmp_path = tmp_path_factory.mktemp("hf")
    path = _write(tmp_path, ".json", _dump_json(config))
    _check(*_cli("trace", "--hf", path, "-o", str(tmp_path / "out.json")), "wrote ")
