"""Stage-to-GPU mapping search (MPress III-C, Fig. 6).

Stages that must shed memory (exporters) should sit next to stages with spare memory
(importers) over as many NVLinks as possible, and consecutive stages should be NVLink
neighbours so pipeline sends do not cross PCIe. For each mapping, spare memory is
assigned to exporters as MPress's ``assign_mem`` does from one GPU's point of view:
each exporter, largest demand first, spreads its demand over its NVLink neighbours with
spare memory in proportion to link bandwidth (what striping will do), capped by their
spare. A mapping is scored, best first, by

1. consecutive stages without an NVLink between them,
2. demand left uncovered by neighbours' spare memory (it would go to host memory),
3. the longest D2D swap time of any exporter (MPress's score is its reciprocal).

Every mapping of stages to GPUs is enumerated (8! = 40320 on a DGX-1), vectorised over
mappings with numpy; symmetric servers (NVSwitch, or all pairs alike) skip the search as
MPress does, since every mapping scores the same. Above ``MAX_ENUMERATED_GPUS`` GPUs the
search is a local one (pairwise swaps from the identity until none helps).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mpsim.hardware.topology import Topology

MAX_ENUMERATED_GPUS = 9


def nvlink_bandwidth(topo: Topology) -> np.ndarray:
    """bw[a, b]: NVLink bytes/s from GPU a to GPU b (0 when not NVLink neighbours)."""
    n = topo.n_gpus
    bw = np.zeros((n, n))
    for a in range(n):
        for b in range(n):
            if a != b and topo.nvlinks_between(a, b):
                bw[a, b] = topo.route(a, b).bandwidth
    return bw


def is_symmetric(topo: Topology) -> bool:
    """Every GPU pair has the same NVLink bandwidth (NVSwitch or a full mesh)."""
    bw = nvlink_bandwidth(topo)
    off = bw[~np.eye(topo.n_gpus, dtype=bool)]
    return bool(len(off) == 0 or np.all(off == off[0]))


@dataclass(frozen=True)
class Mapping:
    gpus: tuple[int, ...]
    """GPU of each stage."""
    pcie_boundaries: int
    uncovered_bytes: float
    d2d_s: float
    searched: int
    """Mappings scored."""


def _score(maps: np.ndarray, bw: np.ndarray, demand: np.ndarray, spare: np.ndarray) -> tuple[np.ndarray, ...]:
    """Scores of mappings ``maps`` [M, n] (slot -> GPU; slots past the stages are idle GPUs)."""
    n_maps, n = maps.shape
    p = len(demand)
    link = bw[maps[:, :, None], maps[:, None, :]]  # [M, slot, slot]
    boundaries = (link[:, np.arange(p - 1), np.arange(1, p)] == 0).sum(axis=1)
    room = np.tile(spare, (n_maps, 1)).astype(float)
    uncovered = np.zeros(n_maps)
    worst = np.zeros(n_maps)
    for e in np.argsort(-demand, kind="stable"):
        need = np.full(n_maps, float(demand[e]))
        if demand[e] <= 0:
            break
        sent = np.zeros((n_maps, n))
        for _ in range(n):  # water-filling: capped neighbours drop out, the rest share what is left
            open_ = (room - sent > 0) & (link[:, e, :] > 0)
            w = np.where(open_, link[:, e, :], 0.0)
            total = w.sum(axis=1)
            active = (need > 1e-6 * max(1.0, demand[e])) & (total > 0)
            if not active.any():
                break
            share = np.where(active[:, None], w * (need / np.where(total > 0, total, 1.0))[:, None], 0.0)
            take = np.minimum(share, room - sent)
            sent += take
            need -= take.sum(axis=1)
        room -= sent
        uncovered += need
        t = np.where(link[:, e, :] > 0, sent / np.where(link[:, e, :] > 0, link[:, e, :], 1.0), 0.0).max(axis=1)
        worst = np.maximum(worst, t)
    return boundaries, uncovered, worst


def _best(maps: np.ndarray, scores: tuple[np.ndarray, ...]) -> int:
    boundaries, uncovered, worst = scores
    order = np.lexsort((worst.round(9), uncovered.round(0), boundaries))
    return int(order[0])


@functools.lru_cache(maxsize=8)
def _every_map(n: int, p: int) -> np.ndarray:
    """Every map of p stages to n GPUs [M, n] (slot -> GPU), one order of the idle GPUs
    kept (idle slots are interchangeable); made once per (n, p), read-only."""
    maps = np.array(list(itertools.permutations(range(n))), dtype=np.int64)
    if p < n and n - p > 1:
        maps = maps[np.all(np.diff(maps[:, p:], axis=1) > 0, axis=1)]
    maps.setflags(write=False)
    return maps


def search_mapping(topo: Topology, demand_bytes: Sequence[float], spare_bytes: Sequence[float]) -> Mapping:
    """The best stage-to-GPU map for per-stage D2D demand and spare memory (bytes).

    GPUs without a stage are importers with all their capacity spare.
    """
    n, p = topo.n_gpus, len(demand_bytes)
    bw = nvlink_bandwidth(topo)
    demand = np.array(list(demand_bytes) + [0.0] * (n - p))
    spare = np.array(list(spare_bytes) + [float(topo.capacity_bytes)] * (n - p))
    identity = np.arange(n)[None, :]
    if is_symmetric(topo) or p == 1:
        boundaries, uncovered, worst = _score(identity, bw, demand, spare)
        return Mapping(tuple(range(p)), int(boundaries[0]), float(uncovered[0]), float(worst[0]), 1)
    if n <= MAX_ENUMERATED_GPUS:
        maps = _every_map(n, p)
        scores = _score(maps, bw, demand, spare)
        i = _best(maps, scores)
        return Mapping(tuple(int(g) for g in maps[i, :p]), int(scores[0][i]), float(scores[1][i]),
                       float(scores[2][i]), len(maps))
    current = np.arange(n)
    searched = 0
    while True:
        cands = [current]
        for a, b in itertools.combinations(range(n), 2):
            m = current.copy()
            m[a], m[b] = m[b], m[a]
            cands.append(m)
        maps = np.array(cands)
        scores = _score(maps, bw, demand, spare)
        searched += len(maps)
        i = _best(maps, scores)
        if i == 0:
            return Mapping(tuple(int(g) for g in current[:p]), int(scores[0][0]), float(scores[1][0]),
                           float(scores[2][0]), searched)
        current = maps[i]
