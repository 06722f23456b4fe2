"""``mpsim topo probe``'s GPU links: nvidia-smi's table, rocm-smi's on AMD GPUs, and without
either tool every pair across sockets, said in the file."""

from __future__ import annotations

from mpsim.models import probe

ROCM_SHOWTOPOTYPE = """
============================ ROCm System Management Interface ============================
=============================== Link Type between two GPUs ===============================
       GPU0         GPU1         GPU2         GPU3
GPU0   0            XGMI         XGMI         PCIE
GPU1   XGMI         0            XGMI         XGMI
GPU2   XGMI         XGMI         0            XGMI
GPU3   PCIE         XGMI         XGMI         0
================================== End of ROCm SMI Log ===================================
"""


def test_rocm_smis_link_types_read_as_nvidia_smis_labels() -> None:
    matrix = probe.rocm_links(ROCM_SHOWTOPOTYPE)
    assert matrix == [["X", "NV1", "NV1", "PHB"], ["NV1", "X", "NV1", "NV1"], ["NV1", "NV1", "X", "NV1"],
                      ["PHB", "NV1", "NV1", "X"]]
    pairs = [(a, b) for a in range(4) for b in range(a + 1, 4) if matrix[a][b].startswith("NV")]
    assert len(pairs) == 5  # the full mesh but the PCIe pair


def test_rows_out_of_order_or_no_rows_are_no_table() -> None:
    assert probe.rocm_links("GPU1 XGMI 0\nGPU0 0 XGMI") is None
    assert probe.rocm_links("no GPUs here") is None


def test_without_either_tool_every_pair_crosses_sockets_and_the_file_says_so(monkeypatch) -> None:
    monkeypatch.setattr(probe.shutil, "which", lambda _name: None)
    matrix, said = probe.link_matrix(3)
    assert matrix == [["X", "SYS", "SYS"], ["SYS", "X", "SYS"], ["SYS", "SYS", "X"]]
    assert "no nvidia-smi or rocm-smi topology found" in said


def test_rocm_smi_is_read_when_nvidia_smi_is_absent(monkeypatch) -> None:
    monkeypatch.setattr(probe, "nvidia_smi_matrix", lambda: None)
    monkeypatch.setattr(probe, "rocm_smi_matrix", lambda: probe.rocm_links(ROCM_SHOWTOPOTYPE))
    matrix, said = probe.link_matrix(4)
    assert matrix[0][1] == "NV1" and said == "links from rocm-smi --showtopotype"


NVIDIA_SMI_TOPO = """\tGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\tSYS\t0-47\t0\t\tN/A
GPU1\tNV18\t X \tPIX\t0-47\t0\t\tN/A
GPU2\tSYS\tPIX\t X \t48-95\t1\t\tN/A

Legend:

  X    = Self
"""


def test_nvidia_smis_header_line_is_not_a_gpu_row() -> None:
    assert probe._gpu_rows(NVIDIA_SMI_TOPO) == [["X", "NV18", "SYS"], ["NV18", "X", "PIX"], ["SYS", "PIX", "X"]]
