"""What was measured beside what was predicted, as text: ``mpsim validate``'s table
(``mpsim.studies.hardware_check``) and ``mpsim calibrate``'s fit (``mpsim.timing.calibrate``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mpsim.sim.memory import MODEL_STATES

if TYPE_CHECKING:
    from mpsim.timing.calibrate import Calibration


def calibration_text(cal: Calibration) -> str:
    """The fitted values and one line per timed row with its residual."""
    e = cal.efficiency
    lines = [f"{cal.trace_name} on {cal.server} ({cal.dtype}): matmul {e.matmul:.3f}, attention {e.attention:.3f}, "
             f"memory {e.memory:.3f}",
             f"fitted: {', '.join(cal.fitted)}"]
    if cal.kept:
        lines.append("kept (no such work in the trace): " + ", ".join(f"{k} {v:.3f}" for k, v in cal.kept.items()))
    lines.append(f"source: {e.source}")
    lines.append(f"{'layer':<16} {'phase':<5} {'measured ms':>12} {'fitted ms':>12} {'residual':>9}")
    for r in cal.rows:
        lines.append(f"{r.layer:<16} {r.phase:<5} {r.measured_ms:12.4f} {r.fitted_ms:12.4f} {r.residual_pct:8.2f}%")
    lines.append(f"rms residual {cal.rms_residual_pct:.2f}% over {len(cal.rows)} timed rows")
    return "\n".join(lines)


def _mib(n: float) -> str:
    return f"{n / 2**20:9.1f}"


def _reserved_lines(rows: list[dict]) -> list[str]:
    """Predicted reserved peak per stage (``mpsim.sim.reserved``), and the measured one
    (``max_memory_reserved``) where the run was on CUDA."""
    cells = []
    for row in rows:
        if "predicted_reserved_bytes" not in row:
            continue
        cell = f"stage {row['stage']} {_mib(row['predicted_reserved_bytes']).strip()}"
        if "measured_reserved_bytes" in row:
            cell += f" / {_mib(row['measured_reserved_bytes']).strip()} ({row['reserved_error_pct']:+.1f}%)"
        cells.append(cell)
    if not cells:
        return []
    measured = any("measured_reserved_bytes" in row for row in rows)
    head = "reserved MiB, predicted / measured: " if measured else "reserved MiB, predicted (measured on CUDA only): "
    return [head + "; ".join(cells), ""]


def validation_text(report: dict) -> str:
    """The report as a table a person reads."""
    lines = [f"{report['model']} on {report['server']} ({report['device']}), {report['schedule']}, "
             f"{report['microbatches']} x {report['microbatch']} samples, plan {report['strategy']}", ""]
    head = (f"{'stage':>5} {'layers':>8}  {'peak MiB':>20} {'error':>7}   "
            f"{'weights':>17} {'grads':>17} {'optimizer':>17} {'other':>17}")
    lines += [head, f"{'':>5} {'':>8}  {'predicted  measured':>20} {'':>7}   " + "   pred / meas    " * 4]
    for row in report["stages"]:
        a, b = row["layers"]  # half-open, as in the plan
        pb = row["predicted_breakdown"]
        if "measured_peak_bytes" in row:
            mb = row["measured_breakdown"]
            kinds = (*MODEL_STATES, "activations")
            cells = "".join(f" {_mib(pb[k]).strip():>8}/{_mib(mb[k]).strip():<8}" for k in kinds)
            lines.append(f"{row['stage']:>5} {f'[{a}, {b})':>8}  {_mib(row['predicted_peak_bytes'])} "
                         f"{_mib(row['measured_peak_bytes'])} {row['peak_error_pct']:+6.1f}%  {cells}")
        else:
            lines.append(f"{row['stage']:>5} {f'[{a}, {b})':>8}  {_mib(row['predicted_peak_bytes'])} {'-':>9}")
    lines += ["(memory in MiB = 2^20 bytes; layers [a, b) = a to b - 1, as in the plan)", ""]
    lines += _reserved_lines(report["stages"])
    if report["oom"]:
        o = report["oom"]
        pred = "predicted it" if not report["predicted_fits"] else "the simulator predicted it fits"
        lines.append(f"OUT OF MEMORY: stage {o['stage']} (GPU {o['gpu']}) at step {o['step']}, {o['phase']} "
                     f"({o['message']}); {pred}")
    else:
        lines.append(f"iteration: predicted {report['predicted_iteration_s'] * 1e3:.1f} ms, measured "
                     f"{report['measured_iteration_s'] * 1e3:.1f} ms ({report['iteration_error_pct']:+.1f}%)")
    return "\n".join(lines)
